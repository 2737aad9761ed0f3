"""The one import point of moerun's native CPU kernels, with a pure-torch reference beside
every native op.

The kernel path is chosen once at run time from the CPU (`moerun._native` checks it), the
fastest the CPU has of: `generic` (portable C++), `avx2` (AVX2 + FMA + F16C), `avxvnni` (the
same 256-bit kernels with vpdpbusd dot products), `avx512vnni` (its int4 / int8 GEMMs 512 bits
wide, the same results, and its decode attention, in another summation order), `avx512bf16`
(avx512vnni with bf16 weight rows as vdpbf16ps dot products: no widening of the weights,
and float32 activations that are not bf16 values taken as two bf16 halves, within 2^-17)
and `amx` (GEMMs of 16 or more tokens on AMX-INT8 tiles, the same results again; where
Linux grants the tile state; bf16 rows as avx512bf16 runs them). `MOERUN_ISA=torch|generic|avx2|...`
forces a path (`torch` runs the references, which is also what happens when the extension
is not built).

Ops: quantized linears (`qlinear`, and `qlinear_multi` for several weights of one input),
the fused routed experts of a layer (`moe_experts`), decode attention over a cache
(`attn_decode`) and a whole attention block for a few tokens of one row
(`attn_block_decode`, `layers.attention.attention_fuses`), Gated DeltaNet's conv + delta rule + gated norm for a few tokens
(`deltanet_decode`) and RMSNorm of a few rows (`rms_norm`). The linear ops and the experts
also take float32 and bf16 weights as they are (`float_packed`, `moe_experts_float`,
`native_float_linears`), so a float model's decode steps run natively too; prefill keeps
torch's GEMMs for them. Decode on a small model is
mostly per-call overhead (a native call with its tensor conversions costs ~20-40 us, a
small torch op ~3-5 us), so the decode-side ops exist to make one call out of many.

Threads: the native pool is resized to `torch.get_num_threads()` before each op, so
`--threads N` (which sets torch's count) sizes both; the two pools take turns, never run
at once, because each native op is a synchronous call inside the model's forward. Taking
turns is not free in decode, where a step alternates dozens of tiny torch ops with native
ops: torch's OpenMP workers keep spinning after each of their ops and steal the cores our
workers need. `split_threads(net)` fixes that for a model with native modules (quantized,
or float MoE, whose decode steps are native too): the native pool is
pinned to N threads and torch runs its own (small) ops on one thread whenever a forward
pass carries few tokens (measured: decode 1.7x faster with 2 threads,
benchmarks/vs_llamacpp.py prints both). In those passes the native workers also spin for
`DECODE_SPIN_US` between ops instead of 50 us before they sleep: torch's one thread does not
need their cores, and a worker woken from sleep joins a small op late or not at all
(measured once on 4 Qwen3-30B-shaped int4 layers: attention projections 9.2 vs 11.0 ms,
experts 9.3 vs 10.9 ms per token; later runs put the difference within this machine's noise).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from . import formats, reference

# M rows, K in features, N out features, T tokens, H hidden, I expert width, E experts,
# K experts per token (in moe_experts)

_state = {"loaded": False, "native": None, "error": None, "torch_only": False, "threads": 0, "spin_us": 50}
IDLE_SPIN_US = 50  # native workers' spin before sleeping while torch may need the cores
DECODE_SPIN_US = 3000  # ... while torch runs on one thread (few-token passes under split_threads)


def _native():
    """The extension module with MOERUN_ISA applied, or None when the torch path is in use."""
    if not _state["loaded"]:
        _state["loaded"] = True
        try:
            from .. import _native as nat
        except ImportError as e:  # not built: everything runs on the references
            _state["error"] = str(e)
        else:
            _state["native"] = nat
            forced = os.environ.get("MOERUN_ISA", "").strip().lower()
            if forced:
                set_isa(forced)
    return None if _state["torch_only"] else _state["native"]


def available_isas() -> list[str]:
    """Paths this machine can run, slowest first: 'torch', then the native ones."""
    _native()
    nat = _state["native"]
    return ["torch"] + (list(nat.available_isas()) if nat is not None else [])


def native() -> bool:
    """Whether the native kernels run (`isa() != "torch"`, in one call: hot paths ask per op)."""
    return _native() is not None


def isa() -> str:
    """The kernel path in use: 'torch', 'generic', 'avx2', 'avxvnni', 'avx512vnni' or 'amx'."""
    nat = _native()
    return "torch" if nat is None else nat.isa()


def set_isa(name: str) -> None:
    """Force a kernel path ('torch' runs the pure-torch references)."""
    _native()
    if name == "torch":
        _state["torch_only"] = True
        return
    nat = _state["native"]
    if nat is None:
        raise RuntimeError(f"ISA {name!r} needs the native extension, which did not load: {_state['error']}")
    if name not in nat.available_isas():
        raise RuntimeError(f"ISA {name!r} is not available on this CPU; available: {', '.join(available_isas())}")
    nat.set_isa(name)
    _state["torch_only"] = False


@contextlib.contextmanager
def use_isa(name: str):
    before = isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(before)


def describe() -> str:
    """One line for `moerun info`: which kernels run and why."""
    nat = _native()
    if nat is None:
        why = "forced by MOERUN_ISA" if _state["torch_only"] else f"native extension not loaded: {_state['error']}"
        return f"torch reference kernels ({why})"
    feats = [k for k, v in sorted(nat.cpu_features().items()) if v]
    return f"native {nat.isa()} kernels (CPU: {' '.join(feats) or 'baseline'})"


def set_threads(n: int | None) -> None:
    """Pin the native pool to n threads (None: follow torch's count again)."""
    _state["pinned"] = n


def _sync_threads(nat) -> None:
    n = _state.get("pinned") or torch.get_num_threads()
    if n != _state["threads"]:
        nat.set_threads(n)
        _state["threads"] = n


def set_watch_shared(on: bool) -> None:
    """Whether the native pool watches for a shared CPU (csrc/thread_pool.h `set_watch`)."""
    nat = _native()
    if nat is not None and on != _state.get("watch", True):
        nat.set_watch_shared(on)
        _state["watch"] = on


def set_spin(us: int) -> None:
    """How long idle native workers spin before they sleep (microseconds)."""
    nat = _native()
    if nat is not None and us != _state["spin_us"]:
        nat.set_spin_us(us)
        _state["spin_us"] = us


def _f32(t: torch.Tensor) -> torch.Tensor:
    # the common case (already contiguous float32) without the two no-op calls: decode makes
    # dozens of these a token
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()


FLOAT_DTYPES = (torch.float32, torch.bfloat16)  # what the native ops read as they are: weights, activations, caches


def _act(t: torch.Tensor) -> torch.Tensor:
    """An activation as the ops that read bf16 ones take it (qlinear_multi, swiglu_mlp,
    route_softmax_topk, moe_experts, moe_experts_float, rms_norm, the fused attention): a
    contiguous float32 or bf16 tensor as it is (bf16 is widened exactly inside), else float32.
    A bf16 model's decode step then skips a torch conversion before each op."""
    return t if t.dtype in FLOAT_DTYPES and t.is_contiguous() else t.to(torch.float32).contiguous()


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """An op's output dtype when `dtype` is asked: bf16 (the op rounds its float32 result to
    nearest even at the end, bit-identical to `.to(torch.bfloat16)` after a float32 call), or
    float32 for anything else."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _out(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=_out_dtype(dtype))


def _act_rows(t: torch.Tensor) -> torch.Tensor:
    """float32 or bf16 (`_act`) and contiguous within each [B, T] entry (a column slice of a
    wider buffer passes as it is), for the ops that take row and token strides."""
    if t.dtype in FLOAT_DTYPES:
        inner = 1
        for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:])):
            if size > 1 and stride != inner:
                break
            inner *= size
        else:
            return t
    return t.to(torch.float32).contiguous()


def _np(t: torch.Tensor):
    """A numpy view of t's memory, which the extension takes through the buffer protocol:
    measured 2 us a tensor against 6-8 us for torch's own __dlpack__, which adds up in decode
    (moe_experts takes 11 tensors a call, every layer). numpy has no bf16: a bf16 tensor goes
    as its bits, uint16, which the ops that read bf16 expect (the others refuse the dtype)."""
    t = t.detach() if t.requires_grad else t
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


_EMPTY = torch.empty(0)
_EMPTY_NP = _EMPTY.numpy()
_EMPTY_I64_NP = torch.empty(0, dtype=torch.int64).numpy()
_EMPTY_U8_NP = torch.empty(0, dtype=torch.uint8).numpy()


class Packed(NamedTuple):
    """One packed quantized weight as the native ops take it: the tensors, and numpy views of
    them with the format's code (made once per module: `native_views`)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    fmt: str
    w: Any
    s: Any
    code: int


def packed(qweight: torch.Tensor, scales: torch.Tensor, fmt: str) -> Packed:
    return Packed(qweight, scales, fmt, _np(qweight), _np(scales), formats.FORMATS[fmt])


FLOAT_FORMATS = {torch.float32: ("float32", 32), torch.bfloat16: ("bfloat16", 16)}  # -> (fmt, native code)
FLOAT_LINEAR_MAX_TOKENS = 16  # rows for which float linears and experts run natively; torch's GEMMs are better above


def float_packed(weight: torch.Tensor) -> Packed:
    """A float32 or bf16 weight [out, in] as the linear ops take a packed one (no scales):
    `qlinear_multi`, `swiglu_mlp` and `attn_block_decode` read it as it is, with float32
    activations, each (row, token) product in one fixed order whatever the rows in the call."""
    fmt, code = FLOAT_FORMATS[weight.dtype]
    return Packed(weight, _EMPTY, fmt, _np(weight), _np(_EMPTY), code)


def float_decode_rows(x: torch.Tensor) -> bool:
    """Whether x's rows (all but its last dimension) are few enough for the native float ops
    (FLOAT_LINEAR_MAX_TOKENS; more: torch's GEMMs are better) and autograd is off (the native
    ops have no backward): a decode step or a verification pass."""
    return x.numel() <= FLOAT_LINEAR_MAX_TOKENS * x.shape[-1] and not torch.is_grad_enabled()


def float_native_rows(x: torch.Tensor) -> bool:
    """Whether a float linear or float experts call on x goes native: a decode-sized x
    (`float_decode_rows`), or a bf16 x of any size on a CPU where torch has no fast bf16
    GEMM (`torch_bf16_is_slow`), autograd off. There torch's bf16 product runs 5-8x slower
    than the native bf16 kernel at every size measured (this AVX2 machine, 2 threads: 128 x
    2048 -> 4096 138.7 vs 25.2 ms, 512 tokens 817 vs 98 ms; the demo's 128 -> 4096 at 128
    tokens 17.4 vs 3.5 ms), and a bf16 model's prefill was mostly that."""
    return float_decode_rows(x) or (x.dtype == torch.bfloat16 and not torch.is_grad_enabled() and torch_bf16_is_slow())


def torch_bf16_is_slow() -> bool:
    """Whether torch's CPU bf16 GEMMs lack hardware support here (no AVX-512 BF16, no AMX):
    oneDNN then widens every operand in software. False without the native extension."""
    slow = _state.get("bf16_slow")
    if slow is None:
        _native()
        nat = _state["native"]  # the extension, even while the torch references are forced
        slow = _state["bf16_slow"] = nat is not None and not nat.cpu_features().get("avx512bf16", False) \
            and "amx" not in nat.available_isas()
    return slow


def float_linear_views(lin: torch.nn.Module) -> Packed:
    """A float linear's weight as the linear ops take it (`float_packed`, kept on the module)."""
    return native_views(lin, ("weight",), float_packed)


def float32_weight(module: torch.nn.Module) -> torch.Tensor:
    """The module's `weight` in float32: itself, or a float32 copy of a bf16 one kept on the
    module (`native_views`; small weights read by the float32 native ops: norms, routers,
    a shared expert's gate)."""
    w = module._parameters["weight"]
    return w if w.dtype == torch.float32 else native_views(module, ("weight",), _detached_float)


def _detached_float(w: torch.Tensor) -> torch.Tensor:
    return w.detach().float()


def numpy_views(*tensors: torch.Tensor) -> tuple:
    """The tensors as the native ops take them (numpy views of their memory)."""
    return tuple(map(_np, tensors))


def native_views(module: torch.nn.Module, names: tuple[str, ...], make):
    """`make(*tensors)` for a module's named buffers or parameters, kept on the module until one
    of them moves to other memory (`.to()`, a new tensor, `.data` replaced): a decode step
    would otherwise rebuild the numpy views of every weight it touches, a few microseconds
    each, hundreds of times. One entry per kind of `make` (its code: a lambda written once
    is one kind), so that two uses of one module (a linear's packed view and its float32
    copy) keep theirs apart. The cache holds the tensors, so no other can take their address."""
    kind = make.__code__  # make: a Python function or lambda
    cache = module.__dict__.get("_native_views")
    cached = cache[kind] if cache is not None and kind in cache else None
    if cached is not None:
        bufs, params = module._buffers, module._parameters
        for name, ptr in zip(names, cached[0]):
            # _own_tensor inlined for plain names: decode checks a few hundred of these a token
            t = _own_tensor(module, name) if "." in name else bufs.get(name)
            if (params[name] if t is None else t).data_ptr() != ptr:
                break
        else:
            return cached[1]
    tensors = tuple(_own_tensor(module, n) for n in names)
    if cache is None:
        cache = module.__dict__["_native_views"] = {}
    cache[kind] = (tuple(t.data_ptr() for t in tensors), make(*tensors), tensors)
    return cache[kind][1]


def module_plan(owner: torch.nn.Module, modules: tuple, key, make):
    """`make()`, kept on `owner` while `key` is equal, `modules` are the same objects and each
    of their own parameters and buffers is the same tensor in the same memory (`native_views`
    for what a fused op takes from a whole group of modules: their weights' views and the
    decisions taken on them, checked in a few microseconds where asking each module again
    costs tens, every layer of every decode step). One plan per owner. The cache holds the
    modules and tensors, so that no other can take their identity or address."""
    tensors = [t for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None]
    stamp = (key, *map(id, modules), *map(id, tensors), *[t.data_ptr() for t in tensors])
    cached = owner.__dict__.get("_module_plan")
    if cached is not None and cached[0] == stamp:
        return cached[1]
    value = make()
    owner.__dict__["_module_plan"] = (stamp, value, modules, tensors)
    return value


_module_mod = torch.nn.modules.module  # where torch keeps the global forward hooks


def has_hooks(*modules: torch.nn.Module) -> bool:
    """Whether calling any of these modules would run a forward hook or pre-hook (its own, or
    a global one): a native op that stands in for their calls must not run then."""
    if _module_mod._global_forward_hooks or _module_mod._global_forward_pre_hooks:
        return True
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks:
            return True
    return False


def _own_tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A buffer or parameter by (dotted) name, without nn.Module's attribute lookup."""
    if "." in name:
        *path, name = name.split(".")
        for part in path:  # what get_submodule does, without its checks (a few us a name in decode)
            module = module._modules[part]
    t = module._buffers.get(name)
    return module._parameters[name] if t is None else t


def split_threads(net: torch.nn.Module, threads: int | None = None, max_tokens: int = 32) -> bool:
    """For a net with modules that run native kernels (`native_kernels = True`: packed ones,
    and float experts, whose decode-sized passes are native too): native
    ops on `threads` (default: torch's current count), torch's own ops on one thread in
    forward passes of at most `max_tokens` tokens (decode, short drafts), on `threads`
    otherwise (prefill, where attention is big enough to share). Returns False (and changes
    nothing) for a net without native modules, or when the native extension is not in use."""
    if _native() is None or not any(getattr(m, "native_kernels", False) for m in net.modules()):
        return False
    n = threads or torch.get_num_threads()
    set_threads(n)

    def pick_threads(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        want = 1 if ids is not None and ids.numel() <= max_tokens else n
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        set_spin(DECODE_SPIN_US if want == 1 < n else IDLE_SPIN_US)
        # the pool watches for another process on our cores only when torch's threads are not
        # beside its own (a prefill's spin after their parallel regions looks the same)
        set_watch_shared(want == 1 or n == 1)

    if getattr(net, "_split_threads", None) is not None:
        net._split_threads.remove()
    net._split_threads = net.register_forward_pre_hook(pick_threads, with_kwargs=True)
    return True


# -- quantized linear ----------------------------------------------------------------------

def qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: str, in_features: int,
            views: Packed | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] float32, W packed by `moerun.kernels.formats.quantize`
    (`views`: the same weight's `Packed`, when the caller keeps one)."""
    nat = _native()
    if nat is None:
        return qlinear_ref(x, qweight, scales, fmt, in_features)
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=torch.float32)
    if x.shape[0]:
        _sync_threads(nat)
        v = views or packed(qweight, scales, fmt)
        nat.qlinear(_np(_f32(x)), v.w, v.s, _np(out), v.code)
    return out


def qlinear_multi(x: torch.Tensor, weights: list, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """x [..., K] through several packed weights (qweight, scales, fmt), or their `Packed`, of
    the same input width in one native call -> [..., N_p] each, column slices of one
    [..., sum N_p] buffer (one weight: that buffer). Outputs in float32, or in bf16 with
    `dtype=torch.bfloat16` (a bf16 model's: rounded once at the end)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    sizes = [w[0].shape[0] for w in weights]
    nat = _native()
    if nat is None:
        out = torch.cat([qlinear_ref(x2, w[0], w[1], w[2], K) for w in weights], dim=-1).to(_out_dtype(dtype))
    else:
        out = _out((x2.shape[0], sum(sizes)), dtype)
        if x2.shape[0]:
            _sync_threads(nat)
            v = [w if isinstance(w, Packed) else packed(*w) for w in weights]
            nat.qlinear_multi(_np(_act(x2)), [p.w for p in v], [p.s for p in v], [p.code for p in v], _np(out))
    out = out.view(*lead, out.shape[-1])
    return [out] if len(sizes) == 1 else list(out.split(sizes, dim=-1))


def qlinear_ref(x, qweight, scales, fmt, in_features) -> torch.Tensor:
    return formats.matmul_ref(x, qweight, scales, fmt, in_features, quantize_x=True)


def swiglu_mlp(x: torch.Tensor, gate, up, down, gate_vec: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, H] -> down(silu(gate x) * up x) [M, H] in one native call; gate, up and
    down are packed weights [I, .], [I, .], [H, .] as (qweight, scales, fmt) or `Packed`. With
    gate_vec (float32, H values: a shared expert's gate) each row is scaled by sigmoid(x . gate_vec).
    Out in float32, or bf16 with `dtype=torch.bfloat16` (rounded once at the end)."""
    nat = _native()
    if nat is None:
        return swiglu_mlp_ref(x, gate, up, down, gate_vec).to(_out_dtype(dtype))
    out = _out((x.shape[0], down[0].shape[0]), dtype)
    if x.shape[0]:
        _sync_threads(nat)
        g, u, d = (w if isinstance(w, Packed) else packed(*w) for w in (gate, up, down))
        gv = _EMPTY if gate_vec is None else gate_vec.reshape(-1)
        nat.swiglu_mlp(_np(_act(x)), g.w, g.s, g.code, u.w, u.s, u.code, d.w, d.s, d.code, _np(out), _np(gv))
    return out


def swiglu_mlp_ref(x, gate, up, down, gate_vec=None) -> torch.Tensor:
    g = qlinear_ref(x, *gate[:3], x.shape[-1])
    u = qlinear_ref(x, *up[:3], x.shape[-1])
    y = qlinear_ref(F.silu(g) * u, *down[:3], g.shape[-1])
    return y if gate_vec is None else y * torch.sigmoid(x.float() @ gate_vec.reshape(-1, 1).float())


# -- softmax top-k routing ----------------------------------------------------------------

ROUTE_MAX_TOKENS = 16  # native routing for decode-sized passes; prefill's torch GEMM is better


def greedy_picks(rows, seen: np.ndarray, extra: list[int], penalty: float, extra_per_row: bool) -> list[int] | None:
    """Row j of rows [R, V] (a float32 or bf16 tensor, or a float32 numpy array) -> its first
    maximum with the repetition penalty on the ids of `seen` (int64 array) and of extra[:j]
    (`extra_per_row`; else all of extra), in one native call; None without the extension
    (`sampling.greedy_tokens` then runs its numpy reference)."""
    nat = _native()
    if nat is None:
        return None
    x = rows if isinstance(rows, np.ndarray) else _np(_act(rows))
    out = np.empty(x.shape[0], dtype=np.int64)
    nat.greedy_picks(x, seen, np.asarray(extra, dtype=np.int64), float(penalty), bool(extra_per_row), out)
    return out.tolist()


def sample_row(logits: torch.Tensor, seen: np.ndarray, extra: list[int], penalty: float, temperature: float,
               top_k: int, top_p: float, min_p: float, u: float, probs: torch.Tensor | None = None) -> int | None:
    """One row of logits [V] (float32 or bf16) through the repetition penalty (ids of `seen`,
    an int64 array, and of `extra`), temperature, top-k, top-p and min-p in one native call:
    the token whose cumulative probability first passes u in [0, 1) (-1 for u < 0), with the
    distribution written into `probs` [V] float32 when given. None without the extension
    (`sampling` then runs its torch reference)."""
    nat = _native()
    if nat is None:
        return None
    return nat.sample_row(_np(_act(logits)), seen, np.asarray(extra, dtype=np.int64), float(penalty), float(temperature),
                          int(top_k), float(top_p), float(min_p), float(u), _EMPTY_NP if probs is None else _np(probs))


def residual_draw(p: torch.Tensor, q: torch.Tensor, u: float) -> int | None:
    """A rejected draft's replacement from norm(max(0, p - q)) (p, q float32 [V]; p itself
    where that is all zero) with u in [0, 1) (`moerun::residual_draw`); None without the
    extension (`engine.sampling.residual_draw` then runs its numpy reference)."""
    nat = _native()
    if nat is None:
        return None
    return nat.residual_draw(_np(p), _np(q), float(u))


def route_softmax_topk(x: torch.Tensor, router: torch.Tensor, k: int,
                       renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] float32 or bf16, router [E, H] float32 -> (weights [T, k] float32, ids [T, k] long):
    the k most probable experts of softmax(x router^T), largest first, renormalised to sum 1
    when `renorm`. One native call for the seven torch ops of the reference."""
    nat = _native()
    if nat is None:
        return route_softmax_topk_ref(x, router, k, renorm)
    T = x.shape[0]
    ids = torch.empty(T, k, dtype=torch.long)
    w = torch.empty(T, k, dtype=torch.float32)
    if T:
        _sync_threads(nat)
        nat.route_softmax_topk(_np(_act(x)), _np(router), _np(ids), _np(w), bool(renorm))
    return w, ids


def route_softmax_topk_ref(x, router, k, renorm):
    probs = F.linear(x.float(), router.float()).softmax(-1)
    w, ids = probs.topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True) if renorm else w), ids


class SigmoidRouting(NamedTuple):
    """Grouped sigmoid routing's settings (DeepSeek-V3): the selection-only bias [E] float32,
    the groups (n_group, topk_group kept) and the weights' scale (routed_scaling_factor)."""
    bias: torch.Tensor
    n_group: int
    topk_group: int
    scale: float


def route_sigmoid_grouped(x: torch.Tensor, router: torch.Tensor, k: int, renorm: bool,
                          route: SigmoidRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] float32 or bf16, router [E, H] float32 -> (weights [T, k] float32, ids [T, k]
    long): DeepSeek-V3's routing (`route_sigmoid_grouped_ref`) as one native call, the experts
    largest biased score first (ties to the lower expert)."""
    nat = _native()
    if nat is None:
        return route_sigmoid_grouped_ref(x, router, k, renorm, route)
    T = x.shape[0]
    ids = torch.empty(T, k, dtype=torch.long)
    w = torch.empty(T, k, dtype=torch.float32)
    if T:
        _sync_threads(nat)
        nat.route_sigmoid_grouped(_np(_act(x)), _np(router), _np(_f32(route.bias)), int(route.n_group),
                                  int(route.topk_group), float(route.scale), _np(ids), _np(w), bool(renorm))
    return w, ids


def route_sigmoid_grouped_ref(x, router, k, renorm, route):
    """Torch reference: scores = sigmoid(x router^T) in float32; experts are picked by scores +
    bias: with n_group > 1 each group of E / n_group experts scores the sum of its two largest
    biased scores and only the topk_group best groups keep theirs; then the k best (largest
    first). Weights: the picked experts' unbiased scores, / (their sum + 1e-20) when renorm,
    times scale."""
    scores = F.linear(x.float(), router.float()).sigmoid()  # [T, E]
    choice = scores + route.bias.float()
    if route.n_group > 1:
        grouped = choice.view(choice.shape[0], route.n_group, -1)  # [T, groups, E / groups]
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [T, groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(route.topk_group, dim=-1)[1], True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(k, dim=-1)[1]  # [T, k]
    weights = scores.gather(1, ids)
    if renorm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * route.scale, ids


# -- fused routed experts ------------------------------------------------------------------

def moe_experts(x, ids, weights, gate, gate_scales, up, up_scales, down, down_scales, fmt: str,
                intermediate: int, views: tuple | None = None, dtype: torch.dtype = torch.float32,
                down_fmt: str | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, k] -> [T, H] float32
    (or bf16 with `dtype=torch.bfloat16`, rounded once at the end).

    x [T, H]; ids [T, K] long; weights [T, K]; gate/up [E, I, bytes] with scales [E, I, nb];
    down [E, H, bytes] with scales [E, H, nb]; or each of the six a list of one tensor per
    expert (an expert store's, wherever each lies: nothing is copied). One call per layer: the
    native kernel groups the tokens per expert, runs gate/up, SiLU*up, down and the weighted
    sum itself. `views`: `expert_views` of the six, when the caller keeps them. `down_fmt`:
    down's format where it is not gate/up's `fmt` (raw formats: scales [E, rows, 0]).
    """
    nat = _native()
    if nat is None:
        stacks = (w if torch.is_tensor(w) else torch.stack(w) for w in (gate, gate_scales, up, up_scales, down, down_scales))
        return moe_experts_ref(x, ids, weights, *stacks, fmt, intermediate, down_fmt).to(_out_dtype(dtype))
    out = _out(x.shape, dtype)
    if x.shape[0]:
        _sync_threads(nat)
        w = views or expert_views(gate, gate_scales, up, up_scales, down, down_scales)
        code = formats.expert_code(fmt, down_fmt)
        for xa, ia, wa, oa in _expert_calls(x, ids, weights, out):
            nat.moe_experts(xa, ia, wa, *w, oa, code, intermediate)
    return out


EXPERT_TOKENS_PER_CALL = 2048  # tokens per native experts call (`_expert_calls`)


def _expert_calls(x, ids, weights, out):
    """The experts ops' activations, ids, routing weights and output as numpy views, in
    calls of at most EXPERT_TOKENS_PER_CALL tokens: a call's workspace is its (token,
    expert) pairs times (2 x expert width + hidden) floats, kept between calls (Qwen3-30B-A3B
    shapes: ~120 MB per 1024 tokens, so a 32k-token prompt in one call would keep ~3.9 GB).
    A token's result does not depend on the tokens it shares a call with, so the split
    changes no bits. Each call reads the experts' weights again, which the products of 2048
    tokens outweigh: a 4096-token prompt through two Qwen3-30B-shaped int4 layers took 9.7
    s in two calls a layer against 10.0 in one, and the process grew by 0.33 against 0.48 GB."""
    xa, ia, wa = _act(x), ids.to(torch.int64).contiguous(), _f32(weights)
    n = EXPERT_TOKENS_PER_CALL
    if x.shape[0] <= n:
        return [(_np(xa), _np(ia), _np(wa), _np(out))]
    return [(_np(xa[i : i + n]), _np(ia[i : i + n]), _np(wa[i : i + n]), _np(out[i : i + n]))
            for i in range(0, x.shape[0], n)]


def moe_experts_ref(x, ids, weights, gate, gate_scales, up, up_scales, down, down_scales, fmt, intermediate,
                    down_fmt=None):
    """Torch reference with the kernel's arithmetic (int8 activations for every product)."""
    T, H = x.shape
    K = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
    token_of = order // K
    w_sorted = weights.reshape(-1)[order].float()
    out = torch.zeros(T, H, dtype=torch.float32)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = token_of[start : start + c]
        xs = x[rows].float()
        g = formats.matmul_ref(xs, gate[e], gate_scales[e], fmt, H)
        u = formats.matmul_ref(xs, up[e], up_scales[e], fmt, H)
        y = formats.matmul_ref(F.silu(g) * u, down[e], down_scales[e], down_fmt or fmt, intermediate)
        out.index_add_(0, rows, y * w_sorted[start : start + c, None])
        start += c
    return out


def moe_experts_float(x, ids, weights, gate, up, down, views: tuple | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`moe_experts` for unquantized experts, all float32 or all bf16 (read as they are;
    activations and sums in float32) -> [T, H] float32 (or bf16 with `dtype`, rounded at the end). gate, up, down: stacks [E, I, H],
    [E, I, H], [E, H, I], or lists of one [I, H], [I, H], [H, I] tensor per expert (an
    expert store's, wherever each lies: nothing is copied). Each (token, expert) pair's
    products run in one fixed order, so a token's output depends neither on the other tokens
    of the call (a verification pass equals its decode steps) nor on how the experts are
    given. `views`: `expert_views` of the weights, when the caller keeps them."""
    nat = _native()
    if nat is None:
        return moe_experts_float_ref(x, ids, weights, gate, up, down).to(_out_dtype(dtype))
    out = _out(x.shape, dtype)
    if x.shape[0]:
        _sync_threads(nat)
        g, u, d = views or expert_views(gate, up, down)
        for xa, ia, wa, oa in _expert_calls(x, ids, weights, out):
            nat.moe_experts_float(xa, ia, wa, g, u, d, oa)
    return out


class ExpertViews(NamedTuple):
    """Routed experts as `moe_block` takes them: the native format code (32 / 16: float32 /
    bf16 rows, 8 / 4 / raw codes: packed, with down's code in the second byte where it differs:
    `formats.expert_code`) and per weight a list of one stack or of one array per expert,
    with the scales' lists alike (empty for float experts); or, with every list empty, a
    `source` that gives each pass the experts its routing picked, wherever they lie
    (`fetch(ids, T)` -> (needed ids, gate, gate_scales, up, up_scales, down, down_scales: one
    array per needed expert each), then `release(ok)`; `inter`: the experts' width)."""
    code: int
    gate: list
    gate_scales: list
    up: list
    up_scales: list
    down: list
    down_scales: list
    source: object = None


def moe_block_args(norm_weight: torch.Tensor, eps: float, norm_offset: float, router: torch.Tensor, k: int,
                   renorm: bool, experts: ExpertViews, shared: tuple | None = None,
                   shared_gate: torch.Tensor | None = None, route: SigmoidRouting | None = None) -> tuple:
    """The MoE half of a decoder layer for a decode-sized x [T, H] as one native call
    (`moe_block_run`): x + experts(h) (+ sigmoid(h . shared_gate) * shared(h) with a shared
    expert), h = RMSNorm(x) with norm_weight + norm_offset (float32 [H]), softmax top-k
    routing over router [E, H] (float32) renormalised over the k when `renorm`. `experts`:
    `ExpertViews`; `shared`: the shared expert's (gate, up, down) `Packed`; shared_gate [H]
    float32; `route`: grouped sigmoid routing (`route_sigmoid_grouped`) in place of softmax
    top-k. -> those weights and settings as the binding takes them (everything between x
    and out), made once where a plan keeps them (`layers.moe`): a decode step then converts
    only its activations."""
    sh = ([p.w for p in shared], [p.s for p in shared], [p.code for p in shared]) if shared else ([], [], [])
    groups = (_EMPTY_NP, 1, 1, 1.0) if route is None else \
        (_np(_f32(route.bias)), int(route.n_group), int(route.topk_group), float(route.scale))
    return (_np(norm_weight), float(eps), float(norm_offset), _np(router), int(k), bool(renorm), *groups, *experts, *sh,
            _EMPTY_NP if shared_gate is None else _np(shared_gate))


def moe_block_run(x: torch.Tensor, args: tuple, observe: bool = False, seen=None, observer=None):
    """x [T, H] through the MoE half whose weights and settings `moe_block_args` made. Out in
    x's dtype (float32 or bf16); a bf16 x has every intermediate rounded where the separate
    ops (`rms_norm`, `route_softmax_topk`, `moe_experts*`, `swiglu_mlp` and two adds, each in
    bf16) round it: bit-identical to them. With `observe`: (out, h, ids, weights) as the
    separate ops hand them on (h and weights in x's dtype), for the experts' hooks. `seen`: a
    route mask to mark (`layers.routes`), or None. `observer`: called natively once the
    router has picked, with numpy (h [T, H] float32, ids [T, k], weights [T, k] float32)
    (`layers.routes.native_observer`), or None."""
    nat = _native()
    T, H = x.shape
    x = x.contiguous()  # (a row slice of a wider batch is not), in its dtype: out has it too
    out = _out(x.shape, x.dtype)
    observed, obs = _moe_observed(T, H, args[4], x.dtype) if observe else (None, _NOT_OBSERVED)
    _sync_threads(nat)
    nat.moe_block(_np(_act(x)), *args, _np(out), *obs, _EMPTY_U8_NP if seen is None else seen, observer)
    return (out, *observed) if observe else out


def mlp_block_args(norm_weight: torch.Tensor, eps: float, norm_offset: float, mlp: tuple) -> tuple:
    """A decoder layer's dense MLP half for a decode-sized x [T, H] as one native call
    (`mlp_block_run`): x + down(silu(gate h) * up h), h = RMSNorm(x) with norm_weight +
    norm_offset (float32 [H]); `mlp`: the (gate, up, down) `Packed`. -> those weights and
    settings as the binding (and `NativeStack.add_mlp`) takes them, made once."""
    g, u, d = mlp
    return (_np(norm_weight), float(eps), float(norm_offset), g.w, g.s, g.code, u.w, u.s, u.code, d.w, d.s, d.code)


def mlp_block_run(x: torch.Tensor, args: tuple) -> torch.Tensor:
    """x [T, H] through the dense MLP half `mlp_block_args` made, out in x's dtype (float32 or
    bf16; a bf16 x has h, the MLP's output and the sum rounded where `rms_norm`, `swiglu_mlp`
    and the add round them: bit-identical to them)."""
    nat = _native()
    x = x.contiguous()
    out = _out(x.shape, x.dtype)
    _sync_threads(nat)
    nat.mlp_block(_np(_act(x)), *args, _np(out))
    return out


def mlp_block_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate, up, down) -> torch.Tensor:
    """Torch reference of the dense MLP half in float32 (gate, up, down float weights [out, in])."""
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return xf + F.linear(F.silu(F.linear(h, gate.float())) * F.linear(h, up.float()), down.float())


_NOT_OBSERVED = (_EMPTY_NP, _EMPTY_I64_NP, _EMPTY_NP)


def _moe_observed(T: int, H: int, k: int, dtype: torch.dtype) -> tuple:
    """New (h [T, H], ids [T, k], weights [T, k]) for `moe_block` to fill (what the experts'
    hooks are called with; they may keep them), and their numpy views."""
    h, ids, w = torch.empty(T, H, dtype=dtype), torch.empty(T, k, dtype=torch.int64), torch.empty(T, k, dtype=dtype)
    return (h, ids, w), (_np(h), _np(ids), _np(w))


class MtpStep:
    """A one-layer MTP head (`layers.mtp.native_step`) over T tokens of one row (a draft step,
    or a catch-up over the tokens accepted since the last) in one native call
    (`NativeMtp.run`): the two input RMSNorms, fc, the layer's attention half over the T
    tokens (all T write their keys and values; only the last goes on to the attention and
    o_proj), its MoE half on the last token, the final norm and the head, each as its own
    decode op computes it (in a bf16 model rounded to bf16 where those hand on a bf16 tensor):
    bit-identical to the modules one by one. The weights' arguments are made once (a draft
    step's module calls, wrappers and conversions otherwise cost several times its
    arithmetic)."""

    def __init__(self, H: int, dtype: torch.dtype, embed: torch.Tensor, pre_w: torch.Tensor, pre_eps: float,
                 fc: Packed, final: tuple, head: Packed):
        self.H, self.dtype, self.V = H, _out_dtype(dtype), head.qweight.shape[0]
        self.embed = _np(embed)
        self.pre = (_np(pre_w), float(pre_eps), fc.w, fc.s, fc.code)
        final_w, eps, offset = final
        self.post = (_np(final_w), float(eps), float(offset), head.w, head.s, head.code)


    def bind(self, attn: tuple, attn_norm: tuple, kv_slot: tuple, moe: tuple, rope: tuple, seen=None) -> tuple:
        """What `run` passes on besides its tokens, hidden states, rope rows and position, for
        calls on one cache slot: attn: `attn_plan`; attn_norm: `half_norm_args`; kv_slot:
        `_cache_slot`; moe: `moe_block_args`; rope: one token's rope rows (for the checks);
        seen: the experts' route mask or None. Made once for a run of calls
        (`layers.mtp.Drafter`): the weights' arguments checked and held natively
        (`NativeMtp`), where converting them at each call took ~30 of its ~100 us on the demo
        model."""
        weights, heads_scale, gated, variants = attn
        if variants:
            raise ValueError(f"an MTP head's attention takes no {', '.join(variants)} (NativeMtp)")
        native = _native().NativeMtp(self.embed, *self.pre, *weights, *rope, *kv_slot, *heads_scale, gated, *attn_norm,
                                     *moe, *self.post)
        return native, _EMPTY_U8_NP if seen is None else seen, moe[4]

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor, rope: tuple, pos: int, bound: tuple,
            observe: bool = False) -> tuple:
        """tokens [T] (int64), hidden [T, H] (the model's dtype) -> (logits [1, V], h [1, H] of
        the last token, and with `observe` the MoE half's (h, ids, weights) for the experts'
        hooks, else None). rope: `layers.rope.Rope.float_rows`; bound: `bind`'s."""
        _sync_threads(_native())
        native, seen, k = bound
        observed, obs = _moe_observed(1, self.H, k, self.dtype) if observe else (None, _NOT_OBSERVED)
        h, logits = torch.empty(1, self.H, dtype=self.dtype), torch.empty(1, self.V, dtype=self.dtype)
        native.run(_np(tokens), _np(hidden), *rope, pos, *obs, seen, _np(h), _np(logits))
        return logits, h, observed



def expert_views(*weights) -> tuple:
    """Experts' weights (stacks, or lists of one tensor per expert) as `moe_experts` and
    `moe_experts_float` take them: a list of numpy views each."""
    return tuple([_np(w)] if torch.is_tensor(w) else [_np(t) for t in w] for w in weights)


def moe_experts_float_ref(x, ids, weights, gate, up, down) -> torch.Tensor:
    gate, up, down = (w.float() if torch.is_tensor(w) else torch.stack(w).float() for w in (gate, up, down))
    return reference.expert_mlp(x.float(), ids, weights.float(), gate, up, down)


# -- decode attention ----------------------------------------------------------------------

def attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token over S cached positions: q [Hq, D], k [Hkv, S, D], v [Hkv, S, Dv] ->
    [Hq, Dv] float32; query head h reads kv head h // (Hq // Hkv). k and v may be views of a
    longer cache (only their last dimension must be contiguous): nothing is copied. int8 k
    and v (an int8 KV cache) come with their scales k_scale, v_scale [Hkv, S, 1]: x = q * scale,
    applied on the fly instead of dequantizing the cache.

    Native for float32, bf16 or int8 keys and values, on the pinned pool (decode under
    split_threads runs torch on one thread; attention over a long cache is a memory-bound
    read of every key and value, which wants every core). Other dtypes run the reference."""
    nat = _native()
    if not attn_decode_is_native(k, v):
        return attn_decode_ref(q, k, v, scale, k_scale, v_scale)
    out = torch.empty(q.shape[0], v.shape[-1], dtype=torch.float32)
    _sync_threads(nat)
    scales = (_np(k_scale), _np(v_scale)) if k.dtype == torch.int8 else ()
    nat.attn_decode(_np(_f32(q)), _np(k), _np(v), _np(out), float(scale), *scales)
    return out


def attn_decode_is_native(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether attn_decode runs natively for these keys and values."""
    return (_native() is not None and k.dtype == v.dtype and k.dtype in (torch.float32, torch.bfloat16, torch.int8)
            and k.stride(-1) == 1 and v.stride(-1) == 1)


def attn_decode_ref(q, k, v, scale, k_scale=None, v_scale=None) -> torch.Tensor:
    """Each kv head's query group as one [G, D] x [D, S] product in fp32 (int8 keys and
    values dequantized first)."""
    if k_scale is not None:
        k, v = k.float() * k_scale, v.float() * v_scale
    Hq, D = q.shape
    Hkv = k.shape[0]
    qg = q.reshape(Hkv, Hq // Hkv, D).float()
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)  # [Hkv, G, S]
    return torch.matmul(scores.softmax(-1), v.float()).reshape(Hq, v.shape[-1])


# -- RMSNorm of a few rows ------------------------------------------------------------------

RMS_NORM_MAX = 1 << 16  # elements: above this (prefill) torch's multi-threaded op runs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x / rms(x) * (weight + offset) over the last dim, computed in float32 (offset 1: the
    zero-centred form), out in float32 or, with `dtype=torch.bfloat16`, rounded once to bf16.
    weight [D], or [G, D]: the rows of x taken as [..., G, D], group g normed with
    weight[g] (several norms over the column blocks of one buffer). Native for float32 or bf16
    inputs of at most RMS_NORM_MAX elements and a float32 weight: one call instead of the 3-5
    torch ops (25-40 us for a decode row) a norm costs; otherwise `rms_norm_ref`."""
    nat = _native()
    if (nat is None or x.dtype not in FLOAT_DTYPES or weight.dtype != torch.float32 or x.numel() > RMS_NORM_MAX
            or torch.is_grad_enabled()):
        return rms_norm_ref(x, weight, eps, offset).to(_out_dtype(dtype))
    x2 = _act(x).view(-1, x.shape[-1])
    out = _out(x.shape, dtype)
    nat.rms_norm(_np(x2), _np(weight), _np(out.view(x2.shape)), float(eps), float(offset))
    return out


def rms_norm_ref(x, weight, eps, offset=0.0) -> torch.Tensor:
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    w = weight.float() + offset if offset else weight.float()
    return y * w if weight.dim() == 1 else (y.view(-1, *w.shape) * w).view(y.shape)


def norm_rope_heads(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                    cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] float32 -> [H, T, D]: each head's RMSNorm (times weight + offset; None: no
    norm) then rotate-half rope on the first cos.shape[-1] dims, cos and sin [T, rd]. One
    native pass over the pool where torch takes ~10 (a 512-token prefill's q and k of a
    Qwen3-30B-A3B layer: ~24 ms in torch)."""
    nat = _native()
    if nat is None:
        return norm_rope_heads_ref(x, weight, eps, offset, cos, sin)
    T, H, D = x.shape
    out = torch.empty(H, T, D)
    _sync_threads(nat)
    nat.norm_rope_heads(_np(_f32(x)), _np(_EMPTY if weight is None else _f32(weight)), _np(_f32(cos)),
                        _np(_f32(sin)), _np(out), float(eps), float(offset))
    return out


def norm_rope_heads_ref(x, weight, eps, offset, cos, sin) -> torch.Tensor:
    y = x.float() if weight is None else rms_norm_ref(x, weight, eps, offset)
    return reference.apply_rope(y.transpose(0, 1)[None], cos.float(), sin.float())[0].contiguous()


# -- Gated DeltaNet, a few tokens ---------------------------------------------------------

def deltanet_decode(qkv, conv_w, conv, a, b, A_log, dt_bias, S, z, norm_w, eps: float, key_heads: int,
                    every: bool = False, every_out: tuple | None = None, views: tuple | None = None,
                    dtype: torch.dtype = torch.float32):
    """A few tokens per row through a Gated DeltaNet layer between its projections, token
    after token: conv + SiLU, q/k L2 norms, the gated delta rule, RMSNorm(o) * norm_w * silu(z).

    qkv [B, T, C] (in_proj_qkv, before the conv), conv_w [C, 1, K], conv [B, C, K-1], a and b
    [B, T, Hv] (in_proj_a, in_proj_b), A_log and dt_bias [Hv], S [B, Hv, Dk, Dv], z [B, T, Hv,
    Dv], norm_w [Dv]. qkv, a, b and z may be column slices of one projection buffer (strided
    over B and T, contiguous within a token): the native path reads them in place.

    `conv` and `S` end as the states after the last token, updated in place. Returns (o [B, T,
    Hv, Dv], conv, S), or with `every` (o, the states after each token [B, T, C, K-1] and [B,
    T, Hv, Dk, Dv]); `every_out` may give two float32 buffers of those shapes to write them
    into (the native path uses them). `views`: the layer's weights as `deltanet_weight_views`
    makes them, when the caller keeps them.

    Native when both states are contiguous float32 (`deltanet_decode_is_native`): the inputs
    may be bf16 (a bf16 model), widened exactly, and everything between the projections then
    runs in float32, where the bf16 reference rounds after each op; o is float32, or bf16
    (rounded once) with `dtype=torch.bfloat16`. Otherwise
    `reference.few_tokens_ref` (o in qkv's dtype)."""
    if not deltanet_decode_is_native(qkv, conv, S):
        o, conv_now, S_now = reference.few_tokens_ref(qkv, conv_w, conv, a, b, A_log, dt_bias, S, z, norm_w, eps, key_heads,
                                            every)
        last = (conv_now[:, -1], S_now[:, -1]) if every else (conv_now, S_now)
        for state, value in zip((conv, S), last):
            if value is not state:
                state.copy_(value)
        return o, conv_now if every else conv, S_now if every else S
    nat = _native()
    B, T = qkv.shape[:2]
    out = _out((B, T, S.shape[1], S.shape[3]), dtype)
    conv_every, S_every = _every_states(B, T, conv, S, every, every_out)
    _sync_threads(nat)
    cw, al, dt, nw = views or deltanet_weight_views(conv_w, A_log, dt_bias, norm_w)
    nat.deltanet_decode(_np(_act_rows(qkv)), cw, _np(conv), None if conv_every is None else _np(conv_every),
                        _np(_act_rows(a)), _np(_act_rows(b)), al, dt, _np(S), None if S_every is None else _np(S_every),
                        _np(_act_rows(z)), nw, float(eps), _np(out), key_heads)
    return (out, conv_every, S_every) if every else (out, conv, S)


def delta_rule_chunked(q, k, v, g, beta, state=None):
    """The chunked gated delta rule as one native call (csrc/delta_chunk.cpp): the arguments
    and results of `layers.deltanet.chunk_gated_delta_rule`, its torch reference (q, k [B, T,
    Hk, Dk] as the conv gives them, L2-normalised inside; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
    state [B, Hv, Dk, Dv] or None). float32 or bf16 inputs (widened exactly), float32 sums.
    Returns (o [B, T, Hv, Dv] in q's dtype, the final state, a new float32 tensor)."""
    nat = _native()
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    f32 = [t.detach().float().contiguous() for t in (q, k, v, g, beta)]
    S = torch.zeros(B, Hv, Dk, Dv) if state is None else state.detach().float().clone(memory_format=torch.contiguous_format)
    out = torch.empty(B, T, Hv, Dv)
    _sync_threads(nat)
    nat.delta_rule_chunked(*(_np(t) for t in f32), _np(S), _np(out))
    return out.to(q.dtype), S


def _every_states(B: int, T: int, conv, S, every: bool, every_out: tuple | None) -> tuple:
    """The buffers for each token's states ([B, T, C, K-1] and [B, T, Hv, Dk, Dv]) of a pass
    that keeps them: `every_out`, or new ones; (None, None) for a pass that does not."""
    if not every:
        return None, None
    return every_out or (torch.empty(B, T, *conv.shape[1:]), torch.empty(B, T, *S.shape[1:]))


def deltanet_weight_views(conv_w, A_log, dt_bias, norm_w) -> tuple:
    """Numpy views of a Gated DeltaNet layer's float32 copies of conv_w (transposed to [K, C],
    as the native conv reads it), A_log, dt_bias, norm_w, as `deltanet_decode` passes them
    (keep them with `native_views`: the transpose is then made once per layer)."""
    conv_t = conv_w.detach().reshape(conv_w.shape[0], -1).t().float().contiguous()
    return (_np(conv_t), *(_np(_f32(t)) for t in (A_log, dt_bias, norm_w)))


def deltanet_decode_is_native(qkv, conv, S) -> bool:
    """Whether deltanet_decode runs natively: float32 or bf16 inputs with contiguous float32 states."""
    return (_native() is not None and qkv.dtype in FLOAT_DTYPES and conv.dtype == S.dtype == torch.float32
            and conv.is_contiguous() and S.is_contiguous())


def deltanet_block(x: torch.Tensor, norm: tuple, proj: tuple, out_proj: Packed, conv, S, views: tuple, eps: float,
                   key_heads: int, every: bool = False, every_out: tuple | None = None):
    """The linear-attention half of a Qwen3.5 decoder layer for a few tokens per row in one
    native call: x + out_proj(DeltaNet(in_proj_qkv, in_proj_z, in_proj_a, in_proj_b of
    RMSNorm(x))), x [B, T, H] float32 or bf16. norm: the RMSNorm as `norm_args` gives it;
    proj: the four projections' `Packed`; out_proj's. The DeltaNet's states, `every` and
    `every_out` as `deltanet_decode` takes them (float32 and contiguous:
    `deltanet_decode_is_native`), its weights as `deltanet_weight_views` gives them (`views`).
    Out in x's dtype; a bf16 x has every intermediate rounded where the separate ops
    (`rms_norm`, `qlinear_multi`, `deltanet_decode`, out_proj and the residual add, each in
    bf16) round it: bit-identical to them. Returns (out, conv, S) or, with `every`, (out, the
    states after each token)."""
    nat = _native()
    x = x.contiguous()
    B, T, _ = x.shape
    out = _out(x.shape, x.dtype)
    conv_every, S_every = _every_states(B, T, conv, S, every, every_out)
    cw, al, dt, nw = views
    norm_weight, norm_eps, norm_offset = norm
    _sync_threads(nat)
    nat.deltanet_block(_np(_act(x)), _np(norm_weight), norm_offset, norm_eps, [p.w for p in proj],
                       [p.s for p in proj], [p.code for p in proj], out_proj.w, out_proj.s, out_proj.code, cw,
                       _np(conv), None if conv_every is None else _np(conv_every), al, dt, _np(S),
                       None if S_every is None else _np(S_every), nw, float(eps), _np(out), key_heads)
    return (out, conv_every, S_every) if every else (out, conv, S)


# -- fused decode attention ----------------------------------------------------------------

FUSED_MAX_ROWS = 64  # a batch's tokens through `attn_block_rows` (the server's widest batches' decode steps)


def fused_call_plan(attn, norm=None) -> tuple:
    """What a fused attention's call takes from its modules (`_fused_forward`'s `plan`): its
    `attn_plan`, and its input norm's `half_norm_args` when the call is a layer half (else ())."""
    return attn_plan(attn), () if norm is None else half_norm_args(norm)


def attn_plan(attn) -> tuple:
    """A fused attention's weights and settings as `attn_block_run` takes them (kept on it:
    `module_plan`): (weights, (heads, scale), gated, variants), the variants a dict of the
    native block's keyword arguments (`qkv_bias`, `window`), empty where it has none."""
    m = attn._modules
    group = tuple(m[n] for n in _FUSED_MODULES if n in m)  # the projections, then the norms if any
    # settings: plain attributes
    key = (attn.n_heads, attn.scale, _fused_eps(attn), bool(attn.output_gate), getattr(attn, "window", None))
    return module_plan(attn, group, key, lambda: _fused_args(attn))


def norm_args(norm) -> tuple:
    """An RMSNorm as the native ops take it: (float32 weight, eps, offset: 1 zero-centred)."""
    return float32_weight(norm), float(norm.eps), 1.0 if norm.zero_centered else 0.0


def half_norm_args(norm) -> tuple:
    """A layer half's input RMSNorm as the attention half takes it: (weight, offset, eps)."""
    w, eps, offset = norm_args(norm)
    return _np(w), offset, eps


def attn_block_run(x: torch.Tensor, plan: tuple, rope: tuple, kv_slot: tuple, pos: int,
                   half: tuple = ()) -> torch.Tensor:
    """x [T, H] (float32 or bf16) through a fused attention (`attn_plan`) at positions pos..
    (its rope rows `_rope_rows`, its cache slot `_cache_slot`); with `half` (`half_norm_args`)
    x + attention(norm(x)). -> [T, H] in x's dtype."""
    weights, heads_scale, gated, variants = plan
    out = _out(x.shape, x.dtype)
    nat = _native()
    _sync_threads(nat)
    nat.attn_block_decode(_np(_act(x.contiguous())), *weights, *rope, *kv_slot, pos, *heads_scale, _np(out), gated,
                          *half, **variants)
    return out


def attn_block_rows_run(x: torch.Tensor, plan: tuple, rope: tuple, kv, slots: torch.Tensor, pos0: torch.Tensor,
                        half: tuple = ()) -> torch.Tensor:
    """`attn_block_run` for a batch's decode step: x [B, H], row b at cache slot slots[b] and
    position pos0[b] -> [B, H] in x's dtype, each row's bits those of its one-row call."""
    weights, heads_scale, gated, variants = plan
    out = _out(x.shape, x.dtype)
    nat = _native()
    _sync_threads(nat)
    nat.attn_block_rows(_np(_act(x.contiguous())), *weights, *rope, _np(kv.k), _np(kv.v),
                        _np(slots.to(torch.int64).contiguous()), _np(pos0.to(torch.int64).contiguous()), *heads_scale,
                        _np(out), gated, *half, **variants)
    return out


_FUSED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def _fused_args(attn) -> tuple:
    """The fused attention's weights as the binding takes them (q, k, v, o `Packed`, then the q
    and k norms' effective weights, `_norm_weight`: empty for none, and their eps), then its
    heads and scale, then whether it is gated, then its variants as keyword arguments:
    `qkv_bias` (q/k/v's biases, float32, one vector; zeros for a projection without one)
    where any has a bias, `window` where it has a sliding window."""
    projs = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    q, k, v, o = (float_linear_views(m) if type(m) is torch.nn.Linear else m.views() for m in projs)
    qn, kn = (_norm_weight(getattr(attn, name, None)) for name in ("q_norm", "k_norm"))
    variants = {}
    if any(p.bias is not None for p in projs[:3]):
        variants["qkv_bias"] = _np(torch.cat([torch.zeros(p.out_features) if p.bias is None else p.bias.detach().float()
                                              for p in projs[:3]]))
    if getattr(attn, "window", None):
        variants["window"] = int(attn.window)
    return ((q.w, q.s, q.code, k.w, k.s, k.code, v.w, v.s, v.code, o.w, o.s, o.code, qn, kn, _fused_eps(attn)),
            (attn.n_heads, float(attn.scale)), bool(attn.output_gate), variants)


def _fused_eps(attn) -> float:
    """The q/k norms' eps as the fused attention takes it (1e-6 where it has none)."""
    return float(getattr(getattr(attn, "q_norm", None), "eps", 1e-6))


def _norm_weight(norm):
    """A per-head RMSNorm's effective float32 weight (1 + w when zero-centred) as the fused
    attention takes it (kept on the norm: `native_views`), an empty one for none."""
    if norm is None:
        return _EMPTY_NP
    offset = 1.0 if getattr(norm, "zero_centered", False) else 0.0
    return native_views(norm, ("weight",), lambda w: _np(w.detach().float() + offset))


_rope_np: dict = {}


class MlaPlan(NamedTuple):
    """The native MLA half's arguments (`mla_block`, `NativeStack.add_mla`): `weights` (q_a or
    q_proj, q_b, kv_a, o as the linear ops take them, their biases, the q and kv norms with their
    eps, W_kb transposed per head and kv_b_proj) and `settings` (heads, softmax scale,
    interleaved rope)."""

    weights: tuple
    settings: tuple
    mla = True  # (`layers.stack._attention` tells it from a fused attention's plan by this)


_MLA_MODULES = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                "kv_b_proj", "o_proj")


def mla_plan(attn) -> MlaPlan:
    """DeepSeek-V3's attention (MLA) as `mla_block` takes it (kept on it: `module_plan`), as
    `attn_plan` does for the other attentions. It reads the module's parts by name: q_proj, or
    q_a_proj, q_a_layernorm and q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    (float nn.Linear or quantized linears with `views()`, RMSNorms with `weight` and `eps`), and
    its settings n_heads, dn, dv, rank, scale, interleaved. The caller has checked that every part
    is one the block reads as it is (`models.deepseek_v3.mla_fuses`)."""
    m = attn._modules
    group = tuple(m[n] for n in _MLA_MODULES if n in m)
    eps = tuple(float(m[n].eps) for n in ("q_a_layernorm", "kv_a_layernorm") if n in m)
    key = (attn.n_heads, attn.dn, attn.dv, attn.rank, float(attn.scale), bool(attn.interleaved), eps)
    return module_plan(attn, group, key, lambda: _mla_args(attn))


def _linear_views(lin: torch.nn.Module) -> tuple:
    """A projection as the native blocks take it: (w, s, code) of its float or packed weight."""
    v = float_linear_views(lin) if type(lin) is torch.nn.Linear else lin.views()
    return v.w, v.s, v.code


def _float32_bias(lin: torch.nn.Module):
    return _EMPTY_NP if lin.bias is None else _np(lin.bias.detach().float().contiguous())


def _mla_args(attn) -> MlaPlan:
    m = attn._modules
    direct = "q_proj" in m
    q = m["q_proj"] if direct else m["q_a_proj"]
    kv, o, kvb = m["kv_a_proj_with_mqa"], m["o_proj"], m["kv_b_proj"]
    qb = (_EMPTY_NP, _EMPTY_NP, FLOAT_FORMATS[torch.float32][1]) if direct else _linear_views(m["q_b_proj"])
    qn, q_eps = (_EMPTY_NP, 1e-6) if direct else (_np(float32_weight(m["q_a_layernorm"])), m["q_a_layernorm"].eps)
    kvn = m["kv_a_layernorm"]
    w = kvb.weight.detach().contiguous()  # [N * (Dn + Dv), R]
    wkb = w.view(attn.n_heads, attn.dn + attn.dv, attn.rank)[:, : attn.dn].transpose(1, 2).contiguous()  # [N, R, Dn]
    weights = (*_linear_views(q), *qb, *_linear_views(kv), *_linear_views(o), _float32_bias(q), _float32_bias(kv),
               _float32_bias(o), qn, float(q_eps), _np(float32_weight(kvn)), float(kvn.eps), _np(wkb), _np(w))
    return MlaPlan(weights, (attn.n_heads, float(attn.scale), bool(attn.interleaved)))


def mla_block(x: torch.Tensor, weights: tuple, settings: tuple, cos_sin: tuple, joined: torch.Tensor,
              slots: torch.Tensor, pos0: torch.Tensor, half: tuple) -> torch.Tensor:
    """x + MLA(norm(x)) [B, T, H] as one native call (`mla_block_decode`: DeepSeek-V3's
    attention half, its projections, norms, interleaved rope, the joined cache rows' writes at
    each row's slot and positions, the attention with W_kb and W_vb absorbed, o_proj and the
    residual). weights: the packed views (`MlaPlan.weights`, `mla_plan`); settings:
    (heads, scale, interleaved); half: the input norm's `half_norm_args`."""
    B, T, H = x.shape
    out = _out((B * T, H), x.dtype)
    nat = _native()
    _sync_threads(nat)
    nat.mla_block(_np(_act(x.contiguous()).view(B * T, H)), *weights, *_rope_rows(cos_sin, B * T), _np(joined),
                  _np(slots.to(torch.int64).contiguous()), _np(pos0.to(torch.int64).contiguous()), *settings,
                  _np(out), *half)
    return out.view(B, T, H)


def _rope_rows(cos_sin: tuple, T: int) -> tuple:
    """A pass's rope tables (cos, sin) as float32 [T, rd] numpy views, made once per pass:
    every layer of a forward gets the same tuple (kept here with the tuple, which `Rope`
    makes anew for each pass, until the next one; one entry, replaced whole)."""
    got = _rope_np.get("last")
    if got is None or got[0] is not cos_sin:
        got = _rope_np["last"] = (cos_sin, tuple(_np(t.reshape(T, -1).float().contiguous()) for t in cos_sin))
    return got[1]


def _cache_slot(kv, s: int) -> tuple:
    """Numpy views of one slot of a KV cache's keys and values, kept on the cache while its
    tensors stay where they are."""
    views = kv.__dict__.setdefault("_slot_views", {})
    got = views.get(s)
    if got is None or got[0] != (kv.k.data_ptr(), kv.v.data_ptr()):
        got = views[s] = ((kv.k.data_ptr(), kv.v.data_ptr()), _np(kv.k[s]), _np(kv.v[s]))
    return got[1], got[2]


FUSED_MAX_TOKENS = 5  # a decode step, or a speculative verification pass of up to 4 drafts


__all__ = [
    "available_isas", "native", "isa", "set_isa", "use_isa", "describe", "set_threads", "set_spin", "split_threads",
    "has_hooks", "module_plan",
    "qlinear", "qlinear_multi", "qlinear_ref", "packed", "Packed", "native_views", "numpy_views", "swiglu_mlp",
    "swiglu_mlp_ref",
    "greedy_picks", "sample_row",
    "route_softmax_topk", "route_softmax_topk_ref", "route_sigmoid_grouped", "route_sigmoid_grouped_ref",
    "SigmoidRouting", "moe_experts", "moe_experts_ref", "attn_decode", "attn_decode_ref",
    "deltanet_decode", "deltanet_decode_is_native", "delta_rule_chunked", "deltanet_block", "moe_block_args", "moe_block_run", "mlp_block_args",
    "mlp_block_run", "mlp_block_ref", "MtpStep",
    "ExpertViews", "norm_args", "rms_norm", "rms_norm_ref", "norm_rope_heads", "norm_rope_heads_ref",
    "attn_decode_is_native",
]
