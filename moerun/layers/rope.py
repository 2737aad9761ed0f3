"""Rotary position embeddings: default, linear and YaRN scaling, partial rotary."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import kernels
from ..kernels.reference import apply_rope


def inv_frequencies(rope: dict[str, Any], rotary_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] and the attention (cos/sin) scaling factor."""
    base = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if kind == "yarn":
        return _yarn(rope, base, rotary_dim, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, yarn)")


def _yarn(rope: dict[str, Any], base: float, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    original = rope.get("original_max_position_embeddings") or max_pos
    factor = rope.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class Rope(torch.nn.Module):
    """cos/sin tables for integer positions; `interleaved` pairs (x0,x1),(x2,x3) as DeepSeek does."""

    def __init__(self, rope: dict[str, Any], rotary_dim: int, max_position_embeddings: int):
        super().__init__()
        with torch.device("cpu"):  # a table, not a weight: real even when the model is built on "meta"
            inv_freq, self.scale = inv_frequencies(rope, rotary_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = rotary_dim

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] -> cos, sin [B, 1, T, rotary_dim], rows of tables grown on demand:
        # a decode step then indexes two tables instead of running the eight ops that compute
        # them (~130 us a step on a busy 2-core machine), and a position's values are the
        # same whichever pass asks for it
        cos, sin = self._rows(positions, int(positions.max()) + 1 if positions.numel() else 0, dtype)
        return cos[:, None], sin[:, None]

    def span(self, pos0: torch.Tensor, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for positions pos0[b] + 0..T-1 of each row (pos0 [B]): one row's as views of
        the tables, without the index ops (~30 us less per pass: every decode step and MTP
        call asks for them)."""
        if pos0.numel() != 1:
            return self(pos0[:, None] + torch.arange(T), dtype)
        p = int(pos0[0])
        cos, sin = self._rows(slice(p, p + T), p + T, dtype)
        return cos[None, None], sin[None, None]

    _table: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rows(self, index, need: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows at `index` (positions, or a slice of them) of the tables, grown to
        hold positions 0..need-1, in dtype."""
        table = self._tables(need)
        cos, sin = table[0][index], table[1][index]
        return (cos, sin) if dtype == cos.dtype else (cos.to(dtype), sin.to(dtype))

    def float_table(self, need: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [n, rotary_dim] float32 for positions 0..n-1 (n >= need) holding the values
        `span` gives in dtype (rounded to it): a native op reads its rows. Kept per dtype until
        the tables grow (the same tensors are returned until then)."""
        return self._float(need, dtype)[1]

    def float_rows(self, pos: int, T: int, dtype: torch.dtype) -> tuple:
        """Rows pos..pos+T-1 of `float_table` as float32 numpy views, as the native ops that
        apply the rope take them (a decode pass's, an MTP call's)."""
        rows = self._float(pos + T, dtype)[2]
        return rows[0][pos : pos + T], rows[1][pos : pos + T]

    def float_rows_at(self, positions, dtype: torch.dtype) -> tuple:
        """`float_rows` at each of `positions` (int64 numpy [B]: a batch's rows, one token each),
        copied into [B, rotary_dim] rows."""
        rows = self._float(int(positions.max()) + 1, dtype)[2]
        return rows[0][positions], rows[1][positions]

    def _float(self, need: int, dtype: torch.dtype) -> tuple:
        """(the tables, `float_table`'s tensors, their numpy views), kept per dtype until the
        tables grow."""
        table = self._tables(need)
        kept = self.__dict__.setdefault("_float_tables", {})
        got = kept.get(dtype)
        if got is None or got[0] is not table:
            tensors = tuple(t.to(dtype).float() for t in table)
            got = kept[dtype] = (table, tensors, tuple(t.numpy() for t in tensors))
        return got

    def _tables(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables, grown to hold positions 0..need-1 if they do not."""
        table = self._table
        if table is None or table[0].shape[0] < need or table[0].device != self.inv_freq.device:
            table = self._grow(need)
        return table

    def _grow(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [n, rotary_dim] float32 for positions 0..n-1, n >= need (doubling)."""
        have = 0 if self._table is None else self._table[0].shape[0]
        n = max(need, 2 * have, 256)
        freqs = torch.arange(n, device=self.inv_freq.device).float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self._table = (emb.cos() * self.scale, emb.sin() * self.scale)
        return self._table


def norm_rope(x: torch.Tensor, norm, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A projection's heads x [B, T, H, D] -> [B, H, T, D]: the per-head RMSNorm `norm` (None:
    none), then rotate-half rope on the first rotary dims. One float32 row (prefill, decode,
    verification) is one native pass over every head and token (`kernels.norm_rope_heads`);
    anything else, or a norm with hooks (they must see it called), runs the torch ops."""
    cos, sin = cos_sin
    w = None if norm is None else norm.weight
    hooked = norm is not None and kernels.has_hooks(norm)
    if (x.shape[0] == 1 and x.is_cpu and x.dtype == torch.float32 and not hooked
            and (w is None or w.dtype == torch.float32)):
        T = x.shape[1]
        offset = 1.0 if getattr(norm, "zero_centered", False) else 0.0
        eps = norm.eps if norm is not None else 0.0
        return kernels.norm_rope_heads(x[0], w, eps, offset, cos.reshape(T, -1), sin.reshape(T, -1))[None]
    return apply_rope((x if norm is None else norm(x)).transpose(1, 2), cos, sin)


