"""llama.cpp's raw block formats (q4_k, q5_k, q6_k, q5_0; `moerun.kernels.ggml`) on every
kernel path this CPU has, against the torch reference.

- `ggml.dequantize` against gguf-py's `gguf.quants.dequantize` on the same bytes: exact.
- native qlinear against the reference that models the kernels' activation quantization
  (int8 blocks of 32; the product of the dequantized weights and activations): 1e-5 of the
  reference's largest magnitude, float summation order only (as tests/test_kernels.py's int4).
- moe_experts with one format for gate/up and another for down: the hidden activation is
  quantized a second time, so as test_kernels.py's int4 experts: max 1e-2, norm 1e-4.
Random raw blocks: random bytes with sane fp16 d (and dmin), or Q5_0 quantized by gguf-py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moerun import kernels
from moerun.kernels import ggml
from moerun.kernels import formats
from moerun.layers.quantized import QuantizedExperts, QuantizedLinear

NATIVE = [i for i in kernels.available_isas() if i != "torch"]
RAW = list(ggml.FORMATS)
GGML_TYPES = {"q5_0": 6, "q4_k": 12, "q5_k": 13, "q6_k": 14}


def max_rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def norm_rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _set_f16(raw: np.ndarray, off: int, rng, lo: float, hi: float) -> None:
    v = rng.uniform(lo, hi, size=raw.shape[:-1]).astype(np.float16)
    raw[..., off : off + 2] = np.frombuffer(v.tobytes(), np.uint8).reshape(*raw.shape[:-1], 2)


def random_raw(fmt: str, lead: tuple, k: int, seed: int) -> torch.Tensor:
    """Random rows [*lead, row_bytes] of fmt: random quants and scales, fp16 d (and dmin) in a
    sane range (d > 0 for the K-quants' unsigned 6-bit scales, either sign otherwise)."""
    rng = np.random.default_rng(seed)
    be, bb, _ = ggml.BLOCKS[fmt]
    raw = rng.integers(0, 256, size=(*lead, k // be, bb), dtype=np.uint8)
    if fmt == "q6_k":
        _set_f16(raw, 208, rng, -2e-3, 2e-3)
    elif fmt == "q5_0":
        _set_f16(raw, 0, rng, -2e-2, 2e-2)
    else:
        _set_f16(raw, 0, rng, 0.0, 2e-3)
        _set_f16(raw, 2, rng, 0.0, 2e-3)
    return torch.from_numpy(raw.reshape(*lead, -1))


def ref_linear(x: torch.Tensor, fmt: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """The kernels' arithmetic in float64: int8 activations (the native rule) times the
    dequantized weights."""
    xq, xd = formats.quantize_activations(x.float())
    xf = (xq.double() * xd.double()[..., None]).reshape(x.shape[0], -1)[:, :k]
    return (xf @ ggml.dequantize(fmt, raw, k).double().T).float()


@pytest.mark.parametrize("fmt", RAW)
def test_dequantize_matches_gguf_py(fmt):
    from gguf import GGMLQuantizationType, quants

    k = 2 * 256
    raw = random_raw(fmt, (5,), k, seed=1)
    ref = quants.dequantize(raw.numpy(), GGMLQuantizationType(GGML_TYPES[fmt]))
    got = ggml.dequantize(fmt, raw, k)
    assert got.dtype == torch.float32 and got.shape == (5, k)
    assert np.array_equal(got.numpy(), ref)


def test_q5_0_from_gguf_quantize():
    """Q5_0 blocks made by gguf-py's own quantizer dequantize back close to the weights."""
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(7, 96, generator=torch.Generator().manual_seed(2)).numpy()
    raw = torch.from_numpy(np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType.Q5_0)))
    assert raw.shape == (7, ggml.row_bytes("q5_0", 96))
    back = ggml.dequantize("q5_0", raw, 96)
    assert np.array_equal(back.numpy(), quants.dequantize(raw.numpy(), GGMLQuantizationType.Q5_0))
    assert norm_rel(back, torch.from_numpy(w)) < 0.05


def test_codes_agree():
    for f in RAW:
        assert formats.FORMATS[f] == ggml.CODES[f]
    assert formats.expert_code("q4_k") == 112 and formats.expert_code("q4_k", "q6_k") == 112 | 114 << 8


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("fmt", RAW)
@pytest.mark.parametrize("M", [1, 3, 16, 64, 512])
def test_qlinear_raw(isa, fmt, M):
    K = 3 * 256 if fmt != "q5_0" else 13 * 32  # q5_0: 8-block groups and a tail of 5 blocks
    N = 37
    raw = random_raw(fmt, (N,), K, seed=M * 7 + len(fmt))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    scales = torch.empty(N, 0, dtype=torch.float16)
    ref = ref_linear(x, fmt, raw, K)
    with kernels.use_isa(isa):
        y = kernels.qlinear(x, raw, scales, fmt, K)
        # a token's result does not depend on the tokens it shares a call with
        y1 = kernels.qlinear(x[-1:], raw, scales, fmt, K)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert max_rel(y, ref) < 1e-5
    assert torch.equal(y[-1:], y1)
    # and the library's torch reference agrees
    assert max_rel(kernels.qlinear_ref(x, raw, scales, fmt, K), ref) < 1e-5


X86 = [i for i in NATIVE if i != "generic"]


@pytest.mark.skipif(len(X86) < 2, reason="needs two x86 kernel tables")
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 13, 16, 23, 64, 512])
def test_k_quants_same_bits_on_every_x86_table(fmt, M):
    """The AVX-512 tables' K-quant kernels (quants gathered into the activations' lane order;
    from 8 tokens on, tokens in pairs sharing a register) add the same integer sums and take
    the same float steps as the 256-bit transposing kernel of the AVX2 tables: the same bits,
    at every token count."""
    K, N = 4 * 256, 45
    raw = random_raw(fmt, (N,), K, seed=M + 100)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + 100))
    scales = torch.empty(N, 0, dtype=torch.float16)
    ys = {}
    for isa in X86:
        with kernels.use_isa(isa):
            ys[isa] = kernels.qlinear(x, raw, scales, fmt, K)
    assert max_rel(ys[X86[0]], ref_linear(x, fmt, raw, K)) < 1e-5
    for isa in X86[1:]:
        assert torch.equal(ys[isa], ys[X86[0]]), isa


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("K, N", [(256, 1), (256, 7), (9 * 256, 3), (5 * 256, 4 * 13 + 3), (2 * 256, 64)])
def test_q6_k_one_token_awkward_sizes(isa, K, N):
    """Q6_K's one-token product (the AVX-512 tables take their own kernel for it) at widths of
    1 to 9 super-blocks and row counts that leave rows outside the 4 streams: within the
    reference's tolerance, and the same bits as the token computed among others (there the
    multi-token kernels run), and on every x86 table."""
    raw = random_raw("q6_k", (N,), K, seed=K + N)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(K * N))
    scales = torch.empty(N, 0, dtype=torch.float16)
    with kernels.use_isa(isa):
        y1 = kernels.qlinear(x[1:2], raw, scales, "q6_k", K)
        y3 = kernels.qlinear(x, raw, scales, "q6_k", K)
    assert max_rel(y1, ref_linear(x[1:2], "q6_k", raw, K)) < 1e-5
    assert torch.equal(y1[0], y3[1])
    if isa in X86:
        with kernels.use_isa(X86[0]):
            assert torch.equal(y1, kernels.qlinear(x[1:2], raw, scales, "q6_k", K))


@pytest.mark.parametrize("isa", NATIVE)
def test_qlinear_multi_mixed_formats(isa):
    """One call over weights in several formats (a raw one beside int4)."""
    K = 512
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, K, generator=g)
    a = random_raw("q4_k", (20,), K, seed=5)
    b = random_raw("q6_k", (9,), K, seed=6)
    q, s = formats.quantize(torch.randn(11, K, generator=g) * 0.05, "int4")
    e = torch.empty(0, 0, dtype=torch.float16)
    with kernels.use_isa(isa):
        ya, yb, yq = kernels.qlinear_multi(x, [(a, e.new_empty(20, 0), "q4_k"), (b, e.new_empty(9, 0), "q6_k"),
                                               (q, s, "int4")])
    assert max_rel(ya, ref_linear(x, "q4_k", a, K)) < 1e-5
    assert max_rel(yb, ref_linear(x, "q6_k", b, K)) < 1e-5
    assert max_rel(yq, kernels.qlinear_ref(x, q, s, "int4", K)) < 1e-5


def test_width_not_a_block_multiple():
    for fmt in ("q4_k", "q5_k", "q6_k"):
        with pytest.raises(ValueError, match="multiple"):
            QuantizedLinear(300, 8, fmt)
        with pytest.raises(ValueError, match="multiple"):
            QuantizedExperts(2, 256, 200, "q5_0", down_fmt=fmt)  # down's input width 200
        with pytest.raises(ValueError):
            ggml.row_bytes(fmt, 128)
    with pytest.raises(ValueError, match="multiple"):
        QuantizedLinear(48, 8, "q5_0")
    # the native op refuses it too, with one line
    nat = kernels._native()
    if nat is not None:
        raw = torch.zeros(4, 144, dtype=torch.uint8)
        with pytest.raises(ValueError, match="multiple"):
            nat.qlinear(torch.zeros(1, 250).numpy(), raw.numpy(), torch.empty(4, 0, dtype=torch.float16).numpy(),
                        torch.zeros(1, 4).numpy(), formats.FORMATS["q4_k"])
        with pytest.raises(ValueError, match="fmt"):
            nat.qlinear(torch.zeros(1, 256).numpy(), raw.numpy(), torch.empty(4, 0, dtype=torch.float16).numpy(),
                        torch.zeros(1, 4).numpy(), 115)


def _raw_experts(E, H, I, fmt, down_fmt, seed):
    m = QuantizedExperts(E, H, I, fmt, down_fmt=down_fmt)
    with torch.no_grad():
        m.gate_q.copy_(random_raw(fmt, (E, I), H, seed))
        m.up_q.copy_(random_raw(fmt, (E, I), H, seed + 1))
        m.down_q.copy_(random_raw(down_fmt or fmt, (E, H), I, seed + 2))
    return m


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("fmt,down_fmt", [("q4_k", "q6_k"), ("q5_k", None), ("q6_k", "q4_k"), ("q5_0", "q5_k"),
                                          ("q4_k", "int4")])
@pytest.mark.parametrize("T", [1, 3, 16, 64])
def test_moe_experts_raw(isa, fmt, down_fmt, T):
    E, H, I, K = 4, 512, 256, 2
    if down_fmt == "int4":
        m = QuantizedExperts(E, H, I, fmt, down_fmt="int4")
        with torch.no_grad():
            m.gate_q.copy_(random_raw(fmt, (E, I), H, 11))
            m.up_q.copy_(random_raw(fmt, (E, I), H, 12))
            q, s = formats.quantize(torch.randn(E, H, I) * 0.05, "int4")
            m.down_q.copy_(q)
            m.down_scales.copy_(s)
    else:
        m = _raw_experts(E, H, I, fmt, down_fmt, seed=T)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    ref = kernels.moe_experts_ref(x, ids, w, m.gate_q, m.gate_scales, m.up_q, m.up_scales, m.down_q, m.down_scales,
                                  fmt, I, m.down_fmt)
    with kernels.use_isa(isa):
        y = m(x, ids, w)
        # the fused MoE half takes the same experts (one code for both formats)
        v = m.fused_views(x)
        assert v.code == formats.expert_code(fmt, m.down_fmt)
        # per-expert lists as an expert store gives them: the same bits
        y_list = kernels.moe_experts(x, ids, w, list(m.gate_q), list(m.gate_scales), list(m.up_q), list(m.up_scales),
                                     list(m.down_q), list(m.down_scales), fmt, I, down_fmt=m.down_fmt)
    assert max_rel(y, ref) < 1e-2 and norm_rel(y, ref) < 1e-4
    assert torch.equal(y, y_list)


def test_moe_block_raw_experts():
    """The fused MoE half (moe_block) with q4_k gate/up and q6_k down experts equals the
    separate ops."""
    E, H, I, K, T = 4, 256, 256, 2, 3
    m = _raw_experts(E, H, I, "q4_k", "q6_k", seed=21)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g)
    norm_w = torch.rand(H, generator=g) + 0.5
    router = torch.randn(E, H, generator=g)
    args = kernels.moe_block_args(norm_w, 1e-6, 0.0, router, K, True, m.fused_views(x))
    y = kernels.moe_block_run(x, args)
    h = kernels.rms_norm(x, norm_w, 1e-6)
    w, ids = kernels.route_softmax_topk(h, router, K, True)
    ref = x + m(h, ids, w)
    assert max_rel(y, ref) < 1e-5


@pytest.mark.parametrize("fmt", RAW)
def test_quantized_linear_module(fmt):
    """QuantizedLinear holding raw rows: buffers as the GGUF reader fills them, forward on the
    native path and on torch's."""
    K, N = 512, 24
    lin = QuantizedLinear(K, N, fmt, bias=True)
    assert lin.qweight.dtype == torch.uint8 and lin.qweight.shape == (N, ggml.row_bytes(fmt, K))
    assert lin.scales.dtype == torch.float16 and lin.scales.shape == (N, 0)
    with torch.no_grad():
        lin.qweight.copy_(random_raw(fmt, (N,), K, seed=9))
        lin.bias.normal_()
    x = torch.randn(2, 5, K, generator=torch.Generator().manual_seed(0))
    ref = ref_linear(x.reshape(-1, K), fmt, lin.qweight, K).reshape(2, 5, N) + lin.bias
    y = lin(x)
    with kernels.use_isa("torch"):
        yt = lin(x)
    assert max_rel(y, ref) < 1e-5 and max_rel(yt, ref) < 1e-5
    # float product against the dequantized weights: only the activations' int8 rounding
    w = ggml.dequantize(fmt, lin.qweight, K)
    assert norm_rel(y, x @ w.T + lin.bias) < 2e-2


def test_tiny_model_forward_with_raw_modules():
    """A decode-sized pass of a tiny MoE block built from raw-format modules: experts
    (q4_k gate/up, q6_k down) and a q5_0 shared projection, natively and in torch."""
    E, H, I, K = 4, 256, 256, 2
    experts = _raw_experts(E, H, I, "q4_k", "q6_k", seed=31)
    proj = QuantizedLinear(H, H, "q5_0")
    with torch.no_grad():
        proj.qweight.copy_(random_raw("q5_0", (H,), H, seed=32))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(6)])
    w = torch.softmax(torch.randn(6, K, generator=g), -1)

    def forward():
        return proj(experts(x, ids, w) + x)

    y = forward()
    with kernels.use_isa("torch"):
        yt = forward()
    assert torch.isfinite(y).all()
    assert norm_rel(y, yt) < 1e-3


@pytest.mark.parametrize("isa", NATIVE)
def test_swiglu_mlp_raw(isa):
    """A dense MLP / shared expert in raw formats (q4_k gate/up, q6_k down) through the fused op."""
    H, I = 256, 512
    e = torch.float16
    gate = (random_raw("q4_k", (I,), H, 41), torch.empty(I, 0, dtype=e), "q4_k")
    up = (random_raw("q4_k", (I,), H, 42), torch.empty(I, 0, dtype=e), "q4_k")
    down = (random_raw("q6_k", (H,), I, 43), torch.empty(H, 0, dtype=e), "q6_k")
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(6))
    ref = kernels.swiglu_mlp_ref(x, gate, up, down)
    with kernels.use_isa(isa):
        y = kernels.swiglu_mlp(x, gate, up, down)
    assert max_rel(y, ref) < 1e-2 and norm_rel(y, ref) < 1e-4
