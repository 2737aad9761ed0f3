"""llama.cpp's raw block formats as moerun holds them (docs/design/gguf.md): block sizes, row
bytes and the torch reference dequantization that every native kernel is compared against.

A weight row in a raw format is its GGUF blocks byte for byte, as in the file:

- **q5_0** (GGML type 6): blocks of 32 inputs in 22 bytes: fp16 d, 4 bytes qh (bit i: the
  fifth bit of element i), 16 bytes of nibbles (byte j: element j low, element j + 16 high);
  w = d * (q - 16).
- **q4_k** (12): super-blocks of 256 inputs in 144 bytes: fp16 d, fp16 dmin, 12 bytes of
  6-bit scales and mins of the 8 sub-blocks of 32, 128 bytes of nibbles (32 bytes per 64
  inputs: sub-block 2c in the low nibbles, 2c + 1 in the high ones); w = d * sc * q - dmin * m.
- **q5_k** (13): 176 bytes: like q4_k with 32 bytes qh after the scales (bit s of byte l: the
  fifth bit of element l of sub-block s).
- **q6_k** (14): 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8
  scales (one per 16 inputs), fp16 d; w = d * sc * (q - 32).

Imports only torch.
"""

from __future__ import annotations

import torch

# format -> (inputs per block, bytes per block, GGML type id)
BLOCKS = {"q5_0": (32, 22, 6), "q4_k": (256, 144, 12), "q5_k": (256, 176, 13), "q6_k": (256, 210, 14)}
FORMATS = tuple(BLOCKS)
CODES = {f: 100 + BLOCKS[f][2] for f in BLOCKS}  # the native kernels' format codes (csrc/kernels.h)


def is_raw(fmt: str) -> bool:
    return fmt in BLOCKS


def block_elems(fmt: str) -> int:
    return BLOCKS[fmt][0]


def block_bytes(fmt: str) -> int:
    return BLOCKS[fmt][1]


def check_width(fmt: str, k: int) -> None:
    """ValueError unless an input width of k is a whole number of fmt's blocks."""
    be = BLOCKS[fmt][0]
    if k <= 0 or k % be:
        raise ValueError(f"{fmt}: an input width of {k} is not a multiple of its block of {be} inputs")


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of k inputs (k a multiple of the block size)."""
    check_width(fmt, k)
    be, bb, _ = BLOCKS[fmt]
    return k // be * bb


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return raw.contiguous().view(torch.float16)[..., 0].float()


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] uint8 of a q4_k / q5_k super-block -> scales and mins [..., 8] float32."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1).float(), torch.cat([lo_m, hi_m], -1).float()


def _bits(v: torch.Tensor, n: int) -> torch.Tensor:
    """[..., m] uint8 -> [..., m, n]: bit j of each byte (int32)."""
    return (v.to(torch.int32)[..., None] >> torch.arange(n, dtype=torch.int32)) & 1


def quants(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """Raw blocks [..., block bytes] -> their unsigned quants [..., block inputs] (int32) in
    element order."""
    b = blocks.to(torch.int32)
    if fmt == "q5_0":
        qs = b[..., 6:22]
        q = torch.cat([qs & 0xF, qs >> 4], -1)  # [..., 32]
        qh = _bits(blocks[..., 2:6], 8).reshape(*blocks.shape[:-1], 32)
        return q | (qh << 4)
    if fmt in ("q4_k", "q5_k"):
        qs = b[..., 48:176] if fmt == "q5_k" else b[..., 16:144]
        qs = qs.reshape(*b.shape[:-1], 4, 32)
        q = torch.stack([qs & 0xF, qs >> 4], -2).reshape(*b.shape[:-1], 256)  # sub-block 2c, then 2c + 1
        if fmt == "q5_k":
            hb = _bits(blocks[..., 16:48], 8)  # [..., 32 (l), 8 (sub-block)]
            q = q | (hb.transpose(-1, -2).reshape(*b.shape[:-1], 256) << 4)
        return q
    if fmt == "q6_k":
        ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)  # [half, first / second 32 bytes, l]
        qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
        lo = torch.cat([ql & 0xF, ql >> 4], -2)  # [half, 4 (m: 0 1 low nibbles, 2 3 high), 32]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32)[:, None]
        hi = (qh >> shifts) & 3  # [half, 4, 32]
        return (lo | (hi << 4)).reshape(*b.shape[:-1], 256)
    raise ValueError(f"not a raw format: {fmt!r}")


def scales(fmt: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Raw blocks [..., block bytes] -> (scale, offset, sub): per sub-block of `sub` inputs
    w = scale * q - offset, both [..., block inputs / sub] float32."""
    if fmt == "q5_0":
        d = _f16(blocks[..., 0:2])[..., None]
        return d, 16.0 * d, 32
    if fmt in ("q4_k", "q5_k"):
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
        sc, m = _k_scales(blocks[..., 4:16])
        return d * sc, dmin * m, 32
    if fmt == "q6_k":
        d = _f16(blocks[..., 208:210])[..., None]
        s = d * blocks[..., 192:208].contiguous().view(torch.int8).float()
        return s, 32.0 * s, 16
    raise ValueError(f"not a raw format: {fmt!r}")


def dequantize(fmt: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """Raw rows [..., row_bytes(fmt, k)] (uint8) -> float32 [..., k]."""
    be, bb, _ = BLOCKS[fmt]
    rb = row_bytes(fmt, k)
    if raw.shape[-1] != rb:
        raise ValueError(f"{fmt}: rows of {raw.shape[-1]} bytes, expected {rb} for {k} inputs")
    blocks = raw.view(torch.uint8).reshape(*raw.shape[:-1], k // be, bb)
    q = quants(fmt, blocks).float()  # [..., nblk, be]
    scale, offset, sub = scales(fmt, blocks)
    q = q.reshape(*q.shape[:-1], be // sub, sub)
    w = q * scale[..., None] - offset[..., None]
    return w.reshape(*raw.shape[:-1], k)
