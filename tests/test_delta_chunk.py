"""The native chunked gated delta rule (csrc/delta_chunk.cpp) against its torch references:
`layers.deltanet.chunk_gated_delta_rule` (the chunked form in torch) and the token-by-token
recurrence (`kernels.reference.recurrent_gated_delta_steps`), on every ISA path the build has,
float32 and bf16 inputs, lengths on and off the chunk of 64, with and without a state; and
`deltanet_decode`'s long passes, which run it between the conv and the gated norm."""

from __future__ import annotations

import pytest
import torch

from moerun import kernels
from moerun.kernels import reference
from moerun.layers import deltanet

NATIVE = [i for i in kernels.available_isas() if i != "torch"]
# float32 sums in another order than torch's (and, against the recurrence, another algorithm)
TOL = 2e-5

SHAPES = [  # B, T, Hk, Hv, Dk, Dv
    (1, 1, 1, 1, 16, 16), (2, 63, 2, 4, 8, 12), (1, 64, 1, 2, 32, 32), (2, 65, 2, 2, 16, 40),
    (1, 150, 2, 4, 32, 48), (1, 130, 2, 4, 128, 128)]


def max_rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def inputs(B, T, Hk, Hv, Dk, Dv, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(B, T, Hk, Dk).to(dtype), r(B, T, Hk, Dk).to(dtype), r(B, T, Hv, Dv).to(dtype)
    # log decays from nearly none to strong (a whole chunk's sum down to about -60)
    logd = -torch.rand(B, T, Hv, generator=g) * torch.tensor([0.02, 0.3, 1.0, 2.0]).repeat(Hv)[:Hv]
    beta = torch.rand(B, T, Hv, generator=g)
    return q, k, v, logd.to(dtype), beta.to(dtype), 0.1 * r(B, Hv, Dk, Dv)


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_matches_torch(isa, shape, with_state):
    """Outputs and the final state against the torch chunked form and the recurrence; the given
    state is left as it was (a new one comes back)."""
    q, k, v, g, beta, S0 = inputs(*shape, seed=sum(shape))
    state = S0.clone() if with_state else None
    want_o, want_S = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, None if state is None else S0.clone())
    rec_o, rec_S = reference.recurrent_gated_delta_steps(q, k, v, g, beta, S0 if with_state else torch.zeros_like(S0))
    with kernels.use_isa(isa):
        o, S = kernels.delta_rule_chunked(q, k, v, g, beta, state)
    assert o.shape == want_o.shape and o.dtype == torch.float32 and S.dtype == torch.float32
    assert max_rel(o, want_o) < TOL and max_rel(S, want_S) < TOL
    assert max_rel(o, rec_o) < TOL and max_rel(S, rec_S[:, -1]) < TOL
    if with_state:
        assert torch.equal(state, S0) and S is not state


@pytest.mark.parametrize("isa", NATIVE)
def test_chunked_rule_bf16_inputs(isa):
    """bf16 q, k, v, g, beta (a bf16 model's): widened exactly, float32 sums, o rounded to bf16
    once: the float32 call's results on the widened values."""
    q, k, v, g, beta, S0 = inputs(2, 100, 2, 4, 32, 32, seed=7, dtype=torch.bfloat16)
    wide = [t.float() for t in (q, k, v, g, beta)]
    want_o, want_S = deltanet.chunk_gated_delta_rule(*wide, S0.clone())
    with kernels.use_isa(isa):
        o, S = kernels.delta_rule_chunked(q, k, v, g, beta, S0)
        o32, S32 = kernels.delta_rule_chunked(*wide, S0)
    assert o.dtype == torch.bfloat16 and torch.equal(o, o32.bfloat16()) and torch.equal(S, S32)
    assert max_rel(o32, want_o) < TOL and max_rel(S, want_S) < TOL
    assert max_rel(o, want_o) < 1e-2  # (bf16 rounding of o)


@pytest.mark.parametrize("isa", NATIVE)
def test_chunked_rule_carries_state_across_calls(isa):
    """A sequence cut in two calls (at no chunk boundary) gives the whole call's outputs and state."""
    q, k, v, g, beta, S0 = inputs(1, 170, 2, 4, 16, 16, seed=11)
    with kernels.use_isa(isa):
        o, S = kernels.delta_rule_chunked(q, k, v, g, beta, S0)
        o1, S1 = kernels.delta_rule_chunked(q[:, :77], k[:, :77], v[:, :77], g[:, :77], beta[:, :77], S0)
        o2, S2 = kernels.delta_rule_chunked(q[:, 77:], k[:, 77:], v[:, 77:], g[:, 77:], beta[:, 77:], S1)
    assert max_rel(torch.cat([o1, o2], dim=1), o) < TOL and max_rel(S2, S) < TOL


def test_gated_delta_rule_dispatch():
    """The module path's `gated_delta_rule`: the native op where the kernels run, the torch
    chunked form where they are forced off (the same arguments and results)."""
    q, k, v, g, beta, S0 = inputs(1, 70, 1, 2, 16, 16, seed=2)
    want = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, S0)
    with kernels.use_isa("torch"):
        got_torch = deltanet.gated_delta_rule(q, k, v, g, beta, S0)
    assert all(torch.equal(a, b) for a, b in zip(got_torch, want))
    got = deltanet.gated_delta_rule(q, k, v, g, beta, S0)
    assert all(max_rel(a, b) < TOL for a, b in zip(got, want))


def test_chunked_rule_bad_shapes():
    """Mismatched shapes get one clear error from the binding, before anything runs."""
    nat = kernels._native()
    q, k, v, g, beta, S0 = inputs(1, 10, 3, 4, 8, 8)  # 4 value heads on 3 key heads
    out = torch.empty(1, 10, 4, 8)
    with pytest.raises(Exception, match="multiple of the key heads"):
        nat.delta_rule_chunked(*(kernels._np(t) for t in (q, k, v, g, beta, S0, out)))
    q, k, v, g, beta, S0 = inputs(1, 10, 2, 4, 8, 8)
    with pytest.raises(Exception, match="S"):
        nat.delta_rule_chunked(*(kernels._np(t) for t in (q, k, v, g, beta)), kernels._np(S0[:, :3].contiguous()),
                               kernels._np(out))


def _layer_inputs(B, T, Hk, Hv, Dk, Dv, K, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * Dk + Hv * Dv
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    inp = dict(qkv=r(B, T, C), conv_w=0.5 * r(C, 1, K), conv=r(B, C, K - 1), a=r(B, T, Hv), b=r(B, T, Hv),
               A_log=0.5 * r(Hv), dt_bias=r(Hv), S=0.1 * r(B, Hv, Dk, Dv), z=r(B, T, Hv, Dv), norm_w=r(Dv))
    return {k: (v.to(dtype) if k in ("qkv", "a", "b", "z") else v) for k, v in inp.items()}


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("shape", [(1, 16, 2, 8, 128, 128, 4), (2, 70, 2, 4, 64, 72, 4), (1, 140, 2, 4, 128, 128, 4),
                                   (2, 100, 2, 4, 8, 12, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deltanet_decode_long_pass_is_chunked(isa, shape, dtype):
    """deltanet_decode over a prompt (16 tokens or more, no per-token states kept, tokens times
    a row's state elements over 2^20; the last shape is under it and stays token by token):
    conv, q/k norms on the pool and the chunked rule, against the torch reference of the
    whole layer between its projections (token by token): outputs and both states, updated
    in place."""
    inp = _layer_inputs(*shape, seed=sum(shape), dtype=dtype)
    Hk = shape[2]
    want = reference.few_tokens_ref(**{k: v.float().clone() for k, v in inp.items()}, eps=1e-6, key_heads=Hk)
    conv, S = inp["conv"].clone(), inp["S"].clone()
    with kernels.use_isa(isa):
        got = kernels.deltanet_decode(**{**inp, "conv": conv, "S": S}, eps=1e-6, key_heads=Hk)
    assert got[1] is conv and got[2] is S
    assert torch.equal(conv, want[1])  # the conv state: the last inputs, copied
    for a, b in zip(got, want):
        assert a.shape == b.shape and max_rel(a, b) < TOL


@pytest.mark.parametrize("isa", NATIVE)
def test_vectorized_silu_against_torch(isa):
    """silu_rows (the DeltaNet conv's, its gated norm's and the MLPs' SiLU: a polynomial exp,
    one copy per ISA) against torch's silu (in float64): within 1e-6 relative for x > -16,
    2e-5 relative further out down to values of 1e-30, within 1e-30 absolute below; NaN stays
    NaN, +inf gives +inf; and the same value at every length (a last partial vector included)
    and wherever an input sits in the row."""
    nat = kernels._native()
    x = torch.cat([torch.linspace(-100, 100, 20001), torch.randn(4099) * 8,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5, 88.5, -88.5, 150.0, -150.0])])
    want = torch.nn.functional.silu(x.double())
    with kernels.use_isa(isa):
        got = x.clone()
        nat.silu_inplace(kernels._np(got))
        for n in (1, 5, 17, 33):  # lengths off the vector width: the same values
            part = x[:n].clone()
            nat.silu_inplace(kernels._np(part))
            assert torch.equal(part, got[:n])
        shifted = x[3:].clone()
        nat.silu_inplace(kernels._np(shifted))
        assert torch.equal(shifted, got[3:])
    rel = (got.double() - want).abs() / want.abs()
    near = x > -16  # where silu is above 2e-6 in magnitude: what the layers meet
    assert float(rel[near & (want != 0)].max()) < 1e-6
    # further out x * log2(e) is rounded in float32 (e.g. x = -60: ~3e-6 of its exponent)
    big = ~near & (want.abs() >= 1e-30)
    assert float(rel[big].max()) < 2e-5
    assert float((got.double() - want)[want.abs() < 1e-30].abs().max()) < 1e-30
    nan = torch.tensor([float("nan"), float("inf"), -float("inf")] * 6)
    with kernels.use_isa(isa):
        nat.silu_inplace(kernels._np(nan))
    assert torch.isnan(nan[0::3]).all() and torch.equal(nan[1::3], torch.full((6,), float("inf")))
