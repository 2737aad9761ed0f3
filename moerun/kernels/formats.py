"""Block-quantized weight formats: int4 and int8 in groups of 32, one fp16 scale per group.

Both formats cut each weight row (one output channel) into blocks of 32 inputs, the input
dimension padded with zeros to a multiple of 32, and keep one fp16 scale `d` per block:

- **int4, symmetric** (no zero point): `w = d * q`, `q` in [-8, 7]. `d` is the block's value
  of largest magnitude divided by -8, so that value is represented exactly and the full 16
  levels are used (the llama.cpp Q4_0 rule, so both engines store the same 4.5 bits per
  weight). Why symmetric: the kernels take integer dot products against int8 activations,
  and with a zero point every block would need an extra term `zero * sum(x)` and 2 more
  bytes (11% more to stream per decoded token); trained weights are close to symmetric
  around 0 within a block, where a zero point buys little accuracy. Same bits as llama.cpp
  Q4_0 also keeps the side-by-side benchmark fair.
- **int8, per group of 32**: `w = d * q`, `q` in [-127, 127], `d = absmax / 127` (llama.cpp
  Q8_0). Per-group rather than per-channel scales cost 6% bytes and make the int8 and int4
  kernels one code path (same blocks, same activation quantization).

Packed layout, the one the kernels stream (csrc/kernels.h): weight `[..., N, K]` becomes
`qweight [..., N, nb * 16]` uint8 (int4) or `[..., N, nb * 32]` int8, and `scales [..., N, nb]`
float16, nb = ceil(K / 32). Each row's blocks are contiguous, so a GEMV streams every row front
to back once. Within a block (its *natural* layout) int4 byte j holds element j in the low
nibble and element j + 16 in the high nibble, as q + 8; int8 byte j is element j.

Each run of 8 whole blocks of a row (a *group*) is stored with its 4-byte words interleaved:
word k of block j of the group lies at word k * 8 + j (format version 2). One 32-byte load then
holds the same 4-byte slice of 8 blocks, so the integer dot products of a group's 8 blocks
build up lane by lane (lane j: block j) and are scaled once per group by the 8 scales as they
are stored, where the natural layout needs a conversion and a scale shuffle per block (with
it the AVX2 int4 GEMM of 48 tokens went from ~21 to 55-66 GMAC/s on one thread,
`benchmarks/gemm.py`, together with the kernels' other changes of that session). The last
nb % 8 blocks of a row stay natural.
`natural_blocks` undoes the interleaving (the llama.cpp blocks of benchmarks/vs_llamacpp.py).

Activations are quantized to int8 in the same blocks of 32 (`d = absmax / 127`, round to
nearest even) once per token; `quantize_activations` is the reference of the native one.

The raw formats `q4_k`, `q5_k`, `q6_k`, `q5_0` are llama.cpp's blocks as a GGUF file holds them
(`moerun.kernels.ggml`, docs/design/gguf.md): `qweight` uint8 [..., N, row bytes] (each row its
blocks byte for byte), `scales` float16 [..., N, 0] (the scales are in the blocks). This module
runs their references (`dequantize`, `matmul_ref`) but does not make them.
"""

from __future__ import annotations

import torch

GROUP = 32
# name -> the native kernels' code (csrc/kernels.h; the raw ones 100 + their GGML type id, as
# moerun.kernels.ggml.CODES)
FORMATS = {"int4": 4, "int8": 8, "q5_0": 106, "q4_k": 112, "q5_k": 113, "q6_k": 114}
RAW_FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0")


def is_raw(fmt: str) -> bool:
    return fmt in RAW_FORMATS


def _ggml():
    from ..kernels import ggml  # (lazily: moerun.kernels imports this module)

    return ggml


def packed_shape(fmt: str, k: int) -> tuple[int, int, torch.dtype]:
    """(bytes per packed row of k inputs, fp16 scales per row, qweight dtype) of fmt; a raw
    format's k must be a multiple of its block (ValueError)."""
    if is_raw(fmt):
        return _ggml().row_bytes(fmt, k), 0, torch.uint8
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; formats: {', '.join(FORMATS)}")
    nb = blocks(k)
    return (nb * GROUP // 2, nb, torch.uint8) if fmt == "int4" else (nb * GROUP, nb, torch.int8)


# llama.cpp's fallback (llama_tensor_get_type) for rows that are not a whole number of a
# K-quant's 256-wide super-blocks; int8 is moerun's Q8_0
FALLBACK = {"q4_k": "q5_0", "q5_k": "int8", "q6_k": "int8", "q5_0": "int8"}


def fit(fmt: str, k: int) -> str:
    """The format a row of k inputs gets under `fmt`: fmt itself, or llama.cpp's fallback
    when k is not a multiple of fmt's block (q4_k -> q5_0, q5_k / q6_k -> int8)."""
    while is_raw(fmt) and k % _ggml().block_elems(fmt):
        fmt = FALLBACK[fmt]
    return fmt


def expert_code(fmt: str, down_fmt: str | None = None) -> int:
    """Routed experts' native code: gate/up's format, with down's in the second byte where
    it differs (csrc/kernels.h expert_fmt)."""
    g, d = FORMATS[fmt], FORMATS[down_fmt or fmt]
    return g if g == d else g | d << 8


def blocks(k: int) -> int:
    return (k + GROUP - 1) // GROUP


def _blocked(w: torch.Tensor) -> torch.Tensor:
    """[..., K] float -> [..., nb, 32] float32, zero padded."""
    k = w.shape[-1]
    pad = blocks(k) * GROUP - k
    w = w.float()
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(*w.shape[:-1], -1, GROUP)


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [..., N, K] -> (qweight, scales) in the packed layout of `fmt`."""
    if fmt == "int4":
        return quantize_int4(w)
    if fmt == "int8":
        return quantize_int8(w)
    if is_raw(fmt):  # llama.cpp's reference quantizer; the blocks carry their scales
        from .ggml_quant import quantize as ggml_quantize

        q = ggml_quantize(fmt, w)
        return q, torch.zeros(*q.shape[:-1], 0, dtype=torch.float16)
    raise ValueError(f"unknown quantization format {fmt!r}; formats: {', '.join(FORMATS)}")


# int4 / int8 blocks are llama.cpp's Q4_0 / Q8_0 blocks byte for byte (quantize_row_q4_0_ref,
# quantize_row_q8_0_ref; moerun.kernels.ggml_quant): the quants are computed against the scale
# before it is rounded to fp16 (Q8_0: roundf, halves away from zero; Q4_0: trunc(x / d + 8.5)).
# Computing them against the stored fp16 scale instead (as moerun did until 2026-12-03) changed
# a quant in ~20% of Q8_0 blocks (0.7% of quants) and ~1-4% of Q4_0 blocks, for a round-trip
# error smaller by 0.06% (docs/design/quantization.md).


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .ggml_quant import q4_0_levels

    b = _blocked(w)  # [..., nb, 32]
    d, q = q4_0_levels(b.reshape(-1, GROUP))
    q = q.reshape(b.shape).to(torch.int16)  # q + 8, in 0..15
    packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)  # [..., nb, 16]
    return _interleave(packed), d.reshape(b.shape[:-1]).half().contiguous()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .ggml_quant import q8_0_levels

    b = _blocked(w)
    d, q = q8_0_levels(b.reshape(-1, GROUP))
    return _interleave(q.reshape(b.shape)), d.reshape(b.shape[:-1]).half().contiguous()


def _interleave(blocks: torch.Tensor) -> torch.Tensor:
    """Natural blocks [..., nb, bytes] -> packed rows [..., nb * bytes], groups interleaved."""
    nb, per = blocks.shape[-2:]
    head = nb // 8 * 8
    g = blocks[..., :head, :].reshape(*blocks.shape[:-2], head // 8, 8, per // 4, 4).transpose(-3, -2)
    rows = torch.cat([g.reshape(*blocks.shape[:-2], -1), blocks[..., head:, :].reshape(*blocks.shape[:-2], -1)], -1)
    return rows.contiguous()


def natural_blocks(qweight: torch.Tensor, fmt: str) -> torch.Tensor:
    """Packed rows [..., N, bytes] -> [..., N, nb, bytes per block] in each block's natural layout."""
    per = GROUP // 2 if fmt == "int4" else GROUP
    nb = qweight.shape[-1] // per
    head = nb // 8 * 8
    lead = qweight.shape[:-1]
    g = qweight[..., : head * per].reshape(*lead, head // 8, per // 4, 8, 4).transpose(-3, -2)
    tail = qweight[..., head * per :].reshape(*lead, nb - head, per)
    return torch.cat([g.reshape(*lead, head, per), tail], -2)


def unpack(qweight: torch.Tensor, fmt: str) -> torch.Tensor:
    """Packed qweight [..., N, bytes] -> integer q [..., N, nb, 32] (int16)."""
    p = natural_blocks(qweight, fmt)
    if fmt == "int4":
        p = p.to(torch.int16)
        return torch.cat([p & 0xF, p >> 4], dim=-1) - 8
    return p.view(torch.int8).to(torch.int16)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """-> float32 [..., N, in_features]."""
    if is_raw(fmt):
        return _ggml().dequantize(fmt, qweight, in_features)
    w = unpack(qweight, fmt).float() * scales.float()[..., None]
    return w.reshape(*w.shape[:-2], -1)[..., :in_features]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int8 [..., nb, 32], d float32 [..., nb]): the native kernels' rule."""
    b = _blocked(x)
    d = b.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None]).to(torch.int8)
    return q, d


def matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: str,
               in_features: int, quantize_x: bool = True) -> torch.Tensor:
    """Reference of the native quantized linear: x [M, K] -> [M, N] float32.

    With `quantize_x` it reproduces the kernels' arithmetic (int8 activations, integer
    block dot products), so the native result matches to float rounding; without, it is the
    float product with the dequantized weight.
    """
    if not quantize_x:
        return x.float() @ dequantize(qweight, scales, fmt, in_features).T
    if is_raw(fmt):
        # the kernels' sum over a sub-block, d_x * (scale * dot(q, x_q) - offset * sum(x_q)),
        # is the product of the dequantized weights and activations (to float rounding)
        xq, xd = quantize_activations(x.float())
        xf = (xq.float() * xd[..., None]).reshape(x.shape[0], -1)[:, :in_features]
        return xf @ dequantize(qweight, scales, fmt, in_features).T
    xq, xd = quantize_activations(x.float())  # [M, nb, 32], [M, nb]
    wq = unpack(qweight, fmt).float()  # [N, nb, 32]
    # integer block sums are exact in float32 (|sum| < 2^24)
    dots = torch.einsum("mbk,nbk->mnb", xq.float(), wq)  # [M, N, nb]
    return (dots * xd[:, None, :] * scales.float()[None]).sum(-1)
