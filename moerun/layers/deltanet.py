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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# B batch, T tokens, C conv channels, K conv kernel, Hk key heads, Hv value heads,
# Dk key head dim, Dv value head dim, L chunk length, N chunks

CHUNK = 64
SEGMENT = 64 * CHUNK  # tokens per pass of the chunked form (a multiple of CHUNK)
FEW = 8  # up to this many tokens (a speculative verification pass) run token by token
# ... and a prompt of more, where its tokens times one row's state elements (heads x Dk x Dv)
# stay within this: a small model's chunked form is dozens of tiny torch ops per layer (~2 ms
# a layer for 12 tokens of the demo model, whose 4 x 32 x 32 state takes ~1 us a token in the
# native recurrence); a Qwen3.6-sized state (32 x 128 x 128) keeps the chunked form above FEW
RECURRENT_PREFILL_ELEMENTS = 1 << 20


def token_by_token(T: int, heads: int, dk: int, dv: int) -> bool:
    """Whether a pass of T tokens runs the recurrence token by token (the native decode step)
    rather than the chunked form: a few tokens, or a small state (RECURRENT_PREFILL_ELEMENTS)."""
    return T <= FEW or T * heads * dk * dv <= RECURRENT_PREFILL_ELEMENTS
# the weights of a Gated DeltaNet module that its native step reads (`kernels.deltanet_decode`),
# by their names on the module: the key of their views in a run's plans
DELTA_WEIGHTS = ("conv1d.weight", "A_log", "dt_bias", "norm.weight")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None, every_state: bool = False):
    """Depthwise causal conv + SiLU over time.

    x [B, T, C], weight [C, 1, K], state [B, C, K-1] (the previous K-1 inputs; zeros or
    None at the start of a sequence). Returns (y [B, T, C], new state [B, C, K-1]), or with
    `every_state` the state after each token, [B, T, C, K-1] (views of one buffer).
    """
    B, T, C = x.shape
    K = weight.shape[-1]
    xt = x.transpose(1, 2).to(weight.dtype)  # [B, C, T]
    if state is None:
        state = xt.new_zeros(B, C, K - 1)
    xs = torch.cat([state.to(xt.dtype), xt], dim=-1)  # [B, C, K-1+T]
    if T <= FEW:  # one token, or a few (speculative verification): windows beat conv1d's setup cost
        y = (xs.unfold(-1, K, 1) * weight[:, None, 0]).sum(-1)  # [B, C, T, K] -> [B, C, T]
    elif xs.dtype == torch.bfloat16 and not torch.is_grad_enabled():
        # torch's bf16 depthwise conv runs channel by channel (~4 ms for the demo's 256
        # channels, against ~0.3 in float32): float32 sums rounded to bf16, as the bf16 conv gives
        y = F.conv1d(xs.float(), weight.float(), groups=C).to(xs.dtype)
    else:
        y = F.conv1d(xs, weight, groups=C)  # [B, C, T]
    y = F.silu(y).transpose(1, 2).to(x.dtype)
    if every_state:
        return y, xs.unfold(-1, K - 1, 1)[:, :, 1:].transpose(1, 2)
    return y, xs[..., xs.shape[-1] - (K - 1) :]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """To fp32 [B, Hv, T, D], q/k L2-normalised, q scaled, key heads shared by value heads."""
    Hk, Hv = k.shape[2], v.shape[2]
    if Hk != Hv:  # each q/k head serves Hv // Hk consecutive value heads
        q = q.repeat_interleave(Hv // Hk, dim=2)
        k = k.repeat_interleave(Hv // Hk, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    q = l2norm(q)
    k = l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g, beta


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


def _delta_update(S, q2, k2, v2, decay, beta2, out):
    """One token for every (row, head) at once: S [BH, Dk, Dv] -> out (may be S itself);
    q2, k2 [BH, 1, Dk], v2 [BH, 1, Dv], decay and beta2 [BH, 1, 1]. Returns q S_new [BH, 1, Dv]."""
    # k S and q S of the decayed state, read from S in one batched matmul
    kqS = torch.bmm(torch.cat([k2, q2], dim=1), S) * decay  # [BH, 2, Dv]
    delta = (v2 - kqS[:, :1]) * beta2  # [BH, 1, Dv]
    torch.mul(S, decay, out=out).baddbmm_(k2.transpose(1, 2), delta)  # decayed S + k^T delta
    return kqS[:, 1:] + (q2 * k2).sum(-1, keepdim=True) * delta


def recurrent_gated_delta_step(q, k, v, g, beta, state):
    """One token of the gated delta rule for every batch row and head at once.

    q, k [B, 1, Hk, Dk], v [B, 1, Hv, Dv], g and beta [B, 1, Hv], state [B, Hv, Dk, Dv].
    Returns (o [B, 1, Hv, Dv] in q's dtype, new state fp32 [B, Hv, Dk, Dv]). A contiguous
    fp32 `state` is updated in place (three passes over it: read, decay, rank-1 update).
    """
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, 1, D]
    B, Hv, _, Dk = k.shape
    Dv = v.shape[-1]
    if state.dtype != torch.float32 or not state.is_contiguous():
        state = state.float().contiguous()
    S = state.view(B * Hv, Dk, Dv)
    o = _delta_update(S, q.reshape(B * Hv, 1, Dk), k.reshape(B * Hv, 1, Dk), v.reshape(B * Hv, 1, Dv),
                      g.exp().reshape(B * Hv, 1, 1), beta.reshape(B * Hv, 1, 1), out=S)
    return o.reshape(B, Hv, 1, Dv).transpose(1, 2).to(dtype), state


def recurrent_gated_delta_steps(q, k, v, g, beta, state):
    """A few tokens one after the other (a speculative verification pass), keeping the state
    after every token so that a rejected draft can be rolled back without recomputing.

    Shapes as `chunk_gated_delta_rule` (state required). Returns (o [B, T, Hv, Dv] in q's
    dtype, states fp32 [B, T, Hv, Dk, Dv]: states[:, t] is the state after token t).
    """
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, T, D]
    B, Hv, T, Dk = k.shape
    Dv = v.shape[-1]
    BH = B * Hv
    q, k, v = (t.reshape(BH, T, 1, -1).unbind(1) for t in (q, k, v))
    decay, beta = g.exp().reshape(BH, T, 1, 1).unbind(1), beta.reshape(BH, T, 1, 1).unbind(1)
    states = torch.empty(T, BH, Dk, Dv)
    S = state.float().reshape(BH, Dk, Dv)
    o = []
    for t in range(T):
        o.append(_delta_update(S, q[t], k[t], v[t], decay[t], beta[t], out=states[t]))
        S = states[t]
    o = torch.cat(o, dim=1).view(B, Hv, T, Dv).transpose(1, 2).to(dtype)
    return o, states.view(T, B, Hv, Dk, Dv).transpose(0, 1)


def split_heads(y, a, b, A_log, dt_bias, key_heads: int, Dk: int, Hv: int, Dv: int):
    """The conv outputs y [B, T, C] as q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv], with each value
    head's gates from in_proj_a/b's outputs a, b [B, T, Hv]: beta = sigmoid(b) and the log decay
    g = -exp(A_log) * softplus(a + dt_bias)."""
    B, T, _ = y.shape
    kd = key_heads * Dk
    q = y[..., :kd].reshape(B, T, key_heads, Dk)
    k = y[..., kd : 2 * kd].reshape(B, T, key_heads, Dk)
    v = y[..., 2 * kd :].reshape(B, T, Hv, Dv)
    return q, k, v, b.sigmoid(), -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def few_tokens_ref(qkv, conv_w, conv, a, b, A_log, dt_bias, S, z, norm_w, eps: float, key_heads: int,
                   every: bool = False):
    """A few tokens of a Gated DeltaNet layer between its projections, in torch: the reference
    of (and fallback for) `moerun.kernels.deltanet_decode`, same arguments and results (the
    conv state comes back as a new tensor; S is updated in place where it is contiguous fp32,
    as `recurrent_gated_delta_step` does)."""
    T = qkv.shape[1]
    Hv, Dk, Dv = S.shape[1:]
    y, conv = causal_conv1d(qkv, conv_w, conv, every_state=every)
    q, k, v, beta, g = split_heads(y, a, b, A_log, dt_bias, key_heads, Dk, Hv, Dv)
    if every or T > 1:
        o, states = recurrent_gated_delta_steps(q, k, v, g, beta, S)  # [B, T, Hv, Dk, Dv]
        S = states if every else states[:, -1]
    else:
        o, S = recurrent_gated_delta_step(q, k, v, g, beta, S)
    return gated_rms_norm(o, z, norm_w, eps), conv, S


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * w * silu(gate) over the last dim (the DeltaNet output norm; w is not zero-centred)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)
