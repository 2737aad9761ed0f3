"""DeepSeek-V3's attention half (MLA) as one native call (`mla_block`, csrc/mla.cpp) against the
module's own torch forward (decode: `Attention._absorbed`; a few tokens of a row: `_expanded`
over the cache): every ISA path the build has, float32 and bf16, decode steps at several
positions, a verification pass of several tokens and a batch of rows at different slots and
positions, with and without q_lora_rank, under YaRN (its scale in the softmax and the tables),
with and without the projections' biases, and quantized projections. The cache rows the call
writes are compared too. Bad arguments get one clear error."""

from __future__ import annotations

import pytest
import torch

from moerun import kernels
from moerun.layers.cache import KVCache, KVSpec
from moerun.layers.norm import RMSNorm
from moerun.layers.rope import Rope
from moerun.models import deepseek_v3 as ds

pytestmark = pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
NATIVE = [i for i in kernels.available_isas() if i != "torch"]
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
            beta_fast=32, beta_slow=1, rope_theta=10000.0)
H, P, L = 64, 7, 24  # hidden, the prompt's tokens, the cache's positions


def make(q_lora_rank, bias: bool, dtype: torch.dtype, interleave: bool = True):
    a = ds.ModelArgs.from_dict(dict(
        model_type="deepseek_v3", vocab_size=97, hidden_size=H, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, attention_bias=bias, rope_interleave=interleave, max_position_embeddings=256,
        rope_parameters=YARN))
    g = torch.Generator().manual_seed(5)
    attn, norm = ds.Attention(a), RMSNorm(H, 1e-6)
    with torch.no_grad():
        for name, p in [*attn.named_parameters(), *norm.named_parameters()]:
            p.copy_(0.5 + torch.rand(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    assert a.softmax_scale != (16 + 8) ** -0.5  # YaRN's mscale is in the softmax scale
    return a, attn.to(dtype).eval(), norm.to(dtype).eval(), Rope(a.rope, 8, 256)


def prefilled(a, attn, norm, rope, dtype, slots=(1, 2)):
    """A cache of 3 slots with prompts of P and P - 3 tokens in `slots`, written by the torch path."""
    g = torch.Generator().manual_seed(6)
    kv = KVCache(KVSpec(1, a.kv_lora_rank, a.qk_rope_head_dim, joined=True), 3, L, dtype)
    for s, n in zip(slots, (P, P - 3)):
        x = torch.randn(1, n, H, generator=g).to(dtype)
        attn(norm(x), rope.span(torch.tensor([0]), n, dtype), kv, torch.tensor([s]), torch.tensor([0]))
    return kv


def both(a, attn, norm, rope, dtype, x, slots, pos0):
    """(the module's x + attn(norm(x)), the native call's) on copies of one prefilled cache,
    and the two caches after."""
    kv = prefilled(a, attn, norm, rope, dtype)
    kv2 = KVCache(KVSpec(1, a.kv_lora_rank, a.qk_rope_head_dim, joined=True), 3, L, dtype)
    kv2.joined.copy_(kv.joined)
    cos_sin = rope.span(pos0, x.shape[1], dtype)
    want = x + attn(norm(x), cos_sin, kv, slots, pos0)
    assert ds.mla_applies(x, kv2)
    got = ds.mla_residual(x, norm, attn, cos_sin, kv2, slots, pos0)
    return want, got, kv, kv2


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("isa", NATIVE)
# measured ~1e-7 and ~5e-4 relative; the rope's pairs taken the other way round give ~1e-2 in both
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 4e-3)])
@pytest.mark.parametrize("q_lora_rank,bias", [(None, False), (24, False), (24, True)], ids=["q_proj", "q_lora", "bias"])
def test_mla_half_matches_the_module(isa, dtype, tol, q_lora_rank, bias):
    a, attn, norm, rope = make(q_lora_rank, bias, dtype)
    g = torch.Generator().manual_seed(7)
    cases = [  # (x's rows and tokens, slots, first positions)
        *[((1, 1), [1], [p]) for p in (P, P + 5, L - 1)],  # decode steps at several positions
        ((1, 1), [0], [0]),  # the first token of an empty slot
        ((1, 3), [1], [P]),  # a verification pass: each token sees the ones before it
        ((2, 1), [2, 1], [P - 3, P]),  # a batch: rows at other slots and positions
        ((2, 2), [1, 2], [P, P - 3]),
    ]
    with torch.inference_mode(), kernels.use_isa(isa):
        for (B, T), slots, pos in cases:
            x = torch.randn(B, T, H, generator=g).to(dtype)
            slots, pos0 = torch.tensor(slots), torch.tensor(pos)
            want, got, kv, kv2 = both(a, attn, norm, rope, dtype, x, slots, pos0)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert rel(got, want) < tol, (B, T, pos, rel(got, want))
            assert rel(kv2.joined, kv.joined) < tol / 4  # the rows written: the normed latent and the roped key
            for b in range(B):  # nothing past the pass's positions
                s, p = int(slots[b]), int(pos0[b])
                assert not kv2.joined[s, :, p + T :].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_half_with_rotate_half_rope_and_quantized_projections(dtype):
    """rope_interleave False (rotate-half pairs), and int8 / int4 projections (the linear ops'
    dispatch; kv_b_proj stays float, as the quantizer keeps it): the module's forward runs the
    same QuantizedLinear products, so the two agree within float rounding."""
    from moerun.quant import QuantPolicy, quantize_model

    a, attn, norm, rope = make(24, False, dtype, interleave=False)
    for mode in ("int8", "int4"):
        m = ds.Attention(a).to(dtype)
        m.load_state_dict(attn.state_dict())
        quantize_model(torch.nn.ModuleDict({"self_attn": m}), QuantPolicy(attention=mode))
        assert type(m.q_a_proj).__name__ == "QuantizedLinear" and type(m.kv_b_proj) is torch.nn.Linear
        x = torch.randn(1, 1, H, generator=torch.Generator().manual_seed(8)).to(dtype)
        with torch.inference_mode():
            want, got, _, _ = both(a, m, norm, rope, dtype, x, torch.tensor([1]), torch.tensor([P]))
        assert rel(got, want) < (2e-6 if dtype == torch.float32 else 4e-3), mode


def test_mla_block_refuses_bad_arguments():
    a, attn, norm, rope = make(24, False, torch.float32)
    kv = KVCache(KVSpec(1, a.kv_lora_rank, a.qk_rope_head_dim, joined=True), 3, L, torch.float32)
    with torch.inference_mode():
        (weights, (heads, scale, inter)), half = ds._half_plan(torch.zeros(1, 1, H), norm, attn, kv)
    nat = kernels._native()
    cos, sin = (t.numpy() for t in rope.span(torch.tensor([0]), 1, torch.float32))
    cos, sin = cos.reshape(1, -1), sin.reshape(1, -1)

    def call(cache=kv.joined, slots=(0,), pos=(0,), w=weights):
        nat.mla_block(torch.zeros(1, H).numpy(), *w, cos, sin, kernels._np(cache), torch.tensor(slots).numpy(),
                      torch.tensor(pos).numpy(), heads, scale, inter, torch.zeros(1, H).numpy(), *half)

    call()  # (as it is: fine)
    with pytest.raises(ValueError, match="position outside the cache"):
        call(pos=(L,))
    with pytest.raises(ValueError, match="a slot outside the cache"):
        call(slots=(3,))
    with pytest.raises(ValueError, match="joined row"):
        call(cache=kv.k)  # the latent alone, not the joined rows
    with pytest.raises(ValueError, match="wkb must be"):
        call(w=(*weights[:-2], weights[-2][:2].copy(), weights[-1]))  # W_kb of 2 heads for 4
    with pytest.raises(ValueError, match="both float32 or both bf16"):
        call(w=(*weights[:-1], weights[-1].astype("float64")))
