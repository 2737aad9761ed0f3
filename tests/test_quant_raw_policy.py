"""Policies with llama.cpp's raw formats (q4_k, q6_k, ...): quantized through ggml_quant,
with llama.cpp's fallback where a row is not a whole number of blocks, and a quantized
checkpoint that saves and loads them."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import moerun
from moerun.bench.random_model import write_random_model
from moerun.engine.llm import DEMO_MODEL
from moerun.kernels import ggml
from moerun.kernels import formats
from moerun.loaders import quantized as checkpoint
from moerun.loaders.quantized_write import quantize_checkpoint
from moerun.quant import POLICIES, formats_in_use
from moerun.layers.quantized import QuantizedExperts, QuantizedLinear

from test_quantize_checkpoint import assert_same_model, load_without_quantizing

WIDE_QWEN3 = dict(
    model_type="qwen3_moe", vocab_size=120, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=64,
    tie_word_embeddings=False,
)


def test_fit_falls_back_like_llamacpp():
    assert formats.fit("q4_k", 512) == "q4_k"
    assert formats.fit("q4_k", 128) == "q5_0"
    assert formats.fit("q6_k", 128) == "int8"
    assert formats.fit("q5_k", 96) == "int8"
    assert formats.fit("q4_k", 40) == "int8"  # not even Q5_0's 32
    assert formats.fit("int4", 40) == "int4"


def test_linear_raw_format_matches_reference():
    torch.manual_seed(0)
    lin = nn.Linear(512, 24, bias=False)
    for fmt in ("q4_k", "q6_k", "q5_0"):
        q = QuantizedLinear.from_linear(lin, fmt)
        assert q.fmt == fmt and q.scales.shape == (24, 0)
        w = ggml.dequantize(fmt, q.qweight, 512)
        x = torch.randn(3, 512)
        ref = x @ w.T
        got = q(x)
        assert (got - ref).abs().max() < 0.05 * ref.abs().max() + 1e-3, fmt
    assert QuantizedLinear.from_linear(nn.Linear(128, 8), "q4_k").fmt == "q5_0"
    assert QuantizedLinear.from_linear(nn.Linear(128, 8), "q6_k").fmt == "int8"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("wide") / "m", dict(WIDE_QWEN3))


@pytest.mark.parametrize("policy", ["kq", "int4-kq", "int4-q6k"])
def test_raw_checkpoint_round_trip(wide, tmp_path, monkeypatch, policy):
    out = tmp_path / "q"
    quantize_checkpoint(wide, out, policy)
    entry = json.loads((out / "config.json").read_text())["quantization"]
    p = POLICIES[policy]
    assert entry["modules"]["lm_head"] == "q6_k"
    assert entry["modules"]["model.layers.0.mlp.experts"] == p.experts
    assert entry["modules"]["model.layers.0.self_attn.q_proj"] == p.attention
    ref = moerun.load(wide, quant=policy, threads=1)
    got = load_without_quantizing(out, monkeypatch)
    assert formats_in_use(got.net)["lm_head"] == "q6_k"
    assert_same_model(ref, got)
    # --quant with the policy it was written with is a no-op
    assert_same_model(ref, load_without_quantizing(out, monkeypatch, quant=policy))


def test_demo_falls_back_and_round_trips(tmp_path, monkeypatch):
    """The demo model's rows (hidden 128, experts 64) are no K-quant's 256: q4_k -> q5_0, q6_k -> int8."""
    out = tmp_path / "kq"
    quantize_checkpoint(DEMO_MODEL, out, "kq")
    entry = json.loads((out / "config.json").read_text())["quantization"]
    assert entry["components"]["experts"] == "q4_k"
    assert entry["modules"]["lm_head"] == "int8"
    assert entry["modules"]["model.layers.0.mlp.experts"] == "q5_0"
    ref = moerun.load(DEMO_MODEL, quant="kq", threads=1)
    got = load_without_quantizing(out, monkeypatch)
    assert isinstance(got.net.model.layers[0].mlp.experts, QuantizedExperts)
    assert_same_model(ref, got)


def test_experts_down_format_round_trips(wide, tmp_path, monkeypatch):
    """Experts whose down projection has its own format are written `gate_up/down`."""
    from moerun.quant import quantize_model

    llm = moerun.load(wide, threads=1)
    ex = llm.net.model.layers[0].mlp.experts
    q = QuantizedExperts.from_experts(ex, "q4_k", "q6_k")
    assert (q.fmt, q.down_fmt, q.formats) == ("q4_k", "q6_k", "q4_k/q6_k")
    assert checkpoint._split("q4_k/q6_k") == ("q4_k", "q6_k") and checkpoint._split("int4") == ("int4", "int4")
    assert checkpoint._split("q4_k/bogus") is None
    x = torch.randn(3, 256)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.full((3, 2), 0.5)
    assert torch.isfinite(q(x, ids, w)).all()
    del quantize_model


def test_default_policy_reads_no_more_than_q4_k_m():
    """Issue 35 item 4's bytes bar, on 2 of Qwen3-30B-A3B's layers (the table in
    docs/benchmarks.md is 8): the default policy's bytes per decoded token
    (`moerun info`'s count) against llama.cpp's Q4_K_M of the same tensors."""
    import importlib.util
    import sys
    from pathlib import Path

    from moerun.engine.info import describe
    from moerun.quant import DEFAULT_POLICY, compute_in_float32

    path = Path(__file__).parents[1] / "benchmarks" / "quant_policies.py"
    spec = importlib.util.spec_from_file_location("quant_policies", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["quant_policies"] = bench
    spec.loader.exec_module(bench)
    net, args = bench.shaped_net(2, DEFAULT_POLICY)  # uninitialised: only the sizes count
    compute_in_float32(net)
    ours = describe(net, args)["bytes_per_token"]
    ref = bench.q4_k_m_bytes(args)["bytes_per_token"]
    assert ours <= ref, (ours, ref)
    old, _ = bench.shaped_net(2, "int4")
    compute_in_float32(old)
    assert describe(old, args)["bytes_per_token"] > ref  # what the default was before


def test_cli_quantize_defaults_to_the_default_policy(wide, tmp_path, capsys):
    from dataclasses import asdict

    from moerun.quant import DEFAULT_POLICY

    from conftest import cli

    out = tmp_path / "d"
    rc, _ = cli(capsys, "quantize", "-m", wide, "-o", out)
    assert rc == 0
    entry = json.loads((out / "config.json").read_text())["quantization"]
    assert entry["components"] == asdict(POLICIES[DEFAULT_POLICY])
    assert entry["modules"]["lm_head"] == "q6_k" and entry["modules"]["model.layers.0.self_attn.o_proj"] == "int4"
