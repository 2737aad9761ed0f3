"""Block formats (round trips, packed layout) and the component policy of quantize_model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from moerun import kernels
from moerun.layers.moe import Experts
from moerun.models import qwen3_moe
from moerun.kernels import formats
from moerun.quant import POLICIES, QuantPolicy, quantize_model
from moerun.layers.quantized import QuantizedExperts, QuantizedLinear


def test_int4_layout_and_exact_values():
    # a row whose values are exact multiples of its scale round-trips exactly
    q = torch.arange(-8, 8).repeat(2).float()  # 32 values, largest magnitude -8
    w = (q * 0.25)[None]  # d = -8 * 0.25 / -8 = 0.25
    packed, scales = formats.quantize(w, "int4")
    assert packed.shape == (1, 16) and packed.dtype == torch.uint8
    assert scales.shape == (1, 1) and scales.dtype == torch.float16
    # byte j: element j in the low nibble, element j + 16 in the high nibble, stored as q + 8
    assert int(packed[0, 0]) == (0 + 8 - 8) | ((0 + 8 - 8) << 4)
    assert int(packed[0, 1]) == 1 | (1 << 4)
    assert torch.equal(formats.dequantize(packed, scales, "int4", 32), w)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_whole_groups_are_word_interleaved(fmt):
    # 9 blocks: one group of 8 interleaved by 4-byte words, then one natural block
    per = 16 if fmt == "int4" else 32
    w = torch.randn(2, 9 * 32, generator=torch.Generator().manual_seed(0))
    packed, scales = formats.quantize(w, fmt)
    assert packed.shape == (2, 9 * per) and scales.shape == (2, 9)
    natural = formats.natural_blocks(packed, fmt)  # [2, 9, per]
    rows = packed.view(torch.uint8)
    for j in range(8):
        for k in range(per // 4):
            word = rows[:, (k * 8 + j) * 4:(k * 8 + j + 1) * 4]
            assert torch.equal(word, natural[:, j, 4 * k:4 * k + 4].view(torch.uint8))
    assert torch.equal(rows[:, 8 * per:], natural[:, 8].view(torch.uint8))
    # the natural blocks hold the values (llama.cpp's Q4_0 / Q8_0 levels, tests/test_ggml_quant.py):
    # int4 byte j is elements j (low nibble) and j + 16
    from moerun.kernels.ggml_quant import q4_0_levels, q8_0_levels

    d, q = (q4_0_levels if fmt == "int4" else q8_0_levels)(w.reshape(-1, 32))
    assert torch.equal(d.half().reshape(2, 9), scales)
    q = q.to(torch.int16).reshape(2, 9, 32) - (8 if fmt == "int4" else 0)
    if fmt == "int4":
        nat = natural.to(torch.int16)
        got = torch.cat([nat & 0xF, nat >> 4], -1) - 8
    else:
        got = natural.to(torch.int16)
    assert torch.equal(got, q.to(torch.int16))


def test_llamacpp_blocks_for_the_benchmark():
    # benchmarks/vs_llamacpp.py hands llama.cpp the same weights as Q4_0 / Q8_0 blocks: the fp16
    # scale, then the block's natural bytes (Q4_0: low nibbles elements 0-15, high 16-31, q + 8)
    path = Path(__file__).parents[1] / "benchmarks" / "vs_llamacpp.py"
    spec = importlib.util.spec_from_file_location("vs_llamacpp", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["vs_llamacpp"] = bench  # a dataclass looks its module up there
    spec.loader.exec_module(bench)
    w = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    for fmt, per in (("int4", 16), ("int8", 32)):
        packed, scales = formats.quantize(w, fmt)
        blocks = torch.from_numpy(bench.ggml_blocks(packed, scales, fmt)).reshape(3, 10, 2 + per)
        d = blocks[..., :2].contiguous().view(torch.float16).float()  # [3, 10, 1]
        if fmt == "int4":
            b = blocks[..., 2:].to(torch.int16)
            q = torch.cat([b & 0xF, b >> 4], -1) - 8
        else:
            q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16)
        values = (q.float() * d).reshape(3, -1)[:, :300]
        assert torch.equal(values, formats.dequantize(packed, scales, fmt, 300))


def test_int8_exact_values_and_padding():
    w = torch.arange(-127, 127, 5).float()[None] * 0.01  # 51 values: 2 blocks, the last padded
    packed, scales = formats.quantize(w, "int8")
    assert packed.shape == (1, 64) and packed.dtype == torch.int8 and scales.shape == (1, 2)
    back = formats.dequantize(packed, scales, "int8", 51)
    assert back.shape == (1, 51)
    assert float((back - w).abs().max()) <= float(scales.float().max()) / 2 + 1e-7


# int4: the side opposite the largest value stops at +7, up to one step away
@pytest.mark.parametrize("fmt,bound", [("int4", 1.0), ("int8", 0.5)])
def test_round_trip_error_within_half_a_step(fmt, bound):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 70, generator=g)
    packed, scales = formats.quantize(w, fmt)
    assert packed.shape[:2] == (3, 5)
    err = (formats.dequantize(packed, scales, fmt, 70) - w).abs()
    step = scales.float().abs().repeat_interleave(32, -1)[..., :70]
    # half a step from rounding, plus the fp16 rounding of the scale itself
    assert bool((err <= step * bound + w.abs() * 2e-3 + 1e-6).all())


def test_zero_block_and_unknown_format():
    packed, scales = formats.quantize(torch.zeros(2, 32), "int4")
    assert float(scales.float().abs().max()) == 0
    assert torch.equal(formats.dequantize(packed, scales, "int4", 32), torch.zeros(2, 32))
    with pytest.raises(ValueError):
        formats.quantize(torch.zeros(1, 32), "int3")
    with pytest.raises(ValueError):
        QuantPolicy(experts="fp8")
    with pytest.raises(ValueError):
        quantize_model(torch.nn.Linear(2, 2), "int2")


def test_activation_quantization_reference():
    x = torch.tensor([[0.9, -2.0, 0.5] + [0.0] * 29])
    q, d = formats.quantize_activations(x)
    assert float(d[0, 0]) == pytest.approx(2.0 / 127)
    assert q[0, 0, :3].tolist() == [57, -127, 32]


def tiny_model(seed=0, **over):
    cfg = dict(
        model_type="qwen3_moe", vocab_size=101, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
    )
    cfg.update(over)
    net = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.ones_like(p) if p.ndim == 1 else torch.randn(p.shape, generator=g) * 0.08)
    return net.eval()


def test_default_policy_components():
    net = tiny_model()
    counts = quantize_model(net, "int4")
    assert counts == {"attention": 8, "experts": 1, "shared_experts": 3, "lm_head": 1}
    layer0, layer1 = net.model.layers
    assert isinstance(layer0.mlp.experts, QuantizedExperts) and layer0.mlp.experts.fmt == "int4"
    assert isinstance(layer0.mlp.gate, torch.nn.Linear)  # the router stays float
    assert isinstance(layer0.self_attn.q_proj, QuantizedLinear) and layer0.self_attn.q_proj.fmt == "int8"
    assert isinstance(layer1.mlp.down_proj, QuantizedLinear) and layer1.mlp.down_proj.fmt == "int8"
    assert isinstance(net.lm_head, QuantizedLinear) and net.lm_head.fmt == "int8"
    assert isinstance(net.model.embed_tokens, torch.nn.Embedding)
    assert not any(isinstance(m, Experts) for m in net.modules())


def test_none_policy_leaves_model_alone():
    net = tiny_model()
    assert quantize_model(net, "none") == {}
    assert quantize_model(net, None) == {}
    assert isinstance(net.lm_head, torch.nn.Linear)


@pytest.mark.parametrize("policy,tol", [("int8", 0.03), ("int4", 0.15), ("int4-all", 0.3)])
def test_quantized_model_logits_close_to_float(policy, tol):
    torch.manual_seed(0)
    ids = torch.randint(0, 101, (2, 9))
    net = tiny_model()
    with torch.inference_mode():
        ref = net(ids)
    quantize_model(net, POLICIES[policy])
    with torch.inference_mode():
        ours = net(ids)
        with kernels.use_isa("torch"):
            torch_path = net(ids)
    rel = float((ours - ref).norm() / ref.norm())
    assert rel < tol, rel
    assert float((ours - torch_path).norm() / torch_path.norm()) < 1e-3


def test_quantized_state_dict_round_trip():
    net = tiny_model()
    quantize_model(net, "int4")
    state = net.state_dict()
    assert state["model.layers.0.mlp.experts.gate_q"].dtype == torch.uint8
    other = tiny_model(seed=1)
    quantize_model(other, "int4")
    other.load_state_dict(state)
    ids = torch.randint(0, 101, (1, 5))
    with torch.inference_mode():
        assert torch.equal(net(ids), other(ids))


def test_quantize_model_leaves_quantized_modules_alone():
    net = tiny_model()
    quantize_model(net, "int4")
    experts = net.model.layers[0].mlp.experts
    assert quantize_model(net, "int8") == {}  # nothing float is left to quantize
    assert net.model.layers[0].mlp.experts is experts and experts.fmt == "int4"
