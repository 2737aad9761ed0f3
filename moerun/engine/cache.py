"""Decode state for every layer of a batch of sequences, preallocated once.

A model describes what each layer keeps (`KVSpec` for attention, `StateSpec` for
recurrent layers such as Gated DeltaNet); the engine allocates it here and decides the
storage format (for example int8 keys and values). Rows of the cache are *slots*: a
forward pass names the slots its batch rows write to, so sequences can join and leave a
running batch between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    """Per-token keys and values of an attention layer ([kv_heads, dim] each)."""

    kv_heads: int
    k_dim: int
    v_dim: int


@dataclass(frozen=True)
class StateSpec:
    """Fixed-size per-sequence state of a recurrent layer: name -> shape (without batch)."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    # name -> dtype for tensors kept in a fixed precision whatever the model's (e.g. an fp32
    # recurrent state that a bf16 model would otherwise round at every token)
    dtypes: tuple[tuple[str, torch.dtype], ...] = ()


class KVCache:
    """Keys [slots, kv_heads, max_len, k_dim] and values [slots, kv_heads, max_len, v_dim]."""

    def __init__(self, spec: KVSpec, batch: int, max_len: int, dtype: torch.dtype):
        self.k = torch.zeros(batch, spec.kv_heads, max_len, spec.k_dim, dtype=dtype)
        self.v = torch.zeros(batch, spec.kv_heads, max_len, spec.v_dim, dtype=dtype)
        self.max_len = max_len

    def update(self, slots: torch.Tensor, pos0: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, kv_heads, T, dim] at positions pos0[b].., return all keys/values so far.

        Returns k_all, v_all [B, kv_heads, S, dim] with S = max(pos0) + T; positions past a
        row's own length hold stale data that the caller masks.
        """
        B, _, T, _ = k.shape
        end = int(pos0.max()) + T
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache's {self.max_len}")
        if B == 1:
            s, p = int(slots[0]), int(pos0[0])
            self.k[s, :, p : p + T] = k[0]
            self.v[s, :, p : p + T] = v[0]
            return self.k[s : s + 1, :, :end], self.v[s : s + 1, :, :end]
        idx = pos0[:, None] + torch.arange(T)  # [B, T]
        rows = slots[:, None]
        self.k[rows, :, idx] = k.transpose(1, 2)
        self.v[rows, :, idx] = v.transpose(1, 2)
        if _is_range(slots, self.k.shape[0]):
            return self.k[:B, :, :end], self.v[:B, :, :end]
        return self.k[slots, :, :end], self.v[slots, :, :end]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class RecurrentState:
    """Named state tensors [slots, *shape], zero at the start of a sequence."""

    def __init__(self, spec: StateSpec, batch: int, dtype: torch.dtype):
        fixed = dict(spec.dtypes)
        self.tensors = {name: torch.zeros(batch, *shape, dtype=fixed.get(name, dtype)) for name, shape in spec.shapes}

    def get(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        t = self.tensors[name]
        return t[: len(slots)] if _is_range(slots, t.shape[0]) else t[slots]

    def set(self, name: str, slots: torch.Tensor, value: torch.Tensor) -> None:
        t = self.tensors[name]
        if _is_range(slots, t.shape[0]):
            t[: len(slots)] = value
        else:
            t[slots] = value

    def reset(self, slot: int) -> None:
        for t in self.tensors.values():
            t[slot].zero_()

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _is_range(slots: torch.Tensor, capacity: int) -> bool:
    n = slots.numel()
    return n <= capacity and (n == 1 and int(slots[0]) == 0 or bool((slots == torch.arange(n)).all()))


class Cache:
    """All layers' decode state plus the number of tokens each slot holds."""

    def __init__(self, specs: list, batch: int, max_len: int, dtype: torch.dtype):
        self.batch = batch
        self.max_len = max_len
        self.layers = [self._make(s, batch, max_len, dtype) for s in specs]
        self.lengths = torch.zeros(batch, dtype=torch.long)

    @staticmethod
    def _make(spec, batch, max_len, dtype):
        if spec is None:
            return None
        if isinstance(spec, KVSpec):
            return KVCache(spec, batch, max_len, dtype)
        if isinstance(spec, StateSpec):
            return RecurrentState(spec, batch, dtype)
        raise TypeError(f"unknown cache spec {spec!r}")

    def start_positions(self, slots: torch.Tensor) -> torch.Tensor:
        return self.lengths[slots]

    def advance(self, slots: torch.Tensor, n: int) -> None:
        self.lengths[slots] += n

    def reset(self, slot: int) -> None:
        """Free a slot for a new sequence."""
        self.lengths[slot] = 0
        for layer in self.layers:
            if isinstance(layer, RecurrentState):
                layer.reset(slot)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers if layer is not None)
