"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) as plain tensor functions.

The recurrent state of one value head is a [Dk, Dv] matrix S. For each token:
    S <- exp(g) * S                      (gated decay, g <= 0)
    S <- S + k^T (beta * (v - k S))      (delta rule: write only what S does not predict)
    o  = q S
with q and k L2-normalised and q scaled by Dk^-0.5. Prefill runs the chunked (WY / UT
transform) form, one matmul pass per chunk of 64 tokens; decode runs the one-token update
as batched matmuls over every batch row and head at once; a pass of a few tokens (a
speculative verification) runs that update token by token and keeps every token's state.
All compute in fp32 and match transformers' `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule`.

Natively (docs/design/deltanet-prefill.md): a pass with a cache runs
between its projections as one call (`kernels.deltanet_decode`), whose delta rule is the
chunked form for a pass of 16 tokens or more that keeps no per-token states (and of a
large enough state: csrc/ops.h `delta_chunked`), token by token otherwise; a pass without a cache runs `gated_delta_rule`, the chunked form as one native
call (`kernels.delta_rule_chunked`) with `chunk_gated_delta_rule` here as its reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels.reference import _prepare

# B batch, T tokens, C conv channels, K conv kernel, Hk key heads, Hv value heads,
# Dk key head dim, Dv value head dim, L chunk length, N chunks

CHUNK = 64
SEGMENT = 64 * CHUNK  # tokens per pass of the chunked form (a multiple of CHUNK); natively, per call
# Whether a pass with a cache (prefill, a verification pass, decode) runs natively between its
# projections (`kernels.deltanet_decode`, the chunked form inside for long passes) where the
# extension is loaded; off, a prefill runs the modules with `gated_delta_rule` (tests use it)
NATIVE_PASSES = True


def native_pass() -> bool:
    """Whether a pass with a cache runs as the native call between the projections
    (`kernels.deltanet_decode`) rather than the modules."""
    return NATIVE_PASSES and kernels.native()


def gated_delta_rule(q, k, v, g, beta, state=None):
    """The chunked gated delta rule over whole sequences: one native call
    (`kernels.delta_rule_chunked`) where the extension is loaded and autograd is off,
    `chunk_gated_delta_rule` otherwise. Same arguments and results."""
    if kernels.native() and not torch.is_grad_enabled():
        return kernels.delta_rule_chunked(q, k, v, g, beta, state)
    return chunk_gated_delta_rule(q, k, v, g, beta, state)


# the weights of a Gated DeltaNet module that its native step reads (`kernels.deltanet_decode`),
# by their names on the module: the key of their views in a run's plans
DELTA_WEIGHTS = ("conv1d.weight", "A_log", "dt_bias", "norm.weight")


def chunk_gated_delta_rule(q, k, v, g, beta, state=None, chunk_size: int = CHUNK):
    """Whole-sequence gated delta rule.

    q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g (log decay) and beta [B, T, Hv],
    state [B, Hv, Dk, Dv] or None. Returns (o [B, T, Hv, Dv] in q's dtype, final state fp32).
    """
    dtype = q.dtype
    B, T = q.shape[:2]
    if T > SEGMENT:  # bound the [B, Hv, T, ...] fp32 temporaries of long prompts
        outs = []
        for t in range(0, T, SEGMENT):
            part = slice(t, t + SEGMENT)
            o, state = chunk_gated_delta_rule(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state, chunk_size)
            outs.append(o)
        return torch.cat(outs, dim=1), state
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    Hv, Dk, Dv = v.shape[1], k.shape[-1], v.shape[-1]
    L = min(chunk_size, T)  # a short input (a speculative verification pass) is one unpadded chunk
    pad = (L - T % L) % L
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    N = (T + pad) // L
    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(B, Hv, N, L, -1) for t in (q, k, k_beta, v_beta))
    g = g.reshape(B, Hv, N, L).cumsum(-1)  # log decay from the chunk start to each position
    upper = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, Hv, N, L, L]
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    # (I + strictly_lower(ut))^-1 applied to the betas' values and decayed keys: the UT transform
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)  # [B, Hv, N, L, Dv]
    w = torch.linalg.solve_triangular(ut, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    S = q.new_zeros(B, Hv, Dk, Dv) if state is None else state.to(torch.float32)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]  # [B, Hv, N, 1, 1]
    out = torch.empty_like(u)
    for n in range(N):  # sequential over chunks only
        v_new = u[:, :, n] - w[:, :, n] @ S  # [B, Hv, L, Dv]
        out[:, :, n] = q[:, :, n] @ S + intra[:, :, n] @ v_new
        S = S * chunk_decay[:, :, n] + k[:, :, n].transpose(-1, -2) @ v_new
    out = out.reshape(B, Hv, N * L, Dv)[:, :, :T]
    return out.transpose(1, 2).to(dtype), S


