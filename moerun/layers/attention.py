"""Scaled dot-product attention over a preallocated cache, for any batch of slots."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from .norm import RMSNorm


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv,
    slots: torch.Tensor | None,
    pos0: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [B, Hq, T, D] over the cached keys plus k, v [B, Hkv, T, D].

    `kv` is the layer's KV cache (or None for a single uncached pass); row b's tokens sit
    at positions pos0[b] .. pos0[b]+T-1. Returns [B, Hq, T, Dv].
    """
    T = q.shape[2]
    if kv is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=scale, enable_gqa=True)
    B = q.shape[0]
    if B == 1 and T <= FEW_QUERIES:
        # a decode step, or a few tokens of one row (a speculative verification pass): each
        # query as a decode step runs it, over the keys up to its own position, so that a
        # pass gives a decode step's outputs bit for bit (one SDPA over the pass would
        # round differently, and in bf16 that flips greedy picks at near-ties)
        p = int(pos0[0])
        if hasattr(kv, "update_int8") and kernels.isa() != "torch":
            # an int8 cache: the kernel scales keys and values as it reads them
            k8, ks, v8, vs = kv.update_int8(slots, pos0, k, v)
            outs = [kernels.attn_decode(q[0, :, t], k8[0, :, : p + t + 1], v8[0, :, : p + t + 1], scale,
                                        ks[0, :, : p + t + 1], vs[0, :, : p + t + 1]) for t in range(T)]
            return torch.stack(outs, dim=1)[None].to(q.dtype)
        k_all, v_all = kv.update(slots, pos0, k, v)
        outs = [_one_query(q[:, :, t : t + 1], k_all[:, :, : p + t + 1], v_all[:, :, : p + t + 1], scale)
                for t in range(T)]
        return outs[0] if T == 1 else torch.cat(outs, dim=2)
    k_all, v_all = kv.update(slots, pos0, k, v)
    S = k_all.shape[2]
    if B == 1 and S == T:
        return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = pos0[:, None] + torch.arange(T)  # [B, T]
        mask = (torch.arange(S)[None, None, :] <= query_pos[:, :, None])[:, None]  # [B, 1, T, S]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=True)


FEW_QUERIES = 8  # tokens of one row that `attend` runs query by query, as decode steps


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token q [1, Hq, 1, D] over every key k, v [1, Hkv, S, D] (its own included)."""
    if k.shape[2] >= 128 or kernels.attn_decode_is_native(k, v):
        return decode_attention(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token of one row over all S cached keys: q [1, Hq, 1, D], k/v [1, Hkv, S, D].

    Query head h uses kv head h // G, as SDPA's enable_gqa. float32 and bf16 caches run the
    native kernel (`kernels.attn_decode`; float32, 2 threads, 32 query / 4 kv heads of 128,
    600 cached tokens: 0.25 ms against 0.38 for the torch reference and 1.2 for SDPA; 38
    against 51 us for SDPA at 8 tokens, so `attend` takes it at any length). Others (fp16)
    run the reference, each kv head's query group as one [G, D] x [D, S] product in fp32
    (1 thread: 0.31 ms against SDPA's 0.69 ms at 512 cached tokens; below ~100 tokens SDPA's
    fewer calls win, so `attend` uses it from 128 on). Returns [1, Hq, 1, Dv] in q's dtype."""
    Hq = q.shape[1]
    out = kernels.attn_decode(q.reshape(Hq, q.shape[3]), k[0], v[0], scale)
    return out.reshape(1, Hq, 1, v.shape[-1]).to(q.dtype)


def attn_residual(x, norm, attn, cos_sin, kv, slots, pos0, plans=None) -> torch.Tensor:
    """x + attn(norm(x), cos_sin, kv, slots, pos0): a decoder layer's first half. Where the
    attention's decode passes are fused (`kernels.fuse_decode_attention`) and this pass is
    one of them (`kernels.fused_attention_applies`), the norm and the residual add join the
    same native call: bit-identical to the modules one by one, which run otherwise (and
    whenever the norm or the attention has hooks). `plans`: a run's (`kernels.run_plan`)."""
    plan = kernels.run_plan(plans, attn, (x.shape, x.dtype, kv), lambda: _half_plan(x, norm, attn, kv))
    if plan is not None:
        return attn.forward(x, cos_sin, kv, slots, pos0, norm=norm, plan=plan)
    return x + attn(norm(x), cos_sin, kv, slots, pos0)


def _half_plan(x, norm, attn, kv) -> tuple | None:
    """The fused call's `kernels.fused_call_plan` where the half fuses, else None."""
    return kernels.fused_call_plan(attn, norm) if attn_half_fuses(x, norm, attn, kv) else None


def attn_half_fuses(x, norm, attn, kv) -> bool:
    """Whether x + attn(norm(x)) runs as one native call (`attn_residual`): a fused attention
    that takes this pass, an RMSNorm of x's dtype, no hooks on either."""
    return (type(norm) is RMSNorm and norm.weight.dtype == x.dtype and "_unfused_forward" in attn.__dict__
            and kernels.fused_attention_applies(x, kv) and not kernels.has_hooks(attn, norm))
