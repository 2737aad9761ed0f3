"""The pure-torch references of the native ops whose maths a model's layers share: the routed
experts (`moe_experts`, `moe_experts_float`), rope (`norm_rope_heads`) and a few tokens of
Gated DeltaNet (`deltanet_decode`). They import only torch; the layers (moerun.layers) run
them as their torch path, and the tests hold every native op to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# T tokens, H hidden, E experts, K experts per token; B batch, C conv channels, Hk key
# heads, Hv value heads, Dk key head dim, Dv value head dim


# -- routed experts -------------------------------------------------------------------------

def group_by_expert(ids: torch.Tensor, num_experts: int):
    """Sort the N*K (token, expert) pairs by expert.

    Returns (order [N*K] indices into the flattened pairs, counts list[E]).
    """
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, counts: list[int],
             run_expert) -> torch.Tensor:
    """sum_k w[n,k] * run_expert(e, x[rows of e]) with e = ids[n,k], tokens grouped per expert.

    `order, counts` come from `group_by_expert`; `run_expert(e, xs [c, H]) -> [c, H]`. Every
    kind of Experts module (plain, store-backed) goes through here, so they agree bit for bit.
    """
    K = ids.shape[1]
    token_of = order // K
    w_sorted = weights.reshape(-1)[order].to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = token_of[start : start + c]
        # rows are distinct within one expert's group; index_put_ avoids index_add_'s
        # OpenMP region, which stalls for milliseconds on a busy machine
        out.index_put_((rows,), run_expert(e, x[rows]) * w_sorted[start : start + c, None], accumulate=True)
        start += c
    return out


def swiglu(xs: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert: down(silu(gate xs) * up xs), xs [c, H]."""
    return (F.silu(xs @ gate.T) * (xs @ up.T)) @ down.T


def expert_mlp(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Reference SwiGLU experts: sum_k w[n,k] * down_e(silu(gate_e x) * up_e x), e = ids[n,k]."""
    order, counts = group_by_expert(ids, gate.shape[0])
    return dispatch(x, ids, weights, order, counts, lambda e, xs: swiglu(xs, gate[e], up[e], down[e]))


# -- rope ------------------------------------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [B, heads, T, D]; the rest pass through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1] and not interleaved:  # the whole head rotates (fewer ops: decode runs this per layer)
        return torch.addcmul(x * cos, rotate_half(x), sin)
    rot, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        # [x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...] then the usual half rotation
        b, h, t, _ = rot.shape
        rot = rot.view(b, h, t, rd // 2, 2).transpose(-1, -2).reshape(b, h, t, rd)
    rot = rot * cos + rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


# -- Gated DeltaNet, a few tokens ------------------------------------------------------------

FEW = 8  # up to this many tokens (a speculative verification pass) run token by token


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
