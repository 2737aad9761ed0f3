"""Putting a store behind a model: `StoreExperts` replaces each `Experts` module.

Two ways in:
- `load(path, options=StoreOptions(...))`: builds the net without ever materialising the
  routed experts (only their byte ranges are kept), so the RAM budget holds from the
  start; this is what the CLI uses.
- `attach_store(net, path, options)`: for a net already loaded the ordinary way; its
  stacked expert tensors are freed once the store is in place (peak RAM at load was the
  full model, but it is not kept).
"""

from __future__ import annotations

import re
import time
import weakref
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..errors import MoerunError
from ..kernels.reference import dispatch, group_by_expert, swiglu
from ..layers.moe import Experts, native_float_experts
from ..layers.routes import routed
from ..kernels.formats import expert_code
from ..layers.quantized import QuantizedExperts
from .store import (ExpertStore, LayerExperts, StoreOptions, _stacked_pieces, auto_budget, expert_pieces, is_auto,
                    mem_available, parse_budget, quantized_expert_pieces)
from ..config import read_generation_config
from ..engine.llm import LLM, check_vocab, compute_dtype, default_model_path, gguf_extras, load_tokenizer, set_threads
from ..loaders.gguf import GGUFFile, RAW_FORMATS, TYPE_FORMATS, arch_of, gguf_names, is_gguf, transform_of
from ..loaders.hf import _renamed
from ..loaders.hub import resolve
from ..loaders.quantized import quantize_at_load, stored_policy
from ..loaders.safetensors import Checkpoint, TensorRef
from ..models import build_on_meta, module_for

# N tokens, H hidden, I expert width, E experts, K experts per token


class StoreExperts(nn.Module):
    """Same call as `Experts`: x [N, H], ids [N, K], weights [N, K] -> [N, H]; weights come
    from the store. The arithmetic is `Experts`' own, so outputs are bit-identical to the
    plain model whatever the tiers hold: a decode-sized pass over float experts in CPU memory
    runs the same native call (`kernels.moe_experts_float`, given each expert's pieces where
    the store holds them; a pair's arithmetic does not depend on the other experts in the
    call), the rest expert by expert through `dispatch`, op for op as `expert_mlp`."""

    native_kernels = True  # decode-sized passes over float experts in RAM: kernels.moe_experts_float

    def __init__(self, layer: int, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.layer, self.num_experts, self.hidden, self.inter = layer, num_experts, hidden, inter
        self.store: ExpertStore | None = None

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}"

    def fused_views(self, x: torch.Tensor) -> kernels.ExpertViews | None:
        """The experts as a native MoE half takes them (`layers.moe.moe_residual`, the layer
        stack): a `StoreSource` that asks the store for each pass's experts and lets the op read
        them where they lie. None where the store's experts are not CPU memory the native
        kernels read (a CUDA device tier) or the pass would not run natively here."""
        store = self.store
        if store is None or not kernels.native() or (store.link is not None and not store.emulated):
            return None
        fmt = getattr(self, "fmt", None)
        if fmt is None:
            if store.dtype not in kernels.FLOAT_DTYPES or not kernels.float_native_rows(x):
                return None
            code = kernels.FLOAT_FORMATS[store.dtype][1]
        else:
            code = expert_code(fmt, getattr(self, "down_fmt", None))
        source = self.__dict__.get("_source")
        if source is None:
            source = self._source = StoreSource(self)
        return kernels.ExpertViews(code, [], [], [], [], [], [], source)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        routed(self, x, ids, weights)
        N, K = ids.shape
        order, counts = group_by_expert(ids, self.num_experts)
        needed = [e for e, c in enumerate(counts) if c]
        where: dict[int, str] = {}
        got = self.store.get(self.layer, needed, n_tokens=N, counts=counts, where=where)
        if needed and native_float_experts(x, got[needed[0]][0]):  # one native call, on the pieces where they lie
            pieces = list(zip(*(got[e] for e in needed)))  # (gates, ups, downs)
            return self._native(ids, needed, counts, where,
                                lambda local: kernels.moe_experts_float(x, local, weights, *pieces,
                                                                               dtype=x.dtype).to(x.dtype))
        ran = []

        def run_expert(e, xs):
            gate, up, down = got[e]
            t0 = time.perf_counter()
            if gate.device != xs.device:  # experts on a real GPU (UNTESTED path)
                y = swiglu(xs.to(gate.device, non_blocking=True), gate, up, down).to(xs.device)
            else:
                y = swiglu(xs, gate, up, down)
            ran.append((e, where[e], xs.shape[0], time.perf_counter() - t0))
            return y

        try:
            return dispatch(x, ids, weights, order, counts, run_expert)
        finally:
            self.store.release(self.layer, needed, ran)

    def _native(self, ids, needed: list[int], counts: list[int], where: dict, run) -> torch.Tensor:
        """run(ids renumbered 0..n-1 over the needed experts, ascending): one native call over
        all of them; its time is shared out by each expert's tokens. Releases the experts."""
        local = torch.empty(self.num_experts, dtype=torch.long)
        local[needed] = torch.arange(len(needed))
        ran = []
        try:
            t0 = time.perf_counter()
            y = run(local[ids])
            sec = (time.perf_counter() - t0) / ids.numel()
            ran = [(e, where[e], counts[e], sec * counts[e]) for e in needed]
        finally:
            self.store.release(self.layer, needed, ran)
        return y


class StoreSource:
    """A store-backed experts module's experts as a native MoE half reads them, pass by pass
    (`kernels.ExpertViews.source`): `fetch` gets from the store the experts the pass's routing
    picked (hits, misses and stall counted as `StoreExperts` counts them) and hands the op
    their numpy views, kept on the store's weights while they live (`store.ExpertWeights`);
    `release` gives them back with each expert's share of the time they were held."""

    def __init__(self, module: StoreExperts):
        # weakly: the native MoE halves that hold this source are kept by the net's plans, and
        # a strong reference back to the net's module would make a cycle through C++ that the
        # collector cannot see
        self._module, self.inter = weakref.ref(module), module.inter
        self._held = None

    @property
    def module(self) -> StoreExperts:
        m = self._module()
        if m is None:
            raise MoerunError("the experts module of this expert source is gone")
        return m

    def fetch(self, ids, T: int) -> tuple:
        m = self.module
        counts = np.bincount(ids, minlength=m.num_experts)  # (numpy: ~2 us where torch's took ~20-50)
        needed = np.flatnonzero(counts).tolist()  # ascending
        counts = counts.tolist()
        where: dict[int, str] = {}
        got = m.store.get(m.layer, needed, n_tokens=T, counts=counts, where=where)
        self._held = needed, counts, where, time.perf_counter()
        cols = list(zip(*map(_numpy_views, (got[e] for e in needed)))) if needed else [()] * 3
        if len(cols) == 3:  # float experts: gate, up, down without scales
            cols = [cols[0], [], cols[1], [], cols[2], []]
        return (needed, *map(list, cols))

    def release(self, ok: bool = True) -> None:
        held, self._held = self._held, None
        if held is None:  # the store's get failed: it holds nothing
            return
        needed, counts, where, t0 = held
        sec = (time.perf_counter() - t0) / max(1, sum(counts))
        self.module.store.release(self.module.layer, needed,
                                  [(e, where[e], counts[e], sec * counts[e]) for e in needed] if ok else ())


def _numpy_views(w: tuple) -> tuple:
    """The native ops' numpy views of one expert's weights, kept on them (the store's
    `ExpertWeights`) for as long as they live in that buffer."""
    views = getattr(w, "np", None)
    if views is None:
        views = kernels.numpy_views(*w)
        if hasattr(w, "__dict__"):
            w.np = views
    return views


class QuantStoreExperts(StoreExperts):
    """`StoreExperts` for packed experts (a checkpoint written by `moerun quantize`): the
    layer's needed experts are read where the store holds them by ONE native `moe_experts`
    call, with ids renumbered 0..n-1 in expert order. The kernel's tiles depend only on each
    expert's pairs and the number of experts in use, and its weighted sum runs in k order, so
    the output is bit-identical to `QuantizedExperts` on the full stack
    (tests/test_expert_store_quant.py checks it)."""

    def __init__(self, layer: int, num_experts: int, hidden: int, inter: int, fmt: str, down_fmt: str | None = None):
        super().__init__(layer, num_experts, hidden, inter)
        self.fmt, self.down_fmt = fmt, down_fmt or fmt

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fmt={self.fmt}" + (f", down_fmt={self.down_fmt}" if self.down_fmt != self.fmt else "")

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        routed(self, x, ids, weights)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        needed = counts.nonzero().flatten().tolist()  # ascending
        counts = counts.tolist()
        where: dict[int, str] = {}
        got = self.store.get(self.layer, needed, n_tokens=x.shape[0], counts=counts, where=where)
        views = [list(v) for v in zip(*(_numpy_views(got[e]) for e in needed))] if needed else None
        y = self._native(ids, needed, counts, where, lambda local: kernels.moe_experts(
            x, local, weights, *[[got[e][j] for e in needed] for j in range(6)], self.fmt, self.inter, views,
            dtype=x.dtype, down_fmt=self.down_fmt))
        return y.to(x.dtype)


def _layer_index(name: str, fallback: int) -> int:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else fallback


def _swap_experts(net: nn.Module, quant: dict | None = None) -> list[tuple[str, StoreExperts]]:
    """Replace every `Experts` (or `QuantizedExperts`) in `net` with a `StoreExperts` (or
    `QuantStoreExperts`); returns (name, new module). quant: {name: (fmt, down_fmt)} of float
    `Experts` (on the meta device, before loading) whose experts the store holds packed."""
    found = [(n, m) for n, m in net.named_modules() if isinstance(m, (Experts, QuantizedExperts))]
    # trunk layers keep their index; others (an MTP head's `mtp.layers.0`) get fresh ones after
    trunk = [n for n, _ in found if not (n.startswith("mtp") or ".mtp." in n)]
    ids: dict[str, int | None] = {}
    for n in trunk:
        i = _layer_index(n, len(ids))
        ids[n] = i if i not in ids.values() else None
    nxt = max((i for i in ids.values() if i is not None), default=-1) + 1
    for n, _ in found:
        if ids.get(n) is None:
            ids[n] = nxt
            nxt += 1
    out = []
    for name, mod in found:
        if isinstance(mod, QuantizedExperts):
            new = QuantStoreExperts(ids[name], mod.num_experts, mod.hidden_size, mod.intermediate_size, mod.fmt,
                                    getattr(mod, "down_fmt", None))
        elif quant and name in quant:
            E, I, H = mod.gate_proj.shape
            new = QuantStoreExperts(ids[name], E, H, I, *quant[name])
        else:
            E, I, H = mod.gate_proj.shape
            new = StoreExperts(ids[name], E, H, I)
        parent_name, _, attr = name.rpartition(".")
        setattr(net.get_submodule(parent_name) if parent_name else net, attr, new)
        out.append((name, new))
    if not out:
        raise MoerunError("this model has no routed experts for an expert store to hold")
    return out


def _make_store(net, swapped, model_dir: Path, dtype, options: StoreOptions | None, names=None, pieces=None,
                available=None, identity=None, non_expert_bytes=None) -> ExpertStore:
    """The store of the `swapped` experts, read from `names` (our tensor name -> TensorRef;
    by default the safetensors checkpoint's), or given as GGUF block rows (`pieces`: module
    name -> per expert (gate, up, down) Pieces, repacked at read). available, identity: free
    RAM and the files' (size, mtime) when loading began; non_expert_bytes: default, the net's
    weights."""
    if non_expert_bytes is None:
        non_expert_bytes = resident_bytes(net)
    if pieces is None and names is None:

        # a checkpoint written by `moerun quantize` holds our names
        renames = () if stored_policy(model_dir) is not None else getattr(net, "checkpoint_renames", ())
        names = _renamed(Checkpoint(model_dir), renames)
    layers = []
    for name, m in swapped:
        fmt, down_fmt = getattr(m, "fmt", None), getattr(m, "down_fmt", None)
        if pieces is not None:
            layers.append(LayerExperts(m.layer, m.num_experts, m.hidden, m.inter, pieces[name], fmt, down_fmt, ggml=True))
            continue
        got = (expert_pieces(names, name, m.num_experts, m.hidden, m.inter) if fmt is None
               else quantized_expert_pieces(names, name, m.num_experts, m.hidden, m.inter, fmt, down_fmt))
        layers.append(LayerExperts(m.layer, m.num_experts, m.hidden, m.inter, got, fmt, down_fmt))
    top_k = getattr(getattr(net, "args", None), "num_experts_per_tok", 8)
    store = ExpertStore(layers, dtype, options, top_k=top_k, non_expert_bytes=non_expert_bytes, available=available,
                        identity=identity)
    if store.fmt is not None and store.link is not None and not store.emulated:
        store.close()
        raise MoerunError(f"{store.fmt} experts run on the CPU's native kernels; a CUDA device tier for them is not "
                          "built (use --emulate-link to emulate one, or drop --vram-budget)")
    for _, m in swapped:
        m.store = store
    net.expert_store = store
    return store


def _gguf_expert_refs(path: Path, net: nn.Module) -> dict:
    """Our names of the routed experts' stacked tensors -> TensorRef of their bytes in a GGUF
    file: float experts as `X.gate_proj` [E, I, H], raw-format ones as `X.gate_q` [E, I, row
    bytes] with empty `X.gate_scales` (their scales are in the rows), so the store reads an
    expert's projections straight from the file's byte ranges."""

    f = GGUFFile(path)
    try:
        # the float net's names (the loaded one has quantized modules in the experts' place)
        names = gguf_names(build_on_meta(module_for(net.args.model_type), net.args), arch_of(f))
        refs = {}
        for prefix, m in net.named_modules():
            if not isinstance(m, (Experts, QuantizedExperts)):
                continue
            for proj in ("gate", "up", "down"):
                t = f.tensors.get(names.get(f"{prefix}.{proj}_proj", ""))
                if t is None:
                    raise MoerunError(f"{path}: the expert store needs the experts of {prefix} stacked in one tensor "
                                      f"per projection (ffn_{proj}_exps)")
                fmt = TYPE_FORMATS.get(t.type)
                if isinstance(m, Experts):
                    dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[t.type]
                    refs[f"{prefix}.{proj}_proj"] = TensorRef(t.name, t.path, dt, t.shape, t.offset, t.nbytes)
                elif fmt in RAW_FORMATS:
                    E, rows = t.shape[0], t.shape[1]
                    refs[f"{prefix}.{proj}_q"] = TensorRef(t.name, t.path, torch.uint8, (E, rows, t.row_bytes),
                                                          t.offset, t.nbytes)
                    refs[f"{prefix}.{proj}_scales"] = TensorRef(t.name, t.path, torch.float16, (E, rows, 0),
                                                               t.offset, 0)
                else:
                    raise MoerunError(f"{path}: the expert store reads experts in Q4_K, Q5_K, Q6_K, Q5_0 or float from "
                                      f"a GGUF file; {t.name} is {t.type}, which moerun repacks at load")
        return refs
    finally:
        f.close()


EXPERT_TENSOR = re.compile(r"\.ffn_(gate|up|down)_exps\.")


def gguf_resident_bytes(path) -> int:
    """Bytes of a GGUF file's tensors other than the routed experts' stacks: the weights a
    store-backed model keeps resident (Q8_0/Q4_0 repacked at the same size)."""

    f = GGUFFile(path)
    try:
        return sum(t.nbytes for n, t in f.tensors.items() if not EXPERT_TENSOR.search(n))
    finally:
        f.close()


def resident_bytes(net: nn.Module) -> int:
    """Bytes of the net's parameters and buffers (each storage once): the weights it keeps
    outside an expert store."""
    seen, n = set(), 0
    for t in [*net.parameters(), *net.buffers()]:
        if t.is_meta:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            n += t.numel() * t.element_size()
    return n


def _gguf_block_experts(path: Path, net: nn.Module) -> dict:
    """{module name: ((fmt, down_fmt), per expert (gate, up, down) Pieces)} for the routed
    experts of a (meta-device, float) net whose GGUF stacks are Q8_0/Q4_0 blocks, read as rows
    of blocks and repacked by the store; {} when they are not."""

    f = GGUFFile(path)
    try:
        arch = arch_of(f)
        names = gguf_names(net, arch)
        found, other = {}, []
        for prefix, m in net.named_modules():
            if not isinstance(m, Experts):
                continue
            ts = {p: f.tensors.get(names.get(f"{prefix}.{p}_proj", "")) for p in ("gate", "up", "down")}
            fmts = {p: TYPE_FORMATS.get(t.type) if t is not None else None for p, t in ts.items()}
            if not any(v in ("int8", "int4") for v in fmts.values()):
                other.append(prefix)
                continue
            bad = next((t for p, t in ts.items() if t is None or fmts[p] not in ("int8", "int4")), None)
            if bad is not None or fmts["gate"] != fmts["up"] or any(
                    transform_of(arch, f"{prefix}.{p}_proj", net.args) is not None for p in ts):
                raise MoerunError(f"{path}: the expert store reads the experts of {prefix} as Q8_0/Q4_0 blocks, but "
                                  f"its stacks are {', '.join(t.type if t else 'missing' for t in ts.values())}")
            E = ts["gate"].shape[0]
            cols = []
            for p, t in ts.items():
                rows = t.shape[1]
                ref = TensorRef(t.name, t.path, torch.uint8, (E, rows, t.row_bytes), t.offset, t.nbytes)
                cols.append(_stacked_pieces(ref, E, (rows, t.row_bytes)))
            down = None if fmts["down"] == fmts["gate"] else fmts["down"]
            found[prefix] = ((fmts["gate"], down), tuple(zip(*cols)))
        if found and other:
            raise MoerunError(f"{path}: the expert store needs one kind of experts; {other[0]} is not Q8_0/Q4_0 "
                              f"and {next(iter(found))} is")
        return found
    finally:
        f.close()


def attach_store(net: nn.Module, model_dir, options: StoreOptions | None = None) -> ExpertStore:
    """Put an `ExpertStore` behind an already loaded net (its expert tensors are dropped);
    quantized experts only from a checkpoint written by `moerun quantize` (the store reads
    their blocks from its files)."""

    if stored_policy(model_dir) is None and any(isinstance(m, QuantizedExperts) for m in net.modules()):
        raise MoerunError("the expert store reads quantized experts from a checkpoint written by `moerun quantize`, "
                          f"and {model_dir} is a float one (experts quantized at load cannot be streamed from it)")
    dtype = next((m.gate_proj.dtype for m in net.modules() if isinstance(m, Experts)), torch.float32)
    swapped = _swap_experts(net)
    return _make_store(net, swapped, Path(model_dir), dtype, options)


def build(model_dir, dtype="auto", options: StoreOptions | None = None, prepare=None, check_weights: bool = False,
          available: int | None = None):
    """Like `moerun.loaders.build`, with routed experts in a store and never materialised.
    Returns (architecture module, args, net, dtype, store). prepare(net), when given, runs
    first on the meta-device net; check_weights as `loaders.build`'s."""
    from ..loaders import build as build_net

    swapped = []

    def swap(net):  # before loading: the expert parameters are then gone from what the loader reads
        if prepare is not None:
            prepare(net)
        swapped.extend(_swap_experts(net))

    arch, args, net, dtype = build_net(model_dir, dtype, prepare=swap, check_weights=check_weights)
    store = _make_store(net, swapped, Path(model_dir), dtype, options, available=available)
    return arch, args, net, dtype, store


def load(path=None, dtype="auto", threads: int | None = None, options: StoreOptions | None = None, quant=None,
         check_weights: bool = False):
    """`moerun.load` with an expert store: returns an `LLM` whose `.store` is the ExpertStore.
    A checkpoint written by `moerun quantize` keeps its experts packed in the store; `quant`
    may name its policy (a no-op) but cannot quantize a float checkpoint's experts here."""


    path = default_model_path() if path is None else resolve(path)

    if is_gguf(path):
        return _load_gguf(path, dtype, threads, options, quant, check_weights)
    if quant not in (None, "none"):
        if stored_policy(path) is None:
            raise MoerunError(f"--quant {quant} with the expert store needs a quantized checkpoint: write one with "
                              f"`moerun quantize -m {path} -o OUT --policy {quant}`, then pass -m OUT")
        quantize_at_load(None, path, quant)  # the stored policy: nothing to do; another: an error
    set_threads(threads)
    available = mem_available() if options is not None and is_auto(options.ram_budget) else None
    asked = dtype
    tokenizer = load_tokenizer(path)
    gen = read_generation_config(path)
    arch, args, net, dtype, store = build(path, dtype, options, check_weights=check_weights,
                                          prepare=lambda net: check_vocab(tokenizer, net.args.vocab_size),
                                          available=available)
    dtype, kv_dtype = compute_dtype(net, asked, dtype, None)
    llm = LLM(net, args, arch, tokenizer, path, dtype, gen)
    llm.kv_dtype = kv_dtype
    llm.store = store
    return llm


def _load_gguf(path: Path, dtype, threads, options, quant, check_weights):
    """`load` for a GGUF file: the net is loaded with its experts as views of the file's memory
    map (no page read), then each routed experts module makes way for a store module that reads
    its experts' byte ranges from the same file."""
    from ..loaders.gguf import build as build_gguf

    import os

    if quant not in (None, "none"):
        raise MoerunError("--quant does not apply to a GGUF file: its tensors are quantized already")
    set_threads(threads)
    options = options or StoreOptions()
    st = os.stat(path)
    identity = {path: (st.st_size, st.st_mtime_ns)}  # a file changed under the model is refused
    resident = gguf_resident_bytes(path)
    available = None
    if is_auto(options.ram_budget):  # refused before any weight loads when they would not fit
        available = mem_available()
        auto_budget(resident, parse_budget(options.auto_margin, 0), available)
    tokenizer, gen, no_tokenizer = gguf_extras(path)
    early: dict = {}

    def prepare(net):
        check_vocab(tokenizer, net.args.vocab_size)
        # Q8_0/Q4_0 experts would be repacked at load (every byte of them read): the store
        # modules take their place first, and the store repacks each expert as it reads it
        found = _gguf_block_experts(path, net)
        if found:
            early["pieces"] = found
            early["swapped"] = _swap_experts(net, {n: v[0] for n, v in found.items()})

    arch, args, net, loaded_dtype = build_gguf(path, dtype, prepare=prepare, check_weights=check_weights)
    if early:
        swapped = early["swapped"]
        store = _make_store(net, swapped, path, loaded_dtype, options, pieces={n: v[1] for n, v in early["pieces"].items()},
                            available=available, identity=identity, non_expert_bytes=resident)
    else:
        refs = _gguf_expert_refs(path, net)
        float_dtype = next((m.gate_proj.dtype for m in net.modules() if isinstance(m, Experts)), loaded_dtype)
        swapped = _swap_experts(net)  # the views of the memory map go with the modules
        store = _make_store(net, swapped, path, float_dtype, options, names=refs, available=available,
                            identity=identity, non_expert_bytes=resident)
    dtype, kv_dtype = compute_dtype(net, dtype, loaded_dtype, None)
    llm = LLM(net, args, arch, tokenizer, path, dtype, gen)
    llm.kv_dtype, llm.no_tokenizer, llm.store = kv_dtype, no_tokenizer, store
    return llm
