"""A decode pass through a whole stack of decoder layers as their native calls back to back.

Where every layer's first half (fused attention, or Qwen3.5's Gated DeltaNet) and its MoE
half each run as one native call (a run's plans, `kernels.run_plan`, made by the
module-by-module pass of the run's first step of that shape), a decode step still walked the
modules: each layer's `__call__`, its `attn_residual` / `GatedDeltaNet.residual` and
`moe_residual`, their plan lookups, the recurrent states' get and set, two output tensors
and the numpy views of its activations. On 8 Qwen3-30B-shaped layers that glue took ~4 ms
of a ~39 ms step (its Python runs with caches that the weights' streaming has just emptied);
on the demo model about half of a step. `stack_run` makes the same native calls with the
same arguments from one loop: bit-identical to the module path, which runs whenever the
stack does not apply (no plans, a batch, a layer without both plans, hooks).
"""

from __future__ import annotations

import torch

from .. import kernels
from .deltanet import DELTA_WEIGHTS
from .routes import routes_seen

_UNSET, _SEEN = object(), object()


def run_layers(layers, x: torch.Tensor, cos_sin: tuple, cache, slots, pos0, plans: dict | None) -> torch.Tensor:
    """x through every decoder layer (called as layer(x, cos_sin, its cache entry, slots,
    pos0, plans=plans)): the stack's one loop where it applies (`stack_run`), else the
    modules one by one."""
    y = stack_run(layers, x, cos_sin, cache, slots, pos0, plans)
    if y is not None:
        return y
    for i, layer in enumerate(layers):
        x = layer(x, cos_sin, cache.layers[i] if cache is not None else None, slots, pos0, plans=plans)
    return x


def stack_run(layers, x: torch.Tensor, cos_sin: tuple, cache, slots: torch.Tensor, pos0: torch.Tensor,
              plans: dict | None) -> torch.Tensor | None:
    """x [1, T, H] (the embeddings) through `layers` at positions pos0.. of cache slot
    slots[0] -> [1, T, H]; None where the stack does not apply, and the caller runs the
    modules. A layer is input_layernorm, self_attn or linear_attn, post_attention_layernorm
    and mlp. The first pass of each shape in a run returns None: its modules make the plans
    that the next one reads."""
    if plans is None or cache is None or x.shape[0] != 1:
        return None
    T, H = x.shape[1], x.shape[2]
    s = int(slots[0])
    key = ("stack", x.shape, x.dtype, s, cache)  # the calls hold views of this cache's slot
    stack = plans.get(key, _UNSET)
    if stack is _UNSET:
        plans[key] = _SEEN
        return None
    if stack is _SEEN:
        stack = plans[key] = _build(layers, x, cache, s, plans)
    if stack is None:
        return None
    calls, experts = stack
    # hooks added since (a predictor on the experts, a global one): the modules call them
    if kernels.has_hooks() or any(e._forward_pre_hooks for e in experts):
        return None
    nat = kernels._native()
    kernels._sync_threads(nat)
    rope = kernels._rope_rows(cos_sin, T)
    p = int(pos0[0])
    # two buffers taking turns: each first half writes a, each MoE half b (the attention and
    # MoE calls take [T, H] rows, the DeltaNet's [B, T, H])
    a, b = kernels._out((1, T, H), x.dtype), kernels._out((1, T, H), x.dtype)
    a3, b3 = kernels._np(a), kernels._np(b)
    a2, b2 = a3.reshape(T, H), b3.reshape(T, H)
    cur3 = kernels._np(kernels._act(x.contiguous()))
    cur2 = cur3.reshape(T, H)
    empty, obs = kernels._EMPTY_U8_NP, kernels._NOT_OBSERVED
    for (first, moe_args), e in zip(calls, experts):
        if first[0] is _ATTN:
            _, weights, heads_scale, gated, half, kv_slot = first
            nat.attn_block_decode(cur2, *weights, *rope, *kv_slot, p, *heads_scale, a2, gated, *half)
        else:
            _, state, head, conv, S, tail = first
            if T == 1:
                nat.deltanet_block(cur3, *head, conv, None, *tail[:2], S, None, *tail[2:4], a3, tail[4])
            else:  # a verification pass: every token's states kept, for a rollback
                conv_all = state.scratch("conv", (1, T, *state.tensors["conv"].shape[1:]))
                S_all = state.scratch("recurrent", (1, T, *state.tensors["recurrent"].shape[1:]))
                nat.deltanet_block(cur3, *head, conv, kernels._np(conv_all), *tail[:2], S, kernels._np(S_all),
                                   *tail[2:4], a3, tail[4])
                state.keep_every(conv=conv_all, recurrent=S_all)
        seen = routes_seen(e)
        nat.moe_block(a2, *moe_args, b2, *obs, empty if seen is None else seen)
        cur2, cur3 = b2, b3
    return b


_ATTN, _DELTA = "attention", "deltanet"


def _build(layers, x: torch.Tensor, cache, s: int, plans: dict) -> tuple | None:
    """Per layer its first half's and its MoE half's call arguments, from the run's plans, and
    the layers' experts modules; None unless every layer has both plans and no hooks."""
    calls, experts = [], []
    for i, layer in enumerate(layers):
        mods = layer._modules
        block = mods.get("mlp")
        moe_plan = plans.get((block, (x.shape, x.dtype)))
        if moe_plan is None or kernels.has_hooks(layer):
            return None
        first = _attention(mods.get("self_attn"), x, cache.layers[i], s, plans) if "self_attn" in mods else \
            _deltanet(mods.get("linear_attn"), x, cache.layers[i], s, plans)
        if first is None:
            return None
        e, moe_args = moe_plan
        calls.append((first, moe_args))
        experts.append(e)
    return calls, experts


def _attention(attn, x, kv, s: int, plans: dict) -> tuple | None:
    plan = plans.get((attn, (x.shape, x.dtype, kv)))  # attn_residual's: (attn_plan, half_norm_args)
    if plan is None or not plan[1]:
        return None
    (weights, heads_scale, gated), half = plan
    return _ATTN, weights, heads_scale, gated, half, kernels._cache_slot(kv, s)


def _deltanet(dn, x, state, s: int, plans: dict) -> tuple | None:
    """GatedDeltaNet.residual's native call: its plans (the weights' views, and the fused
    call's projections, out_proj and norm), and its states' slot as views, updated in place."""
    views = plans.get((dn, DELTA_WEIGHTS))
    fused = plans.get((dn, (x.shape, x.dtype)))
    if dn is None or views is None or fused is None or kernels.has_hooks(dn):
        return None
    proj, out_proj, (norm_weight, norm_eps, norm_offset) = fused
    cw, al, dt, nw = views
    conv, S = (state.tensors[name][s : s + 1] for name in ("conv", "recurrent"))
    if not kernels.deltanet_decode_is_native(x, conv, S):
        return None
    head = (kernels._np(norm_weight), norm_offset, norm_eps, [q.w for q in proj], [q.s for q in proj],
            [q.code for q in proj], out_proj.w, out_proj.s, out_proj.code, cw)
    return _DELTA, state, head, kernels._np(conv), kernels._np(S), (al, dt, nw, float(dn.norm.eps), dn.n_k)
