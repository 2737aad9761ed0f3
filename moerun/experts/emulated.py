"""The host->device link: an emulated one for machines without a GPU, and a CUDA one.

The emulated device is host memory behind a throttled link. It is zero-copy: an expert
"on the device" is the very tensor the host tier holds (the host tier is inclusive of it),
and the link only charges time: a transfer holds the one link for
`latency + bytes / bandwidth`, transfers are serialised like DMA on one copy engine, and a
demand transfer goes before any queued prefetch (it still waits for the transfer in
flight). We do not memcpy: on these shared 2-core machines a copy runs at 1-2 GB/s, far
below the link being emulated, and it would steal the compute threads' cores, which a
real copy engine does not.

Presets are effective figures (what `cudaMemcpyAsync` from pinned memory reaches, not the
bus's nominal rate); the latency is per transfer (launch + completion of one copy).
Every figure measured under emulation must say so; `LinkSpec.describe()` is that label.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from ..errors import MoerunError

# name -> (GB/s effective, µs per transfer)
PRESETS = {
    "pcie3": (12.0, 10.0),  # PCIe 3.0 x16: 15.8 GB/s nominal, ~12 measured host->device
    "pcie4": (25.0, 10.0),  # PCIe 4.0 x16: 31.5 GB/s nominal, ~25 measured
    "pcie5": (50.0, 10.0),  # PCIe 5.0 x16: 63 GB/s nominal, ~50 measured
    "nvlink-c2c": (400.0, 5.0),  # Grace Hopper chip-to-chip, for what-if runs
}


@dataclass(frozen=True)
class LinkSpec:
    gbps: float  # 1e9 bytes per second
    latency_us: float
    name: str = ""

    def seconds(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)

    def describe(self) -> str:
        label = f"{self.name}: " if self.name else ""
        return f"emulated link ({label}{self.gbps:g} GB/s, {self.latency_us:g} µs per transfer)"


def parse_link(text: str) -> LinkSpec:
    """`pcie4`, or explicit `25GB/s,10us` / `25,10` (GB/s, µs per transfer)."""
    t = str(text).strip().lower()
    if t in PRESETS:
        g, us = PRESETS[t]
        return LinkSpec(g, us, t)
    m = re.fullmatch(r"([0-9.]+)\s*(?:gb/?s)?\s*[,:]\s*([0-9.]+)\s*(?:us|µs)?", t)
    if not m:
        raise MoerunError(
            f"cannot read link {text!r}; use a preset ({', '.join(PRESETS)}) or 'GB/s,µs' such as '25,10'"
        )
    g, us = float(m.group(1)), float(m.group(2))
    if g <= 0 or us < 0:
        raise MoerunError(f"link {text!r}: bandwidth must be > 0 and latency >= 0")
    return LinkSpec(g, us, "")


class EmulatedLink:
    """One serial link. `transfer()` blocks the caller for the time the bytes would take."""

    emulated = True
    inclusive = True  # device copies are the host tier's tensors

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        self._cv = threading.Condition()
        self._busy = False
        self._demand_waiting = 0
        self.modeled_s = 0.0  # the time the link model charged
        self.busy_s = 0.0  # the time the link was actually held (sleep overshoots a little)
        self.transfers = 0
        # the transfer in flight, for the placement cost model: its tag and when it ends
        self.current = None
        self.busy_until = 0.0

    def describe(self) -> str:
        return self.spec.describe()

    def fetch(self, weights: tuple, nbytes: int, demand: bool, tag=None) -> tuple:
        held = False  # set before the link is taken: whatever interrupts (Ctrl-C), finally frees it
        t0, dt = time.perf_counter(), 0.0
        try:
            with self._cv:
                if demand:
                    self._demand_waiting += 1
                try:
                    while self._busy or (not demand and self._demand_waiting):
                        self._cv.wait(0.05)
                    held = True
                    self._busy = True
                finally:
                    if demand:
                        self._demand_waiting -= 1
            t0 = time.perf_counter()
            dt = self.spec.seconds(nbytes)
            self.current, self.busy_until = tag, t0 + dt
            # a demand caller is blocked anyway: spin, since a sleeping thread on a busy machine
            # wakes milliseconds late and would charge the link for the scheduler's delay
            _sleep_until(t0 + dt, spin=demand)
        finally:
            if held:
                with self._cv:
                    self._busy = False
                    self.current = None
                    self.modeled_s += dt
                    self.busy_s += time.perf_counter() - t0
                    self.transfers += 1
                    self._cv.notify_all()
        return weights


class CudaLink:
    """Host->GPU copies on a side stream, completion by event. UNTESTED: no GPU in CI."""

    emulated = False
    inclusive = False
    spec = LinkSpec(*PRESETS["pcie4"], "pcie4, assumed")  # what the placement cost model assumes
    current, busy_until = None, 0.0  # not tracked: the cost model sees an idle link

    def __init__(self, device: str = "cuda"):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._lock = threading.Lock()
        self.modeled_s = 0.0
        self.busy_s = 0.0
        self.transfers = 0

    def describe(self) -> str:
        return f"CUDA {self.torch.cuda.get_device_name(self.device)}"

    def fetch(self, weights: tuple, nbytes: int, demand: bool, tag=None) -> tuple:
        torch = self.torch
        t0 = time.perf_counter()
        with self._lock, torch.cuda.stream(self.stream):
            out = tuple(w.to(self.device, non_blocking=True) for w in weights)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
        self.busy_s += time.perf_counter() - t0
        self.transfers += 1
        return out


def _sleep_until(deadline: float, spin: bool) -> None:
    # what the emulation got wrong (sleep overshoot, preemption) is reported as busy_s - modeled_s
    left = deadline - time.perf_counter()
    if spin:
        if left > 2e-3:
            time.sleep(left - 2e-3)
        while time.perf_counter() < deadline:
            pass
    elif left > 0:
        time.sleep(left)
