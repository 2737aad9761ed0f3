"""Scaled dot-product attention over a preallocated cache, for any batch of slots."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    k_all, v_all = kv.update(slots, pos0, k, v)
    S = k_all.shape[2]
    B = q.shape[0]
    if B == 1 and T == 1:
        mask = None  # the single new token sees every cached key of its own row
    elif B == 1 and S == T:
        return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = pos0[:, None] + torch.arange(T)  # [B, T]
        mask = (torch.arange(S)[None, None, :] <= query_pos[:, :, None])[:, None]  # [B, 1, T, S]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=True)
