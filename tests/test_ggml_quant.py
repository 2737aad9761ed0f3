"""moerun/kernels/ggml_quant.py: float -> GGUF blocks; moerun/quant/gguf_types.py: llama-quantize's choice of type per tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from moerun.kernels import ggml_quant
from moerun.kernels.ggml_quant import BLOCKS, quantize
from moerun.quant.gguf_types import tensor_type

GGML = {"q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "q5_0": T.Q5_0, "q4_0": T.Q4_0, "q8_0": T.Q8_0}
FORMATS = list(GGML)


def dequant(fmt: str, q: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(q.numpy(), GGML[fmt])))


def rel_rmse(back: torch.Tensor, w: torch.Tensor) -> float:
    return ((back - w).pow(2).mean() / w.pow(2).mean()).sqrt().item()


def gaussian(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32))


# Relative RMSE on N(0, 1) rows (512 x 4096, numpy default_rng(0)), llama.cpp's own quantizers
# (ggml built from source, ggml_quantize_chunk without imatrix) and ours:
#   q4_0 0.08595 / 0.08595   q4_k 0.07133 / 0.07133   q5_0 0.04271 / 0.04271
#   q5_k 0.03611 / 0.03612   q6_k 0.01773 / 0.01773   q8_0 0.00535 / 0.00535
# The bounds below leave ~3% of headroom (these 128 rows are the first of those 512).
RMSE_BOUND = {"q4_0": 0.089, "q4_k": 0.074, "q5_0": 0.044, "q5_k": 0.0372, "q6_k": 0.0183, "q8_0": 0.0056}


@pytest.fixture(scope="module")
def gauss_rows() -> torch.Tensor:
    return gaussian(128, 4096)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_on_gaussian_rows(fmt, gauss_rows):
    q = quantize(fmt, gauss_rows)
    block, size = BLOCKS[fmt]
    assert q.dtype == torch.uint8
    assert q.shape == (128, 4096 // block * size)
    err = rel_rmse(dequant(fmt, q), gauss_rows)
    assert err < RMSE_BOUND[fmt], (fmt, err)


def test_error_ranking(gauss_rows):
    err = {fmt: rel_rmse(dequant(fmt, quantize(fmt, gauss_rows)), gauss_rows) for fmt in FORMATS}
    # K-quants beat the legacy formats of the same bits; Q6_K is ~4x better than Q4_K
    assert err["q4_k"] < 0.9 * err["q4_0"]
    assert err["q5_k"] < 0.9 * err["q5_0"]
    assert err["q6_k"] < 0.3 * err["q4_k"]
    assert err["q8_0"] < 0.35 * err["q6_k"]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q5_0"])
def test_legacy_formats_are_byte_exact_with_gguf_py(fmt):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 1024)).astype(np.float32)
    # values on a coarse grid land exactly on rounding ties; plus signs and zeros in odd places
    w[:8] = rng.integers(-64, 65, (8, 1024)).astype(np.float32) / 8
    w[8, :32] = 0.0
    w[9, :32] = -3.0
    w[10, 32:64] = 5.0
    ours = quantize(fmt, torch.from_numpy(w)).numpy()
    ref = quants.quantize(w, GGML[fmt])
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_rows(fmt):
    w = torch.zeros(3, 512)
    q = quantize(fmt, w)
    back = dequant(fmt, q)
    assert torch.equal(back, torch.zeros_like(back))
    if fmt in ("q4_k", "q5_k", "q6_k", "q8_0"):
        assert int(q.max()) == 0  # llama.cpp writes zero blocks


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_huge_outlier(fmt):
    w = gaussian(4, 1024, seed=2)
    big = w.clone()
    big[1, 300] = 1000.0
    q = quantize(fmt, big)
    back = dequant(fmt, q)
    assert torch.isfinite(back).all()
    # the outlier itself survives to within its block's resolution
    assert abs(back[1, 300].item() - 1000.0) < 0.02 * 1000.0
    # blocks are quantized independently: every other block is byte for byte as without it
    block, size = BLOCKS[fmt]
    plain = quantize(fmt, w)
    hit = 300 // block
    mask = torch.ones_like(q, dtype=torch.bool)
    mask[1, hit * size : (hit + 1) * size] = False
    assert torch.equal(q[mask], plain[mask])


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_width_must_be_a_multiple_of_the_block(fmt):
    block = BLOCKS[fmt][0]
    with pytest.raises(ValueError, match="not a multiple"):
        quantize(fmt, torch.zeros(2, block + 32 if block == 256 else 48))


def test_unknown_format_and_non_float_input():
    with pytest.raises(ValueError, match="unknown ggml format"):
        quantize("q3_k", torch.zeros(1, 256))
    with pytest.raises(ValueError, match="float"):
        quantize("q8_0", torch.zeros(1, 32, dtype=torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_input_is_its_float32_value(fmt):
    w = gaussian(4, 512, seed=3).to(torch.bfloat16)
    assert torch.equal(quantize(fmt, w), quantize(fmt, w.float()))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0"])
def test_leading_dims_and_chunking_do_not_change_bytes(fmt, monkeypatch):
    w = gaussian(3 * 5, 512, seed=4).reshape(3, 5, 512)
    whole = quantize(fmt, w)
    assert whole.shape[:2] == (3, 5)
    # one row at a time gives the same bytes as the default chunks
    monkeypatch.setattr(ggml_quant, "_CHUNK", 1)
    assert torch.equal(quantize(fmt, w), whole)
    for e in range(3):
        assert torch.equal(quantize(fmt, w[e]), whole[e])


def test_k_quant_block_layout():
    """The fields sit where ggml puts them: Q4_K/Q5_K d, dmin first; Q6_K d last."""
    w = gaussian(1, 256, seed=5)
    amax = w.abs().max().item()
    for fmt in ("q4_k", "q5_k"):
        q = quantize(fmt, w)
        d, dmin = q[0, :4].view(torch.float16).float().tolist()
        assert 0 < d < amax / 10 and 0 < dmin < amax / 10
    q = quantize("q6_k", w)
    d = q[0, 208:210].view(torch.float16).float().item()
    # d = -max_scale / 128, the scale of largest magnitude stored as -128
    assert d != 0 and abs(d) < amax / 100
    assert -128 in q[0, 192:208].view(torch.int8).tolist()


def test_constant_negative_sub_block():
    """A flat negative sub-block is all min (make_qkx2_quants' early exit), within the 6-bit min."""
    w = gaussian(1, 256, seed=6)
    w[0, 32:64] = -0.5
    for fmt in ("q4_k", "q5_k"):
        q = quantize(fmt, w)
        back = dequant(fmt, q)
        dmin = q[0, 2:4].view(torch.float16).float().item()
        assert torch.all(back[0, 32:64] == back[0, 32])  # one value
        assert abs(back[0, 32].item() + 0.5) <= dmin / 2 + 1e-3


# ---------------------------------------------------------------------------------------------
# tensor_type

QWEN3_MOE_48 = dict(n_layer=48, arch="qwen3moe")  # Qwen3-30B-A3B: 48 blocks, 128 experts
QWEN35_MOE_40 = dict(n_layer=40, arch="qwen35moe")  # Qwen3.5/3.6-35B-A3B: 40 blocks, 256 experts


def more_bits(n: int) -> set[int]:
    return {i for i in range(n) if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2}


def test_use_more_bits_layers():
    assert sorted(more_bits(48)) == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41,
                                     42, 43, 44, 45, 46, 47]
    assert sorted(more_bits(40)) == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34,
                                     35, 36, 37, 38, 39]


def test_qwen3moe_q4_k_m():
    kw = QWEN3_MOE_48
    q6 = {i for i in range(48) if tensor_type("q4_k_m", f"blk.{i}.ffn_down_exps.weight", (128, 2048, 768), **kw) == "q6_k"}
    assert q6 == {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47}
    for i in range(48):
        want = "q6_k" if i in q6 else "q4_k"
        assert tensor_type("q4_k_m", f"blk.{i}.ffn_down_exps.weight", (128, 2048, 768), **kw) == want
        assert tensor_type("q4_k_m", f"blk.{i}.attn_v.weight", (512, 2048), **kw) == want
        assert tensor_type("q4_k_m", f"blk.{i}.ffn_gate_exps.weight", (128, 768, 2048), **kw) == "q4_k"
        assert tensor_type("q4_k_m", f"blk.{i}.ffn_up_exps.weight", (128, 768, 2048), **kw) == "q4_k"
        assert tensor_type("q4_k_m", f"blk.{i}.attn_q.weight", (4096, 2048), **kw) == "q4_k"
        assert tensor_type("q4_k_m", f"blk.{i}.attn_k.weight", (512, 2048), **kw) == "q4_k"
        assert tensor_type("q4_k_m", f"blk.{i}.attn_output.weight", (2048, 4096), **kw) == "q4_k"
        assert tensor_type("q4_k_m", f"blk.{i}.ffn_gate_inp.weight", (128, 2048), **kw) == "f32"
        for norm in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm"):
            assert tensor_type("q4_k_m", f"blk.{i}.{norm}.weight", (2048,), **kw) == "f32"
    assert tensor_type("q4_k_m", "output.weight", (151936, 2048), **kw) == "q6_k"
    assert tensor_type("q4_k_m", "token_embd.weight", (151936, 2048), **kw) == "q4_k"
    assert tensor_type("q4_k_m", "output_norm.weight", (2048,), **kw) == "f32"
    # a model without output.weight: the embedding is the head
    assert tensor_type("q4_k_m", "token_embd.weight", (151936, 2048), **kw, tied_embeddings=True) == "q6_k"


def test_qwen35moe_q4_k_m():
    kw = QWEN35_MOE_40
    layers = {i for i in range(40)
              if tensor_type("q4_k_m", f"blk.{i}.ffn_down_exps.weight", (256, 2048, 512), **kw) == "q6_k"}
    assert layers == {0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39}
    for i in range(40):
        want = "q6_k" if i in layers else "q4_k"
        assert tensor_type("q4_k_m", f"blk.{i}.ffn_down_shexp.weight", (2048, 512), **kw) == want
        assert tensor_type("q4_k_m", f"blk.{i}.ffn_gate_shexp.weight", (512, 2048), **kw) == "q4_k"
        assert tensor_type("q4_k_m", f"blk.{i}.ffn_gate_inp_shexp.weight", (1, 2048), **kw) == "f32"
        assert tensor_type("q4_k_m", f"blk.{i}.ffn_gate_inp_shexp.weight", (2048,), **kw) == "f32"
        if i % 4 == 3:  # full attention
            assert tensor_type("q4_k_m", f"blk.{i}.attn_v.weight", (512, 2048), **kw) == want
            assert tensor_type("q4_k_m", f"blk.{i}.attn_q.weight", (8192, 2048), **kw) == "q4_k"
        else:  # gated delta net: attn_qkv takes the attn_v rules
            assert tensor_type("q4_k_m", f"blk.{i}.attn_qkv.weight", (8192, 2048), **kw) == want
            assert tensor_type("q4_k_m", f"blk.{i}.attn_gate.weight", (4096, 2048), **kw) == "q4_k"
            assert tensor_type("q4_k_m", f"blk.{i}.ssm_out.weight", (2048, 4096), **kw) == "q4_k"
            assert tensor_type("q4_k_m", f"blk.{i}.ssm_conv1d.weight", (8192, 4), **kw) == "f32"
            assert tensor_type("q4_k_m", f"blk.{i}.ssm_a", (32,), **kw) == "f32"
            assert tensor_type("q4_k_m", f"blk.{i}.ssm_dt.bias", (32,), **kw) == "f32"
            assert tensor_type("q4_k_m", f"blk.{i}.ssm_norm.weight", (128,), **kw) == "f32"
    assert tensor_type("q4_k_m", "blk.5.ssm_out.weight", (2048, 4096), **kw) == "q4_k"
    assert tensor_type("q4_k_m", "output.weight", (248320, 2048), **kw) == "q6_k"
    with pytest.raises(ValueError, match="past n_layer"):
        tensor_type("q4_k_m", "blk.40.ffn_down_exps.weight", (256, 2048, 512), **kw)
    # with the MTP block the file has 41 blocks and the last is a use_more_bits layer
    assert tensor_type("q4_k_m", "blk.40.ffn_down_exps.weight", (256, 2048, 512), n_layer=41) == "q6_k"


@pytest.mark.parametrize(
    "recipe, default", [("q5_k_m", "q5_k"), ("q6_k", "q6_k"), ("q8_0", "q8_0"), ("q4_0", "q4_0")]
)
def test_other_recipes(recipe, default):
    kw = QWEN3_MOE_48
    bumped = recipe == "q5_k_m"
    assert tensor_type(recipe, "blk.0.ffn_down_exps.weight", (128, 2048, 768), **kw) == ("q6_k" if bumped else default)
    assert tensor_type(recipe, "blk.6.ffn_down_exps.weight", (128, 2048, 768), **kw) == default
    assert tensor_type(recipe, "blk.47.attn_v.weight", (512, 2048), **kw) == ("q6_k" if bumped else default)
    assert tensor_type(recipe, "blk.7.attn_v.weight", (512, 2048), **kw) == default
    assert tensor_type(recipe, "blk.7.ffn_up_exps.weight", (128, 768, 2048), **kw) == default
    # the head is Q6_K under every quantized recipe but Q8_0
    assert tensor_type(recipe, "output.weight", (151936, 2048), **kw) == ("q8_0" if recipe == "q8_0" else "q6_k")
    assert tensor_type(recipe, "token_embd.weight", (151936, 2048), **kw) == default
    assert tensor_type(recipe, "blk.7.ffn_gate_inp.weight", (128, 2048), **kw) == "f32"


@pytest.mark.parametrize("recipe", ["bf16", "f32"])
def test_float_recipes(recipe):
    kw = QWEN3_MOE_48
    for name, shape in [("blk.0.ffn_down_exps.weight", (128, 2048, 768)), ("output.weight", (151936, 2048)),
                        ("token_embd.weight", (151936, 2048)), ("blk.3.attn_v.weight", (512, 2048))]:
        assert tensor_type(recipe, name, shape, **kw) == recipe
    assert tensor_type(recipe, "blk.0.attn_norm.weight", (2048,), **kw) == "f32"
    assert tensor_type(recipe, "blk.0.ffn_gate_inp.weight", (128, 2048), **kw) == "f32"


def test_mixtral_eight_experts():
    kw = dict(n_layer=32, arch="llama", n_expert=8)
    assert tensor_type("q4_k_m", "blk.10.attn_v.weight", (1024, 4096), **kw) == "q8_0"
    assert tensor_type("q4_k_m", "blk.10.attn_k.weight", (1024, 4096), **kw) == "q8_0"
    assert tensor_type("q4_k_m", "blk.10.attn_output.weight", (4096, 4096), **kw) == "q5_k"
    assert tensor_type("q4_k_m", "blk.10.attn_q.weight", (4096, 4096), **kw) == "q4_k"
    assert tensor_type("q5_k_m", "blk.10.attn_output.weight", (4096, 4096), **kw) == "q5_k"
    assert tensor_type("q4_0", "blk.10.attn_k.weight", (1024, 4096), **kw) == "q8_0"
    # ffn_down: use_more_bits of 32 layers (0-3, 6, 9, ..., 27, 28-31)
    assert tensor_type("q4_k_m", "blk.6.ffn_down_exps.weight", (8, 4096, 14336), **kw) == "q6_k"
    assert tensor_type("q4_k_m", "blk.7.ffn_down_exps.weight", (8, 4096, 14336), **kw) == "q4_k"


def test_fallback_when_rows_are_not_a_multiple_of_256():
    # Qwen1.5-MoE-A2.7B: expert rows of 1408 = 5.5 x 256
    kw = dict(n_layer=24, arch="qwen2moe")
    assert tensor_type("q4_k_m", "blk.1.ffn_down_exps.weight", (60, 2048, 1408), **kw) == "q8_0"  # Q6_K -> Q8_0
    assert tensor_type("q4_k_m", "blk.4.ffn_down_exps.weight", (60, 2048, 1408), **kw) == "q5_0"  # Q4_K -> Q5_0
    assert tensor_type("q5_k_m", "blk.4.ffn_down_exps.weight", (60, 2048, 1408), **kw) == "q8_0"  # Q5_K -> (Q5_1) Q8_0
    assert tensor_type("q6_k", "blk.4.ffn_down_exps.weight", (60, 2048, 1408), **kw) == "q8_0"
    assert tensor_type("q4_k_m", "blk.4.ffn_up_exps.weight", (60, 1408, 2048), **kw) == "q4_k"
    # the head of a model whose width is not a multiple of 256 is Q8_0
    assert tensor_type("q4_k_m", "output.weight", (1000, 1120), **kw) == "q8_0"
    # not even a multiple of 32: llama.cpp's F16 for K-quants, an error for Q8_0/Q4_0
    assert tensor_type("q4_k_m", "blk.4.ffn_up_exps.weight", (60, 8, 100), **kw) == "f16"
    with pytest.raises(ValueError, match="not a multiple of 32"):
        tensor_type("q8_0", "blk.4.ffn_up_exps.weight", (60, 8, 100), **kw)


def test_bad_recipe_and_names():
    with pytest.raises(ValueError, match="unknown recipe"):
        tensor_type("q3_k_m", "output.weight", (10, 256), 4)
    with pytest.raises(ValueError, match="layer"):
        tensor_type("q4_k_m", "ffn_down.weight", (256, 256), 4)


# --- moerun's int8 / int4 blocks are llama.cpp's Q8_0 / Q4_0 blocks ----------------------------


def _ggml_blocks(w: torch.Tensor, fmt: str) -> np.ndarray:
    """moerun's packed int8/int4 quantization of w as GGUF Q8_0/Q4_0 blocks (export-gguf's bytes)."""
    from moerun.kernels import formats
    from moerun.loaders.gguf_write import _to_ggml

    return _to_ggml(*formats.quantize(w, fmt), fmt)


def test_q8_0_hand_worked_blocks():
    """Worked by hand from quantize_row_q8_0_ref: d = absmax / 127, q = roundf(x * (1 / d)).

    Block 0: absmax 127, so d = 1 and x * (1 / d) = x: the halves round away from zero
    (2.5 -> 3, -0.5 -> -1; half to even would give 2 and 0).
    Block 1: absmax 1, so d = 1 / 127 = 0.007874016 (float32), 1 / d = 127.0; fp16(d) is
    0.0078735352 (0x2008). 0.7913 * 127.0 = 100.4951 -> 100, where 0.7913 / fp16(d) =
    100.5012 would give 101: the quants are computed against d before it is rounded to fp16.
    """
    b0 = torch.zeros(32)
    b0[:8] = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5])
    b1 = torch.zeros(32)
    b1[0], b1[1], b1[2] = 1.0, 0.7913, -0.5
    got = _ggml_blocks(torch.stack([b0, b1]).reshape(1, 64), "int8").reshape(2, 34)
    assert got[0, :2].view(np.float16)[0] == 1.0
    assert got[1, :2].tobytes() == b"\x08\x20"
    q0, q1 = got[0, 2:].view(np.int8), got[1, 2:].view(np.int8)
    assert q0[:8].tolist() == [127, 3, -3, 1, -1, 2, -2, 127] and not q0[8:].any()
    # -0.5 * 127 = -63.5 -> -64 (away from zero)
    assert q1[:3].tolist() == [127, 100, -64] and not q1[3:].any()
    assert np.array_equal(got.reshape(-1), quantize("q8_0", torch.stack([b0, b1]).reshape(1, 64)).numpy().reshape(-1))


def test_q4_0_hand_worked_block():
    """quantize_row_q4_0_ref: d = max / -8 (max the signed value of largest magnitude), q =
    min(15, (int8)(x * (1 / d) + 8.5)), the product rounded to float32 before the add (no FMA:
    llama-quantize's bytes). With max = -0.046875, d = 0.005859375 and 1 / d = 170.66667 (float32):
    -0.0322265625 * (1 / d) = -5.5000002 rounds to -5.5, + 8.5 = 3 (an FMA would give 2.9999998,
    truncated to 2); max itself -> 0, 0.041259765625 -> 15 (7.04 + 8.5, capped)."""
    b = torch.zeros(32)
    b[0], b[1], b[18] = -0.046875, 0.041259765625, -0.0322265625
    got = _ggml_blocks(b.reshape(1, 32), "int4").reshape(18)
    assert got[:2].view(np.float16)[0] == np.float16(0.005859375)
    q = np.concatenate([got[2:] & 0xF, got[2:] >> 4])
    expect = np.full(32, 8)
    expect[0], expect[1], expect[18] = 0, 15, 3
    assert q.tolist() == expect.tolist()
    assert np.array_equal(got, quantize("q4_0", b.reshape(1, 32)).numpy().reshape(-1))


@pytest.mark.parametrize("fmt, ggml", [("int8", "q8_0"), ("int4", "q4_0")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moerun_int8_int4_are_q8_0_q4_0(fmt, ggml, dtype):
    """formats.quantize's int8 / int4 blocks (the --quant policies, export-gguf's Q8_0/Q4_0) equal
    gguf-py's Q8_0/Q4_0 (a port of llama.cpp's reference) and ggml_quant's, on float32 and on bf16
    weights (bf16 values put x / d on half-integers often)."""
    w = (gaussian(96, 1024, seed=3) * 0.02).to(dtype)
    ours = _ggml_blocks(w, fmt).reshape(96, -1)
    np.testing.assert_array_equal(ours, quants.quantize(w.float().numpy(), GGML[ggml]))
    np.testing.assert_array_equal(ours, quantize(ggml, w).numpy())


def _llama_quantize():
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import llamacpp

        if llamacpp.is_built():
            return llamacpp.tool("llama-quantize")
    except Exception:  # noqa: BLE001 - no build: the test skips
        pass
    return shutil.which("llama-quantize")


@pytest.mark.parametrize("recipe, gtype", [("Q8_0", "Q8_0"), ("Q4_0", "Q4_0"), ("Q6_K", "Q6_K")])
def test_blocks_equal_llama_quantize(tmp_path, recipe, gtype):
    """llama-quantize (the native build of benchmarks/llamacpp.py, where there is one) turns the
    demo model's f32 GGUF into Q8_0 / Q4_0 / Q6_K (--pure); moerun's quantizers give the same
    bytes for every such tensor (Q8_0/Q4_0: formats.quantize's int8/int4, what export-gguf writes;
    Q6_K: ggml_quant)."""
    import subprocess
    from pathlib import Path

    from gguf import GGUFReader

    import moerun
    from moerun.loaders.gguf_write import export

    tool = _llama_quantize()
    if not tool:
        pytest.skip("llama-quantize is not built here (python benchmarks/llamacpp.py build)")
    f32 = tmp_path / "demo-f32.gguf"
    export(Path(moerun.__file__).parent / "demo_model", f32, "f32")
    out = tmp_path / f"demo-{recipe}.gguf"
    r = subprocess.run([str(tool), "--pure", str(f32), str(out), recipe, "1"], capture_output=True)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    src = {t.name: t for t in GGUFReader(str(f32)).tensors}
    n = 0
    for t in GGUFReader(str(out)).tensors:
        if t.tensor_type.name != gtype:
            continue
        x = torch.from_numpy(np.array(src[t.name].data)).float()
        x = x.reshape(-1, x.shape[-1])
        if gtype == "Q6_K":
            ours = quantize("q6_k", x).numpy()
        else:
            ours = _ggml_blocks(x, "int8" if gtype == "Q8_0" else "int4")
        np.testing.assert_array_equal(ours.reshape(-1), np.asarray(t.data).reshape(-1), err_msg=t.name)
        n += 1
    assert n >= (1 if gtype == "Q6_K" else 5)  # the demo has few rows of 256 inputs
