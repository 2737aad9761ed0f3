"""A run's decode program: each pass shape's whole stack of decoder layers as one native call.

A stack (`NativeStack`, csrc/executors.inc) holds, per layer, its first half's (fused
attention, or Qwen3.5's Gated DeltaNet) and its MLP half's (routed MoE or dense MLP) native
arguments, checked once. It is built from the modules (`_build`: each half's plan,
`attention.attn_half_plan`, the DeltaNet layer's `half_plan`, `moe.mlp_half_plan`) when a run
starts (`prepare`, for the widths the run will use: `engine.generate.run_plans`), or, for a
pass shape the run did not name beforehand (a speculative verification pass, a test's pass),
by that pass before it runs: no pass runs the modules to make it. Nothing is decided again
per pass but the hooks (a forward hook added since sends the pass to the modules) and route
observers (a stack is built again when they came or went: their calls are bound in).

A stack serves one pass shape: B rows of T tokens (a decode step, a verification pass, one
row or a batch). It holds each layer's whole cache; each pass names its rows' slots and
positions, so one stack serves every slot and every batch of that shape. Bit-identical to
the layers' modules one by one (each half still its one native call), which run where the
stack does not apply (a half that is not one native call, hooks, autograd, a prompt).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from .attention import attn_half_plan
from .linear import native_call_views
from .moe import mlp_half_plan
from .norm import RMSNorm
from .routes import native_observer, observers_epoch, routes_seen

_UNSET = object()


def run_layers(layers, x: torch.Tensor, cos_sin: tuple, cache, slots, pos0, plans: dict | None) -> torch.Tensor:
    """x through every decoder layer (called as layer(x, cos_sin, its cache entry, slots,
    pos0)): the stack's one loop where it applies (`stack_run`), else the modules one by one."""
    y = stack_run(layers, x, cos_sin, cache, slots, pos0, plans)
    if y is not None:
        return y
    if plans is not None and x.shape[1] <= kernels.FUSED_MAX_TOKENS:
        _path(plans)["module_passes"] += 1
    for i, layer in enumerate(layers):
        x = layer(x, cos_sin, cache.layers[i] if cache is not None else None, slots, pos0)
    return x


def stack_run(layers, x: torch.Tensor, cos_sin: tuple | None, cache, slots: torch.Tensor, pos0: torch.Tensor | None,
              plans: dict | None, rope: tuple | None = None, pos=None) -> torch.Tensor | None:
    """x [B, T, H] (the embeddings) through `layers`, row b at
    positions pos0[b].. of cache slot slots[b] -> [B, T, H]; None where the stack does not
    apply, and the caller runs the modules. A layer is input_layernorm, self_attn or
    linear_attn, post_attention_layernorm and mlp. `rope` and `pos` (`model_pass`): the rope
    rows as the native calls take them and the rows' first positions (int64 numpy [B]), in
    place of cos_sin and pos0."""
    B, T, H = x.shape
    if plans is None or cache is None or T > kernels.FUSED_MAX_TOKENS or torch.is_grad_enabled():
        return None  # (a prompt, or autograd: the modules)
    nat = kernels._native()
    rope = kernels._rope_rows(cos_sin, B * T) if rope is None else rope
    p = np.asarray(pos0.numpy() if pos is None else pos, dtype=np.int64)
    stack = program(layers, x.shape, x.dtype, cache, plans, rope)
    if stack is None:
        return _why(plans, plans.get(_WHY_BUILD, "a layer half does not run natively"))
    native, experts, deltanets = stack
    if _hooked(experts):
        return _why(plans, "forward hooks on the routed experts, or global ones: the modules call them")
    kernels._sync_threads(nat)
    # two buffers taking turns: each first half writes a, each MoE half b
    a, b = kernels._out((B, T, H), x.dtype), kernels._out((B, T, H), x.dtype)
    # a pass of several tokens keeps every token's DeltaNet states (for a rollback); an expert
    # tracker's route masks, where there are any
    kept, conv_every, S_every = [], [], []
    if T > 1:
        for state in deltanets:
            conv_all = state.scratch("conv", (B, T, *state.tensors["conv"].shape[1:]))
            S_all = state.scratch("recurrent", (B, T, *state.tensors["recurrent"].shape[1:]))
            conv_every.append(kernels._np(conv_all))
            S_every.append(kernels._np(S_all))
            kept.append((state, conv_all, S_all))
    masks = [None if e is None else routes_seen(e) for e in experts]  # (None: a dense MLP layer)
    seen = [kernels._EMPTY_U8_NP if m is None else m for m in masks] if any(m is not None for m in masks) else []
    native.run(kernels._np(kernels._act(x.contiguous())), kernels._np(a), kernels._np(b), *rope,
               np.asarray(slots.numpy(), dtype=np.int64), p, conv_every, S_every, seen)
    _path(plans)["native_stack_passes"] += 1
    for state, conv_all, S_all in kept:
        state.keep_every(conv=conv_all, recurrent=S_all)
    return b


def program(layers, shape, dtype: torch.dtype, cache, plans: dict, rope: tuple) -> tuple | None:
    """The run's stack for passes of `shape` (B, T, H) in `dtype` over `cache`: (the
    `NativeStack`, each layer's experts module or None, the DeltaNet layers' states), built
    the first time a run asks for it (`prepare` asks when the run starts) and again when route
    observers came or went; None where a layer half does not run natively (why: the run's
    `decode_path`). `rope`: rows of the rope tables as the native calls take them (their
    shape is what the build checks)."""
    key = _stack_key(torch.Size(shape), dtype, cache)
    stack = plans.get(key, _UNSET)
    if stack is _UNSET or (stack is not None and plans.get(("observers", key)) != observers_epoch()):
        # built now, or again: route observers came or went since (their calls are bound in)
        with torch.inference_mode():
            stack = plans[key] = _build(layers, torch.empty(shape, dtype=dtype), cache, plans, rope)
        plans[("observers", key)] = observers_epoch()
    return stack


def prepare(model, cache, plans: dict, widths=(1,), T: int = 1) -> None:
    """Build the run's decode program before its first pass: the stack of each width in
    `widths` for passes of T tokens a row (a decode step: T = 1), and the head `model_pass`
    reads. `model` is a causal LM as `model_pass` takes it. Where a half does not run
    natively, the run's `decode_path` says which and why from then on."""
    m = model.model
    embed = m.embed_tokens
    # the activations' dtype: the embedding's (one kept in GGUF blocks says it by its final
    # norm's, as every half's norm must for the stack to take it)
    dtype = embed.weight.dtype if type(embed) is torch.nn.Embedding else m.norm.weight.dtype
    H = embed.embedding_dim
    if T > kernels.FUSED_MAX_TOKENS or kernels._native() is None or dtype not in kernels.FLOAT_DTYPES:
        return
    rope = m.rope.float_rows(0, T, dtype)
    for B in widths:
        _head_of(model, B, T, cache, plans)
        program(m.layers, (B, T, H), dtype, cache, plans, rope)


_PATH, _WHY_BUILD = "decode_path", "decode_path_build"


def decode_path(plans: dict | None) -> dict:
    """How a run's decode-sized passes ran: {"native_stack_passes", "module_passes", "why"}:
    how many went through the layer stack as one native call, how many through the layers'
    modules (each half still a native call where it can be), and the last reason the stack
    stepped aside. A run without plans (a forward called on its own) has no native stack."""
    if plans is None:
        return {"native_stack_passes": 0, "module_passes": None,
                "why": "this architecture runs its layers' modules (no native layer stack)"}
    return dict(_path(plans))


def module_pass(plans: dict | None, T: int, why: str) -> None:
    """A model without a native stack counts its decode-sized passes (`decode_path`) and says
    why it has none."""
    if plans is not None and T <= kernels.FUSED_MAX_TOKENS:
        _path(plans)["module_passes"] += 1
        _why(plans, why)


def _path(plans: dict) -> dict:
    got = plans.get(_PATH)
    if got is None:
        got = plans[_PATH] = {"native_stack_passes": 0, "module_passes": 0, "why": None}
    return got


def _why(plans: dict, why: str) -> None:
    """The stack steps aside for a lasting reason: say it (`decode_path`)."""
    _path(plans)["why"] = why
    return None


def _stack_key(shape, dtype: torch.dtype, cache) -> tuple:
    """A stack's key in the run's plans: the calls hold views of this cache's tensors."""
    return "stack", torch.Size(shape), dtype, cache


def _hooked(experts) -> bool:
    """Forward hooks added since the stack was made (on the experts, or global ones): the
    modules call them. (Predictors and profilers watch through route observers instead,
    which the stack calls: `layers.routes`.)"""
    return kernels.has_hooks() or any(e is not None and e._forward_pre_hooks for e in experts)


_ATTN, _DELTA, _MLA = "attention", "deltanet", "mla"


def _build(layers, x: torch.Tensor, cache, plans: dict, rope: tuple) -> tuple | None:
    """The native stack for passes of x's shape and dtype (`NativeStack`: per layer its first
    half's and its MLP half's arguments, checked once), the layers' experts modules and the
    DeltaNet layers' states; None unless every layer's halves are each one native call and
    no layer has hooks (why: plans[_WHY_BUILD])."""
    B, T, H = x.shape
    native = kernels._native().NativeStack(B, T, H, x.dtype == torch.bfloat16)
    experts, deltanets = [], []
    for i, layer in enumerate(layers):
        mods = layer._modules
        if kernels.has_hooks(layer):
            plans[_WHY_BUILD] = f"layer {i} has hooks"
            return None
        moe_plan = mlp_half_plan(x, mods["post_attention_layernorm"], mods["mlp"])
        if moe_plan is None:
            plans[_WHY_BUILD] = f"layer {i}'s MLP half is not one native call (a part torch runs)"
            return None
        first = _attention(mods["self_attn"], mods["input_layernorm"], x, cache.layers[i]) if "self_attn" in mods else \
            _deltanet(mods.get("linear_attn"), mods["input_layernorm"], x, cache.layers[i])
        if first is None:
            plans[_WHY_BUILD] = f"layer {i}'s attention half is not one native call (an int8 KV cache, or a part torch runs)"
            return None
        if first[0] is _MLA:  # DeepSeek-V3's attention half (`models.deepseek_v3.mla_residual`)
            _, plan, half, joined = first
            native.add_mla(*plan.weights, joined, *plan.settings, *half)
        elif first[0] is _ATTN:
            _, (weights, heads_scale, gated, variants), half, kv_slot = first
            native.add_attention(*weights, *rope, *kv_slot, 0, *heads_scale, gated, *half, **variants)
        else:
            _, state, head, conv, S, tail = first
            native.add_deltanet(*head, conv, *tail[:2], S, *tail[2:])
            deltanets.append(state)
        e, moe_args = moe_plan
        if e is None:  # a dense MLP half (`moe.mlp_residual`)
            native.add_mlp(*moe_args)
        else:
            native.add_moe(*moe_args, native_observer(e, x.dtype))
        experts.append(e)
    return native, experts, deltanets


def _attention(attn, norm, x, kv) -> tuple | None:
    own = getattr(attn, "half_plan", None)  # an attention half of its own (DeepSeek-V3's MLA)
    plan = own(x, norm, kv) if own is not None else attn_half_plan(x, norm, attn, kv)  # (plan, half_norm_args)
    if plan is None:
        return None
    attn_args, half = plan  # attn_args: `kernels.attn_plan`
    if getattr(attn_args, "mla", False):  # an MLA half's plan (`kernels.MlaPlan`): its joined cache
        return _MLA, attn_args, half, kernels._np(kv.joined)
    return _ATTN, attn_args, half, (kernels._np(kv.k), kernels._np(kv.v))


def _deltanet(dn, norm, x, state) -> tuple | None:
    """GatedDeltaNet.residual's native call: its plan (the weights' views, and the fused
    call's projections, out_proj and norm: `half_plan`), and its whole states as views, each
    row's slot updated in place."""
    if dn is None or state is None:
        return None
    conv, S = state.tensors["conv"], state.tensors["recurrent"]
    plan = dn.half_plan(x, norm, conv, S)
    if plan is None or not kernels.deltanet_decode_is_native(x, conv, S):
        return None
    (cw, al, dt, nw), (proj, out_proj, (norm_weight, norm_eps, norm_offset)) = plan
    head = (kernels._np(norm_weight), norm_offset, norm_eps, [q.w for q in proj], [q.s for q in proj],
            [q.code for q in proj], out_proj.w, out_proj.s, out_proj.code, cw)
    return _DELTA, state, head, kernels._np(conv), kernels._np(S), (al, dt, nw, float(dn.norm.eps), dn.n_k)


def model_pass(model, input_ids: torch.Tensor, cache, slots: torch.Tensor | None, last_only: bool,
               plans: dict | None) -> tuple | None:
    """(logits, the final normed hidden state) of one decode pass of `model` (rows of a few
    tokens each: a decode step or a verification pass), a causal LM whose `model` holds
    embed_tokens, rope, layers and norm and whose lm_head gives the logits, with the embedding
    rows, the run's stack for this shape (`program`), the final norm and the LM head as native
    calls and nothing else: what its forward returns, bit for bit. None (nothing run, the
    cache untouched) where a part would not run natively: the caller runs the modules."""
    B, T = input_ids.shape
    if plans is None or cache is None or T > kernels.FUSED_MAX_TOKENS:
        return None
    m = model.model
    head = _head_of(model, B, T, cache, plans)
    if head is None or kernels.has_hooks(m.embed_tokens, m.norm, model.lm_head) or torch.is_grad_enabled():
        return None
    emb, dtype, lengths, (norm_w, eps, offset), lm = head
    H = emb.shape[1]
    ids = input_ids.numpy().reshape(B * T)
    if int(ids.min()) < 0:  # (numpy would wrap it round; nn.Embedding says what is wrong)
        return None
    slots = torch.arange(B) if slots is None else slots
    s = slots.numpy()
    pos = lengths[s]  # (a copy: the rows' first positions)
    rope = m.rope.float_rows(int(pos[0]), T, dtype) if B == 1 else \
        m.rope.float_rows_at((pos[:, None] + np.arange(T)).reshape(B * T), dtype)
    stack = program(m.layers, (B, T, H), dtype, cache, plans, rope)
    if stack is None or _hooked(stack[1]):  # (the modules serve hooks)
        return None
    rows = emb[ids]  # the embedding's rows, as nn.Embedding copies them (an id past the end raises)
    x = torch.from_numpy(rows).view(dtype).view(B, T, H)
    y = stack_run(m.layers, x, None, cache, slots, None, plans, rope=rope, pos=pos)
    if y is None:
        return None
    lengths[s] += T  # cache.advance
    nat = kernels._native()
    hidden = kernels._out((B, T, H), dtype)
    h2 = kernels._np(hidden).reshape(B * T, H)
    nat.rms_norm(kernels._np(y).reshape(B * T, H), norm_w, h2, eps, offset)
    rows_out = h2 if not last_only or T == 1 else h2[T - 1 :] if B == 1 else h2.reshape(B, T, H)[:, -1].copy()
    logits = kernels._out((B, rows_out.shape[0] // B, lm.w.shape[0]), torch.float32)  # (`linear.head_logits`)
    nat.qlinear_multi(rows_out, [lm.w], [lm.s], [lm.code], kernels._np(logits).reshape(rows_out.shape[0], -1))
    return logits, hidden


def _head_of(model, B: int, T: int, cache, plans: dict) -> tuple | None:
    """`_head` for passes of B rows of T tokens, made once a run."""
    key = ("head", B, T, cache)
    head = plans.get(key, _UNSET)
    if head is _UNSET:
        head = plans[key] = _head(model, B, T, cache)
    return head


def _head(model, B: int, T: int, cache) -> tuple | None:
    """What `model_pass` reads besides the stack: the embedding as a numpy array (bf16 as its
    bits), the dtype, the cache's lengths as a numpy view, the final norm's native arguments
    and the LM head's `kernels.Packed`; None where the modules' calls would not be exactly
    these native ops (another module type, a norm over RMS_NORM_MAX, no native head)."""
    m = model.model
    embed, norm = m.embed_tokens, m.norm
    if type(embed) is not torch.nn.Embedding or type(norm) is not RMSNorm or not kernels.native():
        return None
    w = embed.weight.detach()
    dtype = w.dtype
    H = w.shape[1]
    if (dtype not in kernels.FLOAT_DTYPES or B * T * H > kernels.RMS_NORM_MAX
            or (dtype == torch.float32 and norm.weight.dtype != torch.float32)):
        return None  # RMSNorm.forward would not make exactly one native call
    lm = native_call_views(model.lm_head, torch.empty(B, T, H, dtype=dtype))  # (the most rows the head gets)
    if lm is None or lm.w.shape[0] != model.lm_head.out_features:
        return None
    nw, eps, offset = kernels.norm_args(norm)
    return kernels._np(w), dtype, cache.lengths.numpy(), (kernels._np(nw), eps, offset), lm
