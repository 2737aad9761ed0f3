"""Asynchronous movers: a priority queue of prefetch jobs served by worker threads.

The store owns two movers: disk->host (readers; reads release the GIL, so more than one
worker overlaps IO) and host->device (one worker per link, the link being serial).
A job is only a promise; whether it still matters is decided by the store when a worker
picks it up (stale for the step, cancelled because a demand miss took it over, no room).
Workers are daemon threads and every live mover is closed at interpreter exit, so neither
a normal exit nor Ctrl-C waits on them.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import threading
import weakref
from typing import Callable

_live: "weakref.WeakSet[Mover]" = weakref.WeakSet()


class Job:
    __slots__ = ("entry", "priority", "for_step", "stage", "demand", "cancelled")

    def __init__(self, entry, priority: float, for_step: int, stage: str, demand: bool = False):
        self.entry = entry
        self.priority = priority  # higher is more urgent
        self.for_step = for_step  # dropped once the store's step has moved past it
        self.stage = stage  # "host" (from disk) or "device" (over the link)
        self.demand = demand  # a demand miss's read, queued so idle workers help; not a prefetch
        self.cancelled = False


class Mover:
    def __init__(self, name: str, handler: Callable[[Job], None], workers: int = 1,
                 gate: Callable[[], bool] | None = None):
        """gate(): whether a speculative job (not `demand`) may start now; while it says no,
        workers leave prefetches queued and take only demand jobs (`kick` when it changes)."""
        self.name = name
        self._handler = handler
        self._gate = gate
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self.errors: list[BaseException] = []  # unexpected worker failures (bugs), kept for tests
        self._threads = [
            threading.Thread(target=self._run, name=f"moerun-{name}-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()
        _live.add(self)

    def submit(self, *jobs: Job) -> None:
        """Queue jobs; one wake-up for all of them (each wake-up of a worker costs the caller a GIL hand-off)."""
        with self._cv:
            if self._closed:
                return
            for job in jobs:
                heapq.heappush(self._heap, (-job.priority, next(self._seq), job))
            self._cv.notify(len(jobs))

    def kick(self) -> None:
        """Wake the workers to look at the gate again."""
        with self._cv:
            self._cv.notify_all()

    def queued(self) -> list[Job]:
        """The jobs waiting (not started), in no particular order."""
        with self._cv:
            return [item[2] for item in self._heap]

    def pending(self) -> int:
        with self._cv:
            return len(self._heap)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._ready():
                    # gated: wait for a kick; the timeout only bounds a missed one
                    self._cv.wait(0.05 if self._heap else None)
                if self._closed:
                    return
                job = heapq.heappop(self._heap)[2]
            try:
                self._handler(job)
            except BaseException as e:  # a worker must never die silently and leave waiters hanging
                self.errors.append(e)

    def _ready(self) -> bool:
        """A job may be taken: the first is a demand (demands sort first), or the gate is open."""
        if not self._heap:
            return False
        return self._heap[0][2].demand or self._gate is None or self._gate()

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify_all()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)


@atexit.register
def _close_all() -> None:
    for m in list(_live):
        m.close(timeout=1.0)
