"""Float weights -> GGUF/ggml blocks (the encoders of the formats `moerun.kernels.ggml` decodes).

`quantize(fmt, w)` turns a float weight `[..., K]` into uint8 `[..., K / block * type_size]`:
each row is its ggml blocks, byte for byte as llama.cpp writes them in a GGUF file.

| fmt | block | bytes | layout of one block |
|---|---|---|---|
| `q4_k` | 256 | 144 | fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles |
| `q5_k` | 256 | 176 | fp16 d, fp16 dmin, 12 bytes scales/mins, 32 bytes of high bits, 128 bytes nibbles |
| `q6_k` | 256 | 210 | 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, fp16 d |
| `q5_0` | 32 | 22 | fp16 d, 4 bytes of high bits, 16 bytes of nibbles (q + 16) |
| `q4_0` | 32 | 18 | fp16 d, 16 bytes of nibbles (q + 8) |
| `q8_0` | 32 | 34 | fp16 d, 32 int8 |

The algorithms are llama.cpp's reference quantizers, the ones `llama-quantize` runs when it has no
importance matrix (`quantize_q4_K(..., quant_weights=NULL)` -> `quantize_row_q4_K_ref`):

- **Q4_K / Q5_K**: each sub-block of 32 gets a scale and a min from `make_qkx2_quants`: weights
  `w_i = rms(sub-block) + |x_i|`, start from the min/max grid, then try 21 (Q5_K: 16) stretched
  grids `(nmax + rmin + rdelta * is) / (max - min)`, and for each the weighted least-squares
  scale and min of its levels (min clamped to <= 0), keeping the one of least weighted squared
  error. Scales and mins are then quantized to 6 bits against the super-block's largest
  (`d = max_scale / 63`, `dmin = max_min / 63`) and the levels are recomputed against the
  quantized scales, `round((x + dmin * m) / (d * sc))`.
- **Q6_K**: each sub-block of 16 gets a signed scale from `make_qx_quants(nmax=32,
  rmse_type=1)`: levels from `-32 / max` (max = the value of largest magnitude), then 18 nearby
  grids `-(32 + 0.1 * is) / max`, keeping the one that maximizes `(sum w x l)^2 / sum w l^2`
  with `w = x^2`. Scales become int8 against the largest (`d = -max_scale / 128`) and the levels
  are recomputed against the quantized scales.
- **Q5_0 / Q4_0 / Q8_0**: one scale per 32 from the value of largest magnitude (`max / -16`,
  `max / -8`, `absmax / 127`), levels `trunc(x * id + 16.5)` (`+ 8.5`; `x * id` rounded to
  float32 before the add, no FMA) and round half away from zero (Q8_0), all against `d` as
  computed, before it is rounded to fp16. These are byte-exact with `gguf.quants.quantize` and
  with llama-quantize of the native build (checked on the qwen3next demo file and on a block
  whose `x * id` lands next to a half-integer, tests/test_ggml_quant.py). moerun's own int8 /
  int4 (`moerun.kernels.formats`) are these Q8_0 / Q4_0 blocks (`q8_0_levels`, `q4_0_levels`).

Every search step is vectorised over all sub-blocks of a chunk of rows at once (the sub-blocks
are laid out `[32, n]`, so the sums over a sub-block are adds of 32 contiguous rows); memory is
bounded by the chunk (`_CHUNK` weights at a time), not by the tensor.

Deviations from llama.cpp: Q4_K/Q5_K's search expands each candidate grid's weighted squared
error in the sums its fit needs anyway (combined in float64) where the C code sums the
residuals one by one. Some grids put a sub-block's largest weight exactly on a half-integer
level (Q4_K: `15 - 1 + 0.1 * 5 = 14.5`; Q5_K: `31 - 0.5 = 30.5`), so which way it rounds hangs on
the last bit of the min fitted at the step before, and that bit and near-tied errors can come
out differently. Against llama.cpp's own code (ggml built from source, x86-64) on N(0, 1) rows:
Q6_K, Q4_0 and Q8_0 blocks are all byte-identical, Q5_0 all but ~1 in 10^4, Q4_K 96-97% and
Q5_K 78-83% of blocks (the rest differ in a level or a 6-bit scale), and the round-trip RMSE is the same to 4 digits for
every type (docs/design/gguf.md). The sums run row after row as the C loops do, so the bytes do
not depend on the chunking. No importance matrix (the `quantize_row_*_impl` paths).

Which block type llama-quantize gives each tensor is `moerun.quant.gguf_types.tensor_type`.
"""

from __future__ import annotations


import numpy as np
import torch

QK_K = 256

# fmt -> (weights per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES
BLOCKS: dict[str, tuple[int, int]] = {
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "q5_0": (32, 22),
    "q4_0": (32, 18),
    "q8_0": (32, 34),
}

# weights quantized per step; bounds the working memory (~30 float32 temporaries of this size,
# 1 MiB each). Smaller chunks spend the time launching ops, larger ones miss the caches.
_CHUNK = 1 << 18

_F32 = np.float32
GROUP_MAX_EPS = 1e-15


def row_bytes(fmt: str, k: int) -> int:
    block, size = BLOCKS[fmt]
    if k % block:
        raise ValueError(f"{fmt}: a row of {k} weights is not a multiple of its block of {block}")
    return k // block * size


def quantize(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """Float weight `[..., K]` -> uint8 `[..., K / block * type_size]`, ggml blocks per row.

    `fmt` is one of `q4_k`, `q5_k`, `q6_k`, `q5_0`, `q4_0`, `q8_0`; K must be a multiple of the
    block (256 for the K-quants, 32 otherwise), else ValueError. Any float dtype is accepted
    (bf16 and fp16 are widened to float32 first, exactly).
    """
    if fmt not in BLOCKS:
        raise ValueError(f"unknown ggml format {fmt!r}: expected one of {', '.join(BLOCKS)}")
    if not torch.is_floating_point(w):
        raise ValueError(f"{fmt}: expected a float tensor, got {w.dtype}")
    if w.dim() == 0:
        raise ValueError(f"{fmt}: expected a tensor with a row dimension, got a scalar")
    block, size = BLOCKS[fmt]
    k = w.shape[-1]
    nbytes = row_bytes(fmt, k)
    lead = tuple(w.shape[:-1])
    rows = w.reshape(-1, k)
    out = torch.empty(rows.shape[0], nbytes, dtype=torch.uint8)
    if rows.shape[0] == 0 or k == 0:
        return out.reshape(*lead, nbytes)
    fn = _QUANTIZERS[fmt]
    step = max(1, _CHUNK // k)
    for r0 in range(0, rows.shape[0], step):
        x = rows[r0 : r0 + step].to(torch.float32).reshape(-1, block)
        out[r0 : r0 + step] = fn(x).reshape(-1, nbytes)
    return out.reshape(*lead, nbytes)


# ---------------------------------------------------------------------------------------------
# helpers


def _f32(v: float) -> float:
    """A Python float holding the float32 value C computes for a float expression."""
    return float(_F32(v))


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """roundf: halves away from zero (torch.round is half to even)."""
    a = x.abs()
    f = a.floor()
    return torch.copysign(f + (2 * (a - f)).floor(), x)


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [n] -> uint8 [n, 2], the fp16 value little-endian (round to nearest even)."""
    return v.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _fp16(v: torch.Tensor) -> torch.Tensor:
    """The float32 value of v after a round trip through fp16 (GGML_FP16_TO_FP32(FP32_TO_FP16))."""
    return v.to(torch.float16).to(torch.float32)


def _pack_nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo & 0xF) | ((hi & 0xF) << 4)


def _bits_le(bits: torch.Tensor) -> torch.Tensor:
    """[n, 8*m] of 0/1 -> uint8 [n, m], bit j of byte b = element 8b + j."""
    n = bits.shape[0]
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (bits.reshape(n, -1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------
# the legacy 32-weight formats


def _absmax_signed(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude of each row (the first one on ties), signed."""
    idx = x.abs().argmax(-1, keepdim=True)
    return x.gather(-1, idx)


def q8_0_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_row_q8_0_ref on blocks x [..., 32] (float32): -> (d [...] float32, not yet
    rounded to fp16; q [..., 32] int8). The quants are computed against d as computed, not
    against the fp16 value stored (`roundf(x * (1 / d))`, halves away from zero)."""
    d = x.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return d.squeeze(-1), _round_away(x * inv).to(torch.int8)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d, q = q8_0_levels(x)
    return torch.cat([_fp16_bytes(d), q.view(torch.uint8)], -1)


def q4_0_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_row_q4_0_ref on blocks x [..., 32] (float32): -> (d [...] float32, not yet
    rounded to fp16; q + 8 [..., 32] uint8 in 0..15), against d as computed."""
    return _legacy_levels(x, 8)


def _legacy_levels(x: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 (half=8) / Q5_0 (half=16): d = max / -half, q = trunc(x / d + half + 0.5)."""
    d = _absmax_signed(x) / -half
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    # (x * inv) rounded to float32, then + (half + 0.5) rounded again: no FMA, as llama.cpp's
    # native build (llama-quantize) and gguf-py compute it (an FMA's one rounding differs where
    # x / d lands on a half-integer, e.g. bf16 weights: ~0.5% of Q4_0 blocks)
    v = (x * inv + (half + 0.5)).trunc()
    q = v.clamp(0, 2 * half - 1).to(torch.uint8)
    return d.squeeze(-1), q


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _legacy_levels(x, 8)
    return torch.cat([_fp16_bytes(d), _pack_nibbles(q[:, :16], q[:, 16:])], -1)


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _legacy_levels(x, 16)
    qh = _bits_le(q >> 4)
    return torch.cat([_fp16_bytes(d), qh, _pack_nibbles(q[:, :16], q[:, 16:])], -1)


# ---------------------------------------------------------------------------------------------
# K-quants. Sub-blocks are laid out [B, n]: column i is sub-block i, so per-sub-block scalars
# are [n] rows that broadcast, and the sums over a sub-block reduce dim 0.


def _qkx2(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants on every column: -> (scale [n], the_min [n] (>= 0), levels [B, n]).

    Each candidate grid's weighted squared error is expanded in the sums that its
    least-squares fit needs anyway (sum w, w x, w x^2, w l, w l^2, w x l), combined in
    float64, where llama.cpp sums the squared residuals element by element; the two agree to
    float32 rounding. The levels are recomputed once at the end from the winning grid.
    """
    f64 = torch.float64
    sum_w = _colsum(w)
    wx = w * x
    sum_x = _colsum(wx)
    sum_x2 = _colsum(wx * x).to(f64)
    mn = x.amin(0).clamp(max=0.0)
    mx = x.amax(0)
    live = mx != mn  # a flat sub-block keeps levels 0, scale 0
    one = torch.ones_like(mx)

    lv = torch.empty_like(x)  # the levels of the grid being tried
    tmp = torch.empty_like(x)

    def levels_of(mn_used, iscale):
        torch.sub(x, mn_used, out=lv)
        return lv.mul_(iscale).round_().clamp_(0, nmax)

    def sums(l):
        torch.mul(w, l, out=tmp)
        sl = _colsum(tmp)
        sl2 = _colsum(tmp.mul_(l))
        sxl = _colsum(torch.mul(wx, l, out=tmp))
        return sl, sl2, sxl

    sw64 = sum_w.to(f64)
    sx64 = sum_x.to(f64)

    def error(scale, the_min, sl, sl2, sxl):
        # sum w (scale l + min - x)^2, expanded
        s = scale.to(f64)
        m = the_min.to(f64)
        return (
            s * (s * sl2.to(f64) + 2 * m * sl.to(f64) - 2 * sxl.to(f64))
            + m * (m * sw64 - 2 * sx64)
            + sum_x2
        )

    iscale = nmax / torch.where(live, mx - mn, one)
    scale = 1 / iscale
    used_mn, used_iscale = mn, iscale
    best = error(scale, mn, *sums(levels_of(mn, iscale)))
    for step in range(nstep + 1):
        grid = _f32(_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax))
        iscale = grid / torch.where(live, mx - mn, one)
        sl, sl2, sxl = sums(levels_of(mn, iscale))
        det = _fms(sum_w, sl2, sl, sl)
        ok = live & (det > 0)
        det = torch.where(ok, det, one)
        this_scale = _fms(sum_w, sxl, sum_x, sl) / det
        this_min = _fms(sl2, sum_x, sl, sxl) / det
        pos = this_min > 0
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(pos, sxl / torch.where(ok, sl2, one), this_scale)
        err = error(this_scale, this_min, sl, sl2, sxl)
        better = ok & (err < best)
        used_mn = torch.where(better, mn, used_mn)
        used_iscale = torch.where(better, iscale, used_iscale)
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    levels = levels_of(used_mn, used_iscale).clone()
    scale = torch.where(live, scale, torch.zeros_like(scale))
    levels = torch.where(live, levels, torch.zeros_like(levels))
    return scale, -mn, levels


def _colsum(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0, row after row in float32: the order of llama.cpp's C loops.

    The order must not depend on the shape of a chunk (torch's reductions pick theirs by shape):
    the searches resolve exact ties on the last bit of these sums (the max element of a sub-block
    lands on a half-integer level in some grids, see _qkx2), so another order changes some bytes.
    """
    acc = t[0] + t[1]
    for i in range(2, t.shape[0]):
        acc.add_(t[i])
    return acc


def _fms(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """a * b - c * d in float32 as FMA-contracting C compilers evaluate it: fma(a, b, -(c * d))."""
    cd = (c * d).double()
    return (a.double() * b.double() - cd).float()


def _pack_scales_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins [nb, 8] (int) -> the 12 bytes of Q4_K/Q5_K (get_scale_min_k4)."""
    lo_s, hi_s = ls[:, :4], ls[:, 4:]
    lo_m, hi_m = lm[:, :4], lm[:, 4:]
    b0 = lo_s | ((hi_s >> 4) << 6)
    b1 = lo_m | ((hi_m >> 4) << 6)
    b2 = (hi_s & 0xF) | ((hi_m & 0xF) << 4)
    return torch.cat([b0, b1, b2], 1).to(torch.uint8)


def _kquant_minmax(x: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Q4_K / Q5_K up to the levels: x [nb, 256] -> (d, dmin fp16 bytes, scales 12 bytes, L [nb, 256])."""
    nb = x.shape[0]
    xs = x.reshape(nb * 8, 32).t().contiguous()  # [32, n]
    av = (_colsum(xs * xs) / 32).sqrt()
    w = av + xs.abs()
    scales, mins, levels = _qkx2(xs, w, nmax, rmin, rdelta, nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    # the largest scale and min, from 0 up (a -0.0 must not reach the fp16 bytes)
    max_scale = scales.amax(1)
    max_scale = torch.where(max_scale > 0, max_scale, 0.0)
    max_min = mins.amax(1)
    max_min = torch.where(max_min > 0, max_min, 0.0)
    inv_s = torch.where(max_scale > 0, 63 / torch.where(max_scale > 0, max_scale, 1.0), 0.0)
    inv_m = torch.where(max_min > 0, 63 / torch.where(max_min > 0, max_min, 1.0), 0.0)
    # uint8_t ls = nearest_int(inv_scale * scale); MIN(63, ls)
    ls = ((inv_s[:, None] * scales).round().to(torch.int64) & 0xFF).clamp(max=63)
    lm = ((inv_m[:, None] * mins).round().to(torch.int64) & 0xFF).clamp(max=63)
    d = max_scale / 63
    dmin = max_min / 63
    dl = _fp16(d)[:, None] * ls.to(torch.float32)  # [nb, 8]
    ml = _fp16(dmin)[:, None] * lm.to(torch.float32)
    dl_c = dl.reshape(-1)  # per sub-block, matches the columns of xs
    ml_c = ml.reshape(-1)
    nz = dl_c != 0
    req = ((xs + ml_c) / torch.where(nz, dl_c, torch.ones_like(dl_c))).round_().clamp_(0, nmax)
    levels = torch.where(nz, req, levels)
    L = levels.t().reshape(nb, 256).to(torch.uint8)
    head = torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), _pack_scales_k4(ls, lm)], 1)
    return head, L


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    head, L = _kquant_minmax(x, 15, -1.0, 0.1, 20)
    q = L.reshape(-1, 4, 2, 32)
    qs = _pack_nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    return torch.cat([head, qs], 1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    head, L = _kquant_minmax(x, 31, -0.5, 0.1, 15)
    q = L.reshape(-1, 4, 2, 32)
    qs = _pack_nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    # qh[j] bit 2c: high bit of L[64c + j]; bit 2c + 1: of L[64c + 32 + j]
    hb = (q >> 4).reshape(-1, 8, 32).to(torch.int64)  # [nb, (c, half), j]
    shifts = torch.arange(8, dtype=torch.int64).reshape(1, 8, 1)
    qh = (hb << shifts).sum(1).to(torch.uint8)
    return torch.cat([head[:, :16], qh, qs], 1)


def _qx(x: torch.Tensor, nmax: int):
    """make_qx_quants(rmse_type=1, no weights) on every column: -> (scale [n], L [B, n] in 0..2nmax-1)."""
    amax, idx = x.abs().max(0)
    mx = x.gather(0, idx[None]).squeeze(0)
    zero = amax < GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x
    wx = w * x

    lv = torch.empty_like(x)
    tmp = torch.empty_like(x)

    def levels_of(iscale):
        return torch.mul(x, iscale, out=lv).round_().clamp_(-nmax, nmax - 1)

    def fit(iscale):
        l = levels_of(iscale)
        slx = _colsum(torch.mul(wx, l, out=tmp))
        torch.mul(w, l, out=tmp)
        return slx, _colsum(tmp.mul_(l))

    iscale = -nmax / mx
    used = iscale
    sumlx, suml2 = fit(iscale)
    scale = torch.where(suml2 != 0, sumlx / torch.where(suml2 != 0, suml2, torch.ones_like(suml2)), 0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        grid = _f32(_F32(nmax) + _F32(0.1) * _F32(step))
        iscale = -grid / mx
        slx, sl2 = fit(iscale)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        this = slx / torch.where(sl2 > 0, sl2, torch.ones_like(sl2))
        used = torch.where(better, iscale, used)
        scale = torch.where(better, this, scale)
        best = torch.where(better, this * slx, best)
    levels = levels_of(used).clone() + nmax
    levels = torch.where(zero, torch.zeros_like(levels), levels)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, levels


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16).t().contiguous()  # [16, n]
    scales, levels = _qx(xs, 32)
    scales = scales.reshape(nb, 16)
    amax, idx = scales.abs().max(1)
    max_scale = scales.gather(1, idx[:, None]).squeeze(1)
    zero = amax < GROUP_MAX_EPS
    max_scale = torch.where(zero, torch.ones_like(max_scale), max_scale)
    iscale = -128 / max_scale
    d = torch.where(zero, torch.zeros_like(iscale), 1 / iscale)
    sc = (iscale[:, None] * scales).round().clamp(-128, 127)
    sc = torch.where(zero[:, None], torch.zeros_like(sc), sc)
    dl = (_fp16(d)[:, None] * sc).reshape(-1)
    nz = dl != 0
    req = (xs / torch.where(nz, dl, torch.ones_like(dl))).round_().clamp_(-32, 31) + 32
    levels = torch.where(nz, req, levels)
    L = levels.t().reshape(nb, 256).to(torch.uint8)
    L = torch.where(zero[:, None], torch.zeros_like(L), L)
    q = L.reshape(nb, 2, 4, 32)  # [nb, half, quarter, l]
    ql = torch.cat(
        [_pack_nibbles(q[:, :, 0], q[:, :, 2]), _pack_nibbles(q[:, :, 1], q[:, :, 3])], 2
    ).reshape(nb, 128)
    hi = (q >> 4).to(torch.int64)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).to(torch.uint8)
    return torch.cat(
        [ql, qh.reshape(nb, 64), sc.to(torch.int8).view(torch.uint8), _fp16_bytes(d)], 1
    )


_QUANTIZERS = {
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
    "q5_0": _q5_0,
    "q4_0": _q4_0,
    "q8_0": _q8_0,
}
