"""A decode pass through a whole stack of decoder layers as their native calls back to back.

Where every layer's first half (fused attention, or Qwen3.5's Gated DeltaNet) and its MoE
half each run as one native call (a run's plans, `kernels.run_plan`, made by the
module-by-module pass of the run's first step of that shape), a decode step still walked the
modules: each layer's `__call__`, its `attn_residual` / `GatedDeltaNet.residual` and
`moe_residual`, their plan lookups, the recurrent states' get and set, two output tensors
and the numpy views of its activations. On 8 Qwen3-30B-shaped layers that glue took ~4 ms
of a ~39 ms step (its Python runs with caches that the weights' streaming has just emptied);
on the demo model about half of a step. `stack_run` runs the same halves with the same
arguments as one native call (`NativeStack`, csrc/bindings.cpp: the halves' arguments
checked once a run, where a call per half converted a dozen or more arrays each time; a
demo-model pass ~0.2 ms faster at every T in one process taking turns, ad hoc):
bit-identical to the module path, which runs whenever the stack does not apply (no plans,
a layer without both plans, hooks).

A stack serves one pass shape: B rows of T tokens (a decode step, a verification pass, one
row or a batch). It holds each layer's whole cache; each pass names its rows' slots and
positions, so one stack serves every slot and every batch of that shape.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from .deltanet import DELTA_WEIGHTS
from .routes import native_observer, observers_epoch, routes_seen

_UNSET, _SEEN = object(), object()


def run_layers(layers, x: torch.Tensor, cos_sin: tuple, cache, slots, pos0, plans: dict | None) -> torch.Tensor:
    """x through every decoder layer (called as layer(x, cos_sin, its cache entry, slots,
    pos0, plans=plans)): the stack's one loop where it applies (`stack_run`), else the
    modules one by one."""
    y = stack_run(layers, x, cos_sin, cache, slots, pos0, plans)
    if y is not None:
        return y
    if plans is not None and x.shape[1] <= kernels.FUSED_MAX_TOKENS:
        _path(plans)["module_passes"] += 1
    for i, layer in enumerate(layers):
        x = layer(x, cos_sin, cache.layers[i] if cache is not None else None, slots, pos0, plans=plans)
    return x


def stack_run(layers, x: torch.Tensor, cos_sin: tuple | None, cache, slots: torch.Tensor, pos0: torch.Tensor | None,
              plans: dict | None, rope: tuple | None = None, pos=None) -> torch.Tensor | None:
    """x [B, T, H] (the embeddings) through `layers`, row b at
    positions pos0[b].. of cache slot slots[b] -> [B, T, H]; None where the stack does not
    apply, and the caller runs the modules. A layer is input_layernorm, self_attn or
    linear_attn, post_attention_layernorm and mlp. The first pass of each shape in a run
    returns None: its modules make the plans that the next one reads. `rope` and `pos`
    (`model_pass`): the rope rows as the native calls take them and the rows' first positions
    (int64 numpy [B]), in place of cos_sin and pos0."""
    B, T, H = x.shape
    if plans is None or cache is None or T > kernels.FUSED_MAX_TOKENS:  # (a prompt: the modules)
        return None
    key = _stack_key(x.shape, x.dtype, cache)
    stack = plans.get(key, _UNSET)
    if stack is _UNSET:
        plans[key] = _SEEN
        return None
    nat = kernels._native()
    rope = kernels._rope_rows(cos_sin, B * T) if rope is None else rope
    p = np.asarray(pos0.numpy() if pos is None else pos, dtype=np.int64)
    if stack is _SEEN or (type(stack) is tuple and plans.get(("observers", key)) != observers_epoch()):
        # built now, or again: route observers came or went since (their calls are bound in)
        stack = plans[key] = _build(layers, x, cache, plans, rope, int(p[0]))
        plans[("observers", key)] = observers_epoch()
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


def _build(layers, x: torch.Tensor, cache, plans: dict, rope: tuple, pos: int) -> tuple | None:
    """The native stack (`NativeStack`: per layer its first half's and its MoE half's
    arguments, from the run's plans, checked once), the layers' experts modules and the
    DeltaNet layers' states; None unless every layer has both plans and no hooks."""
    B, T, H = x.shape
    native = kernels._native().NativeStack(B, T, H, x.dtype == torch.bfloat16)
    experts, deltanets = [], []
    for i, layer in enumerate(layers):
        mods = layer._modules
        block = mods.get("mlp")
        moe_plan = plans.get((block, (x.shape, x.dtype)))
        if moe_plan is None or kernels.has_hooks(layer):
            plans[_WHY_BUILD] = (f"layer {i} has hooks" if kernels.has_hooks(layer) else
                                 f"layer {i}'s MLP half is not one native call (a part torch runs)")
            return None
        first = _attention(mods.get("self_attn"), x, cache.layers[i], plans) if "self_attn" in mods else \
            _deltanet(mods.get("linear_attn"), x, cache.layers[i], plans)
        if first is None:
            plans[_WHY_BUILD] = f"layer {i}'s attention half is not one native call (an int8 KV cache, or a part torch runs)"
            return None
        if first[0] is _MLA:  # DeepSeek-V3's attention half (`models.deepseek_v3.mla_residual`)
            _, plan, half, joined = first
            native.add_mla(*plan.weights, joined, *plan.settings, *half)
        elif first[0] is _ATTN:
            _, (weights, heads_scale, gated, variants), half, kv_slot = first
            native.add_attention(*weights, *rope, *kv_slot, pos, *heads_scale, gated, *half, **variants)
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


def _attention(attn, x, kv, plans: dict) -> tuple | None:
    plan = plans.get((attn, (x.shape, x.dtype, kv)))  # attn_residual's: (attn_plan, half_norm_args)
    if plan is None or not plan[1]:
        return None
    attn_args, half = plan  # attn_args: `kernels.attn_plan`
    if getattr(attn_args, "mla", False):  # an MLA half's plan (`models.deepseek_v3.MlaPlan`): its joined cache
        return _MLA, attn_args, half, kernels._np(kv.joined)
    return _ATTN, attn_args, half, (kernels._np(kv.k), kernels._np(kv.v))


def _deltanet(dn, x, state, plans: dict) -> tuple | None:
    """GatedDeltaNet.residual's native call: its plans (the weights' views, and the fused
    call's projections, out_proj and norm), and its whole states as views, each row's slot
    updated in place."""
    views = plans.get((dn, DELTA_WEIGHTS))
    fused = plans.get((dn, (x.shape, x.dtype)))
    if dn is None or views is None or fused is None or kernels.has_hooks(dn):
        return None
    proj, out_proj, (norm_weight, norm_eps, norm_offset) = fused
    cw, al, dt, nw = views
    conv, S = state.tensors["conv"], state.tensors["recurrent"]
    if not kernels.deltanet_decode_is_native(x, conv, S):
        return None
    head = (kernels._np(norm_weight), norm_offset, norm_eps, [q.w for q in proj], [q.s for q in proj],
            [q.code for q in proj], out_proj.w, out_proj.s, out_proj.code, cw)
    return _DELTA, state, head, kernels._np(conv), kernels._np(S), (al, dt, nw, float(dn.norm.eps), dn.n_k)


def model_pass(model, input_ids: torch.Tensor, cache, slots: torch.Tensor | None, last_only: bool,
               plans: dict | None) -> tuple | None:
    """(logits, the final normed hidden state) of one decode pass of `model` (rows of a few
    tokens each: a decode step or a verification pass), a causal LM whose `model` holds
    embed_tokens, rope, layers and norm and whose lm_head gives the logits, with the embedding
    rows, the stack (`stack_run`), the final norm and the LM head as native calls and nothing
    else: what its forward returns, bit for bit. Around the stack's loop, a demo-model decode
    pass spent ~0.5 of ~1.8 ms in the modules' own calls (embedding, rope rows, cache
    positions, norm, LM head). None (nothing run, the cache untouched) until the run's modules
    have made the stack for this shape, or where a part would not run natively: the caller
    runs the modules."""
    if plans is None or cache is None:
        return None
    B, T = input_ids.shape
    m = model.model
    head = plans.get(("head", B, T, cache), _UNSET)
    if head is _UNSET:
        head = plans[("head", B, T, cache)] = _head(model, B, T, cache)
    if head is None or kernels.has_hooks(m.embed_tokens, m.norm, model.lm_head):
        return None
    emb, dtype, lengths, (norm_w, eps, offset), lm = head
    H = emb.shape[1]
    stack = plans.get(_stack_key((B, T, H), dtype, cache))
    if type(stack) is not tuple or _hooked(stack[1]):  # the modules make it first, and serve hooks
        return None
    ids = input_ids.numpy().reshape(B * T)
    if int(ids.min()) < 0:  # (numpy would wrap it round; nn.Embedding says what is wrong)
        return None
    slots = torch.arange(B) if slots is None else slots
    s = slots.numpy()
    pos = lengths[s]  # (a copy: the rows' first positions)
    rows = emb[ids]  # the embedding's rows, as nn.Embedding copies them (an id past the end raises)
    x = torch.from_numpy(rows).view(dtype).view(B, T, H)
    rope = m.rope.float_rows(int(pos[0]), T, dtype) if B == 1 else \
        m.rope.float_rows_at((pos[:, None] + np.arange(T)).reshape(B * T), dtype)
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


def _head(model, B: int, T: int, cache) -> tuple | None:
    """What `model_pass` reads besides the stack: the embedding as a numpy array (bf16 as its
    bits), the dtype, the cache's lengths as a numpy view, the final norm's native arguments
    and the LM head's `kernels.Packed`; None where the modules' calls would not be exactly
    these native ops (another module type, a norm over RMS_NORM_MAX, no native head)."""
    from .linear import native_call_views
    from .norm import RMSNorm

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

