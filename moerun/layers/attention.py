"""Scaled dot-product attention over a preallocated cache, for any batch of slots; and a
decoder layer's attention half as the fused native block's one call (`attn_residual`,
`attention_fuses`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .cache import KVCache
from .linear import plain_float_linear
from .norm import RMSNorm
from .quantized import QuantizedLinear


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


def attn_residual(x, norm, attn, cos_sin, kv, slots, pos0) -> torch.Tensor:
    """x + attn(norm(x), cos_sin, kv, slots, pos0): a decoder layer's first half. Where the
    half runs as one native call (`attn_half_plan`), the norm, the attention and the residual
    add are that call (`fused_attention`): bit-identical to the modules one by one, which run
    otherwise (and whenever the norm or the attention has hooks)."""
    plan = attn_half_plan(x, norm, attn, kv)
    if plan is not None:
        return fused_attention(attn, x, cos_sin, kv, slots, pos0, plan)
    return x + attn(norm(x), cos_sin, kv, slots, pos0)


def attn_half_plan(x, norm, attn, kv) -> tuple | None:
    """What the fused call takes for x + attn(norm(x)) (`kernels.fused_call_plan`: the
    attention's `attn_plan` and the norm's `half_norm_args`) where the half runs as one native
    call: an attention the block takes (`attention_fuses`) and this pass one it serves
    (`fused_attention_applies`), an RMSNorm of x's dtype, no hooks on either; None otherwise.
    The decode program (`layers.stack`) builds its attention halves from it once a run."""
    if not (type(norm) is RMSNorm and norm.weight.dtype == x.dtype and fused_attention_applies(x, kv)
            and attention_fuses(attn) and not kernels.has_hooks(attn, norm)):
        return None
    return kernels.fused_call_plan(attn, norm)


class FusedAttention(nn.Module):
    """An attention module whose few-token pass the fused native block computes
    (`attention_fuses`): it holds q_proj, k_proj, v_proj, o_proj, optionally q_norm and
    k_norm, and n_heads, head_dim, scale (and n_kv for norms across heads). `output_gate`: q_proj
    gives each head's query then its sigmoid output gate (Qwen3.5); `window`: a sliding window
    or None. `fusable()` says whether this instance's settings are all the block's. Its own
    `forward` is the torch reference the fused block is tested against."""

    output_gate = False
    window = None

    def fusable(self) -> bool:
        return True


def attention_fuses(m: nn.Module) -> bool:
    """Whether the fused native block (`attn_block_decode`: q/k/v projections on one pool
    job, per-head q/k norms, rope, the cache writes, each token's attention, the output gate
    where the module says `output_gate = True`, o projection) computes this attention's
    few-token passes (a decode step, a speculative verification pass of up to
    kernels.FUSED_MAX_TOKENS a row; one row or a batch), in place of ~40 small torch ops and
    five native calls: a `FusedAttention` whose settings it takes (`fusable()`), q/k/v/o all
    QuantizedLinear or all float linears (float32 or bf16 weights read as they are,
    `plain_float_linear` but for q/k/v's biases), o_proj without bias, and q_norm/k_norm (if
    any) per-head RMSNorms ([head_dim]) or RMSNorms across all heads (OLMoE: [heads *
    head_dim] and [kv heads * head_dim]). Between the projections it computes in float32 (a
    bf16 model's own forward rounds q and k to bf16 on the way). The variants the block takes,
    each from the module: q/k/v biases (Qwen2-MoE), norms across heads (OLMoE) and a sliding
    window (`window`: Mixtral, Qwen2-MoE's windowed layers). The decode program's attention
    half is this block: 4 Qwen3-30B-A3B-shaped int4 layers, 2 threads on the Zen 4 EPYC
    (family 25 model 17), decode 54.5 tok/s with it against 46.6 without (median of 3
    interleaved rounds, 2026-12-03, docs/benchmarks.md). The module itself is untouched: its
    forward stays the torch reference, which prefill and int8 caches run."""
    if kernels._native() is None or not isinstance(m, FusedAttention) or not m.fusable():
        return False
    projs = [getattr(m, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not (all(isinstance(p, QuantizedLinear) for p in projs) and projs[3].bias is None
            or plain_float_linear(projs[3]) and all(plain_float_linear(p) or _biased_float_linear(p)
                                                    for p in projs[:3])):
        return False
    norms = [getattr(m, name, None) for name in ("q_norm", "k_norm")]
    per_head = all(nm is None or nm.weight.numel() == m.head_dim for nm in norms)
    across = all(nm is not None for nm in norms) and norms[0].weight.numel() == m.n_heads * m.head_dim \
        and norms[1].weight.numel() == getattr(m, "n_kv", -1) * m.head_dim
    return per_head or across


def _biased_float_linear(lin: torch.nn.Module) -> bool:
    """A float32 or bf16 `nn.Linear` with a bias [out] and no hooks, its weight contiguous in
    CPU memory: a fused attention's q/k/v projection whose bias the native block adds."""
    if type(lin) is not torch.nn.Linear:
        return False
    w, b = lin._parameters.get("weight"), lin._parameters.get("bias")
    return (w is not None and b is not None and w.dtype in kernels.FLOAT_DTYPES and b.dtype in kernels.FLOAT_DTYPES and w.is_cpu
            and b.is_cpu and w.is_contiguous() and b.shape == (w.shape[0],) and not kernels.has_hooks(lin))


def fused_attention_applies(x: torch.Tensor, kv) -> bool:
    """Whether the fused attention block takes this pass natively: rows of at most
    FUSED_MAX_TOKENS tokens (a decode step or a verification pass; a batch's rows each
    computed as they would be alone: `attn_block_rows`), a float32 or bf16 KV cache, no autograd."""
    B, T, _ = x.shape
    return (T <= kernels.FUSED_MAX_TOKENS and (B == 1 or B * T <= kernels.FUSED_MAX_ROWS) and type(kv) is KVCache
            and kv.k.dtype in kernels.FLOAT_DTYPES and kv.k.is_contiguous() and kernels._native() is not None
            and not torch.is_grad_enabled())


def fused_attention(attn, x, cos_sin, kv, slots, pos0, plan) -> torch.Tensor:
    """The fused block's call for x through `attn` (`plan`: `kernels.fused_call_plan`; with
    the norm's arguments, x + this attention of norm(x))."""
    B, T, H = x.shape
    if B > 1:  # a batch: row b's tokens at its own slot and positions pos0[b], pos0[b] + 1, ...
        if T > 1:
            slots, pos0 = slots.repeat_interleave(T), (pos0[:, None] + torch.arange(T)).reshape(B * T)
        return kernels.attn_block_rows_run(x.reshape(B * T, H), plan[0], kernels._rope_rows(cos_sin, B * T), kv, slots, pos0,
                                   plan[1]).view(B, T, H).to(x.dtype)
    s, p = int(slots[0]), int(pos0[0])  # the binding refuses a position outside the cache
    return kernels.attn_block_run(x.reshape(T, H), plan[0], kernels._rope_rows(cos_sin, T), kernels._cache_slot(kv, s), p,
                          plan[1]).view(1, T, H).to(x.dtype)
