"""Which resident expert a tier gives up when it needs room: one small class per policy.

A policy sees keys `(layer, expert)` inserted, accessed and removed, and on demand names
victims in the order it would evict them. The store decides what may be evicted at all
(in use, still loading, the device copy of an inclusive host...): `victims()` receives
that test as `evictable` and skips keys failing it. Wrappers add rules on top of a base
order: `PinnedHotSet` never names a pinned key, `PredictionAware` never names a key that a
pending prefetch wants.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable, Iterable

Key = tuple  # (layer, expert)


class Policy:
    name = "base"

    def inserted(self, key: Key) -> None: ...

    def accessed(self, key: Key) -> None: ...

    def removed(self, key: Key) -> None: ...

    def demoted(self, key: Key) -> None:
        """`key` is resident but was brought for a use that did not come (a prefetch whose step
        passed unused): where the order allows, it goes first."""

    def victims(self, count: int, evictable: Callable[[Key], bool]) -> list[Key]:
        """Up to `count` evictable resident keys, the first to go first."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class LRU(Policy):
    """Least recently used goes first."""

    name = "lru"

    def __init__(self):
        self._order: OrderedDict[Key, None] = OrderedDict()

    def inserted(self, key):
        self._order[key] = None
        self._order.move_to_end(key)

    def accessed(self, key):
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key):
        self._order.pop(key, None)

    def demoted(self, key):
        if key in self._order:
            self._order.move_to_end(key, last=False)

    def victims(self, count, evictable):
        out = []
        for key in self._order:
            if len(out) >= count:
                break
            if evictable(key):
                out.append(key)
        return out


class LFU(Policy):
    """Least frequently used goes first; frequencies outlive eviction, ties go to the older.

    Counting every access (also while an expert is not resident) follows the routing
    distribution, which is stable within a run; a lazy heap keeps victim choice at
    O(log n) per access rather than a sort of all resident experts per eviction.
    """

    name = "lfu"

    def __init__(self):
        self.counts: dict[Key, int] = {}
        self._tick = 0
        self._resident: dict[Key, tuple[int, int]] = {}  # key -> its current heap record
        self._heap: list[tuple[int, int, Key]] = []

    def _push(self, key):
        self._tick += 1
        rec = (self.counts.get(key, 0), self._tick)
        self._resident[key] = rec
        heapq.heappush(self._heap, (*rec, key))
        if len(self._heap) > 4 * len(self._resident) + 64:  # drop stale records now and then
            self._heap = [(*r, k) for k, r in self._resident.items()]
            heapq.heapify(self._heap)

    def inserted(self, key):
        self._push(key)

    def accessed(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        if key in self._resident:
            self._push(key)

    def removed(self, key):
        self._resident.pop(key, None)

    def victims(self, count, evictable):
        out, skipped = [], []
        while self._heap and len(out) < count:
            c, t, key = heapq.heappop(self._heap)
            if self._resident.get(key) != (c, t):
                continue  # stale record
            skipped.append((c, t, key))
            if evictable(key):
                out.append(key)
        for rec in skipped:  # the store calls removed() for those it actually evicts
            heapq.heappush(self._heap, rec)
        return out


class Guarded(Policy):
    """A base policy that never gives up the keys in `protected` (a set it may share)."""

    suffix = "guarded"

    def __init__(self, base: Policy, protected):
        self.base = base
        self.protected = protected
        self.name = f"{base.name}+{self.suffix}"

    def inserted(self, key):
        self.base.inserted(key)

    def accessed(self, key):
        self.base.accessed(key)

    def removed(self, key):
        self.base.removed(key)

    def demoted(self, key):
        self.base.demoted(key)

    def victims(self, count, evictable):
        return self.base.victims(count, lambda k: k not in self.protected and evictable(k))

    def describe(self):
        return self.base.describe().replace(self.base.name, self.name, 1)


class PinnedHotSet(Guarded):
    """Never gives up the pinned keys (the hot set of a routing profile)."""

    suffix = "pinned"

    def __init__(self, base: Policy, pinned: Iterable[Key] = ()):
        super().__init__(base, set(pinned))

    @property
    def pinned(self) -> set[Key]:
        return self.protected

    @pinned.setter
    def pinned(self, keys) -> None:
        self.protected = set(keys)

    def describe(self):
        return f"{self.name} ({len(self.pinned)} pinned)"


class PredictionAware(Guarded):
    """Never evicts an expert a pending prefetch wants.

    `wanted` is the store's live set of keys hinted for the current or a later step and
    not yet used; it is shared, not copied.
    """

    suffix = "prediction"

    def __init__(self, base: Policy, wanted):
        super().__init__(base, wanted)

    @property
    def wanted(self):
        return self.protected


BASES = {"lru": LRU, "lfu": LFU}
POLICIES = ("lru", "lfu", "prediction", "prediction-lfu")


def make_policy(name: str, wanted, pinned: Iterable[Key] = ()) -> Policy:
    """`lru`, `lfu`, `prediction` (LRU that keeps wanted experts), `prediction-lfu`;
    pinned keys wrap any of them."""
    from ..errors import MoerunError

    if name not in POLICIES:
        raise MoerunError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")
    base_name = "lfu" if name.endswith("lfu") else "lru"
    policy: Policy = BASES[base_name]()
    if name.startswith("prediction"):
        policy = PredictionAware(policy, wanted)
    return PinnedHotSet(policy, pinned)
