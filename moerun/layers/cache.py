"""Decode state for every layer of a batch of sequences, preallocated once.

Preallocated for the positions a run asks for (its prompts plus the tokens it may generate),
never for the model's whole context window; a cache that would not fit in the memory this
machine has available is refused before it is allocated.

A model describes what each layer keeps (`KVSpec` for attention, `StateSpec` for
recurrent layers such as Gated DeltaNet); the engine allocates it here and decides the
storage format (for example int8 keys and values). Rows of the cache are *slots*: a
forward pass names the slots its batch rows write to, so sequences can join and leave a
running batch between steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import MoerunError, human_bytes


@dataclass(frozen=True)
class KVSpec:
    """Per-token keys and values of an attention layer ([kv_heads, dim] each)."""

    kv_heads: int
    k_dim: int
    v_dim: int
    # one [k_dim + v_dim] row per head and position, `k` and `v` its two parts (DeepSeek-V3's
    # MLA: the latent and the rope key, which its native attention reads as one key)
    joined: bool = False


@dataclass(frozen=True)
class StateSpec:
    """Fixed-size per-sequence state of a recurrent layer: name -> shape (without batch)."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    # name -> dtype for tensors kept in a fixed precision whatever the model's (e.g. an fp32
    # recurrent state that a bf16 model would otherwise round at every token)
    dtypes: tuple[tuple[str, torch.dtype], ...] = ()


class KVCache:
    """Keys [slots, kv_heads, max_len, k_dim] and values [slots, kv_heads, max_len, v_dim].

    Stored in `dtype`; read back in the dtype of the keys and values written (they differ
    when the engine keeps the cache in another float format than the model computes in).
    """

    joined = None  # a joined spec's [slots, kv_heads, max_len, k_dim + v_dim], of which k and v are views

    def __init__(self, spec: KVSpec, batch: int, max_len: int, dtype: torch.dtype):
        if spec.joined:
            self.joined = torch.zeros(batch, spec.kv_heads, max_len, spec.k_dim + spec.v_dim, dtype=dtype)
            self.k, self.v = self.joined.split([spec.k_dim, spec.v_dim], dim=-1)
        else:
            self.k = torch.zeros(batch, spec.kv_heads, max_len, spec.k_dim, dtype=dtype)
            self.v = torch.zeros(batch, spec.kv_heads, max_len, spec.v_dim, dtype=dtype)
        self.max_len = max_len

    @staticmethod
    def bytes_per_token(spec: KVSpec, dtype: torch.dtype) -> int:
        return spec.kv_heads * (spec.k_dim + spec.v_dim) * dtype.itemsize

    def update(self, slots: torch.Tensor, pos0: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, kv_heads, T, dim] at positions pos0[b].., return all keys/values so far.

        Returns k_all, v_all [B, kv_heads, S, dim] with S = max(pos0) + T; positions past a
        row's own length hold stale data that the caller masks.
        """
        end = _end(pos0, k.shape[2], self.max_len)
        _write((self.k, self.v), slots, pos0, (k, v))
        return _read(self.k, slots, end).to(k.dtype), _read(self.v, slots, end).to(v.dtype)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class Int8KVCache:
    """Keys and values as int8 with one fp32 scale per (slot, kv_head, position): symmetric
    absmax per head per token, x ~ q * scale with scale = max|x| / 127, so |error| <= scale / 2.

    A static per-head scale would have to be known before the data is seen; one per head and
    token costs 4 bytes per head_dim int8 values (3% at head_dim 128) and follows outlier
    tokens. Only positions 0..end are dequantized on read, in the dtype of the keys and
    values written. Speculative rollback needs nothing more: a position's scale is written
    with it, so shortening `Cache.lengths` is enough.
    """

    def __init__(self, spec: KVSpec, batch: int, max_len: int, dtype: torch.dtype | None = None):
        self.k = torch.zeros(batch, spec.kv_heads, max_len, spec.k_dim, dtype=torch.int8)
        self.v = torch.zeros(batch, spec.kv_heads, max_len, spec.v_dim, dtype=torch.int8)
        self.k_scale = torch.zeros(batch, spec.kv_heads, max_len, 1)
        self.v_scale = torch.zeros(batch, spec.kv_heads, max_len, 1)
        self.max_len = max_len

    @staticmethod
    def bytes_per_token(spec: KVSpec, dtype: torch.dtype = torch.int8) -> int:
        return spec.kv_heads * (spec.k_dim + spec.v_dim + 2 * torch.float32.itemsize)

    def update_int8(self, slots: torch.Tensor, pos0: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v like `update`, but return the stored int8 keys, their scales, the int8
        values and theirs ([B, kv_heads, S, dim] and [B, kv_heads, S, 1] views), for attention
        that applies the scales itself (kernels.attn_decode)."""
        end = _end(pos0, k.shape[2], self.max_len)
        _write((self.k, self.k_scale, self.v, self.v_scale), slots, pos0, (*quantize_int8(k), *quantize_int8(v)))
        return tuple(_read(t, slots, end) for t in (self.k, self.k_scale, self.v, self.v_scale))

    def update(self, slots: torch.Tensor, pos0: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """`KVCache.update` through int8: returns the dequantized keys/values, new ones included."""
        end = _end(pos0, k.shape[2], self.max_len)
        _write((self.k, self.k_scale, self.v, self.v_scale), slots, pos0, (*quantize_int8(k), *quantize_int8(v)))
        k_all = dequantize_int8(_read(self.k, slots, end), _read(self.k_scale, slots, end), k.dtype)
        v_all = dequantize_int8(_read(self.v, slots, end), _read(self.v_scale, slots, end), v.dtype)
        return k_all, v_all

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], fp32 scale [..., 1]), symmetric absmax over the last dim."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    q = (x / scale.clamp_min(torch.finfo(torch.float32).tiny)).round_().clamp_(-127, 127)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def _end(pos0: torch.Tensor, T: int, max_len: int) -> int:
    end = (int(pos0[0]) if pos0.numel() == 1 else int(pos0.max())) + T
    if end > max_len:
        raise ValueError(f"sequence of {end} tokens exceeds the cache's {max_len}")
    return end


def _write(buffers: tuple, slots: torch.Tensor, pos0: torch.Tensor, values: tuple) -> None:
    """buffers[i][slots[b], :, pos0[b] + t] = values[i][b, :, t] for values [B, heads, T, *]."""
    B, _, T = values[0].shape[:3]
    if B == 1:
        s, p = int(slots[0]), int(pos0[0])
        for buf, x in zip(buffers, values):
            buf[s, :, p : p + T] = x[0]
        return
    idx = pos0[:, None] + torch.arange(T)  # [B, T]
    rows = slots[:, None]
    for buf, x in zip(buffers, values):
        buf[rows, :, idx] = x.transpose(1, 2).to(buf.dtype)


def _read(buf: torch.Tensor, slots: torch.Tensor, end: int) -> torch.Tensor:
    """buf's rows `slots`, positions 0..end-1 (a view when the slots are contiguous)."""
    B = slots.numel()
    if B == 1:
        s = int(slots[0])
        return buf[s : s + 1, :, :end]
    if _is_range(slots, buf.shape[0]):
        return buf[:B, :, :end]
    return buf[slots, :, :end]


class RecurrentState:
    """Named state tensors [slots, *shape], zero at the start of a sequence."""

    positions: dict | None = None  # see keep_every

    def __init__(self, spec: StateSpec, batch: int, dtype: torch.dtype):
        fixed = dict(spec.dtypes)
        self.tensors = {name: torch.zeros(batch, *shape, dtype=fixed.get(name, dtype)) for name, shape in spec.shapes}

    def get(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        t = self.tensors[name]
        return t[: len(slots)] if _is_range(slots, t.shape[0]) else t[slots]

    def set(self, name: str, slots: torch.Tensor, value: torch.Tensor) -> None:
        """Write value (cast to the state's own dtype) into the given slots. Nothing to do
        when value is what `get` gave for them (a view of the leading slots), updated in place."""
        t = self.tensors[name]
        if _is_range(slots, t.shape[0]):
            n = len(slots)
            if (value.data_ptr() != t.data_ptr() or value.stride() != t.stride() or value.dtype != t.dtype
                    or value.shape[:1] != (n,)):
                t[:n] = value
        else:
            t[slots] = value.to(t.dtype)

    def set_slot(self, name: str, slot: int, value: torch.Tensor) -> None:
        """`set` for one slot given as an int (a few microseconds where `set` takes tens)."""
        self.tensors[name][slot].copy_(value)

    def roll_back(self, slot: int, row: int, keep: int) -> None:
        """The slot's states <- the ones kept after token keep - 1 of row `row` of the last pass
        (`positions`, `keep_every`): speculative decoding's rollback after a rejected draft.
        float32 states as numpy copies (a torch index and copy_ per state cost ~16 us, and a
        rejection restores two states per DeltaNet layer)."""
        arrays = self.__dict__.get("_arrays")
        if arrays is None:
            arrays = self._arrays = {n: t.numpy() if t.dtype == torch.float32 else None for n, t in self.tensors.items()}
        for name, every in self.positions.items():
            a = arrays[name]
            if a is None or every.dtype != torch.float32:
                self.set_slot(name, slot, every[row, keep - 1])
            else:
                a[slot] = every.numpy()[row, keep - 1]

    def scratch(self, name: str, shape: tuple, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A contiguous buffer of `shape` kept from one call to the next: where a pass of a few
        tokens writes every token's state, instead of fresh memory each pass (a fresh buffer of
        megabytes is page-faulted in on every write: ~4x the time of reuse). One allocation per
        name, grown only when a shape needs more room, so passes of 2, 3 or 4 tokens taking
        turns (speculative decoding's "auto", a row's last drafts) reuse it, where each change
        of shape reallocated it (one Qwen3.6-sized DeltaNet state, 2- and 3-token passes taking
        turns: 0.08 against 0.21 ms a pass). Its contents live until the next pass asks for it
        again. The view made for a (name, shape, dtype) is kept too, until the buffer grows: a
        verification pass asks for two per DeltaNet layer, and slicing and viewing anew took
        ~10 us a call on this machine, against 0.35 us looked up."""
        shape = tuple(shape)
        views = self.__dict__.setdefault("_scratch_views", {})
        v = views.get((name, shape, dtype))
        if v is not None:
            return v
        bufs = self.__dict__.setdefault("_scratch", {})
        n = math.prod(shape)
        t = bufs.get(name)
        if t is None or t.numel() < n or t.dtype != dtype:
            t = bufs[name] = torch.empty(n, dtype=dtype)
            for key in [key for key in views if key[0] == name]:  # views of the buffer it replaces
                del views[key]
        v = views[(name, shape, dtype)] = t[:n].view(shape)
        return v

    def keep_every(self, **states: torch.Tensor) -> None:
        """After a pass of a few tokens (whose last state the layer has `set`): name -> [B, T,
        *shape], the state after each token, kept in `positions` when that is a dict
        (speculative decoding rolls a rejected draft back to one of them)."""
        if self.positions is not None:
            self.positions.update(states)

    def reset(self, slot: int) -> None:
        for t in self.tensors.values():
            t[slot].zero_()

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _is_range(slots: torch.Tensor, capacity: int) -> bool:
    """Whether slots are 0..n-1 (n <= capacity): their states are then a view of the leading
    rows. Kept on the slots tensor (a forward pass asks it of the same one a few times a
    layer; slots are made for a pass and never written in place)."""
    first = slots.__dict__.get("_leading")
    if first is None:
        n = slots.numel()
        first = slots.__dict__["_leading"] = n == 1 and int(slots[0]) == 0 or bool((slots == torch.arange(n)).all())
    return first and slots.numel() <= capacity


class Cache:
    """All layers' decode state plus the number of tokens each slot holds.

    Keys and values are stored in `kv_dtype` (None: the model's `dtype`; torch.int8:
    `Int8KVCache`); recurrent states always in `dtype` or their own fixed dtype.
    """

    def __init__(self, specs: list, batch: int, max_len: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
        self.batch = batch
        self.max_len = max_len
        kv_dtype = kv_dtype or dtype
        check_fits(cache_bytes(specs, batch, max_len, dtype, kv_dtype), batch, max_len)
        self.layers = [self._make(s, batch, max_len, dtype, kv_dtype) for s in specs]
        self.lengths = torch.zeros(batch, dtype=torch.long)

    @staticmethod
    def _make(spec, batch, max_len, dtype, kv_dtype):
        if spec is None:
            return None
        if isinstance(spec, KVSpec):
            return _kv_class(kv_dtype)(spec, batch, max_len, kv_dtype)
        if isinstance(spec, StateSpec):
            return RecurrentState(spec, batch, dtype)
        raise TypeError(f"unknown cache spec {spec!r}")

    def start_positions(self, slots: torch.Tensor) -> torch.Tensor:
        return self.lengths[slots]

    def advance(self, slots: torch.Tensor, n: int) -> None:
        """Move each of the (distinct) slots on by n positions: one in-place add (~4 us, where
        indexing and writing back costs ~15, every decode step and MTP call)."""
        self.lengths.index_add_(0, slots, torch.full_like(slots, n))

    def reset(self, slot: int) -> None:
        """Free a slot for a new sequence."""
        self.lengths[slot] = 0
        for layer in self.layers:
            if isinstance(layer, RecurrentState):
                layer.reset(slot)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers if layer is not None)


KV_CACHE_TYPES = {"auto": None, "int8": torch.int8, "float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16}


def kv_cache_dtype(name: str) -> torch.dtype | None:
    """`--kv-cache` value -> `Cache`'s kv_dtype (None: the model's dtype)."""
    if name not in KV_CACHE_TYPES:
        raise MoerunError(f"unknown KV cache type {name!r}; choose one of {', '.join(KV_CACHE_TYPES)}")
    return KV_CACHE_TYPES[name]


def kv_bytes_per_token(specs: list, kv_dtype: torch.dtype) -> int:
    """Bytes of keys and values (scales included) one token adds to a sequence's cache."""
    return sum(_kv_class(kv_dtype).bytes_per_token(s, kv_dtype) for s in specs if isinstance(s, KVSpec))


def cache_bytes(specs: list, batch: int, max_len: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """Bytes a `Cache` of these specs, slots and positions holds."""
    n = batch * max_len * kv_bytes_per_token(specs, kv_dtype)
    for s in specs:
        if isinstance(s, StateSpec):
            fixed = dict(s.dtypes)
            n += batch * sum(math.prod(shape) * fixed.get(name, dtype).itemsize for name, shape in s.shapes)
    return n


def available_memory() -> int | None:
    """Bytes of memory this process can still take: the kernel's MemAvailable, lowered to
    what a cgroup (v2) limit leaves beyond the group's anonymous memory when one is set (its
    page cache, mapped weights included, can be reclaimed); None where neither is known."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.stat") as g:
            limit = f.read().strip()
            if limit != "max":
                anon = next(int(line.split()[1]) for line in g if line.startswith("anon "))
                left = max(int(limit) - anon, 0)
                avail = left if avail is None else min(avail, left)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    return avail


def check_fits(nbytes: int, batch: int, max_len: int) -> None:
    """Refuse (one sentence) a cache of `nbytes` that would not fit in the available memory."""
    avail = available_memory()
    if avail is not None and nbytes > avail:
        rows = f"{batch} sequences" if batch > 1 else "a sequence"
        raise MoerunError(f"the KV cache for {rows} of {max_len} tokens needs {human_bytes(nbytes)}, but this machine has "
                          f"{human_bytes(avail)} of memory available; ask for fewer tokens or sequences")


def _kv_class(kv_dtype: torch.dtype):
    return Int8KVCache if kv_dtype == torch.int8 else KVCache


def kv_cache_summary(specs: list, dtype: torch.dtype, kv_dtype: torch.dtype | None) -> dict:
    """What `info` and `bench --json` report: the KV cache's storage and its bytes per token."""
    kv_dtype = kv_dtype or dtype
    return {"kv_cache": str(kv_dtype).removeprefix("torch."), "kv_bytes_per_token": kv_bytes_per_token(specs, kv_dtype)}
