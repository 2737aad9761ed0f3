"""Execution where it lives: on a miss, wait for the link or run the expert on the CPU.

An expert the device does not hold can either cross the link and run on the device
(`t_wait` = the link's time until it is free + latency + bytes / bandwidth + device
compute), or run on the CPU from RAM where it already is (`t_cpu`); a read from disk comes
first on both paths, so it does not enter the choice. One layer's misses are placed one by
one, each where it would *finish* first: transfers queue on the one link behind the one in
flight, CPU experts queue on the CPU, and the two run side by side (as in Fiddler and
KTransformers). One token favours the CPU (it reads each weight once, as the link would);
many tokens (prefill) favour moving the expert once and running it on the faster device.

Figures behind the choice:
- link: the `LinkSpec` (the emulated link's, or the pcie4 preset assumed for a CUDA link);
- CPU: seconds per weight byte, `a + b * tokens`, timed on one expert's shape (float, or
  packed and run by the native kernel) when the store starts (best of 3 at 1 and 32 tokens) and then followed as an EMA of the times
  the store's experts measure as they run;
- device: MODELLED, never measured here (no GPU): an RTX 4090-like card
  (`moerun.bench.simulate`'s `pcie4+rtx4090`: 1008 GB/s at 80% efficiency, plus a
  compute roof and a launch cost per expert). Under the emulated device the experts
  "on the device" still run on the CPU, so the store reports both their measured CPU time
  and this modelled device time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from .. import kernels
from ..kernels.reference import swiglu
from ..layers.quantized import QuantizedExperts

DEVICE, CPU = "device", "cpu"
MODES = ("auto", DEVICE, CPU)


@dataclass(frozen=True)
class DeviceModel:
    """A modelled GPU running one expert: launch + max(weight bytes / bandwidth, flops / roof)."""

    gbps: float = 1008.0 * 0.8  # simulate.py's rtx4090 VRAM bandwidth x its decode efficiency
    tflops: float = 80.0  # bf16 tensor cores, about half of the 4090's dense peak
    launch_us: float = 10.0  # gate/up, activation, down: a few launches per expert

    def seconds(self, n_tokens: int, nbytes: int, itemsize: int) -> float:
        flops = 2 * n_tokens * nbytes / itemsize
        return self.launch_us * 1e-6 + max(nbytes / (self.gbps * 1e9), flops / (self.tflops * 1e12))


class CpuSpeed:
    """Seconds per weight byte of one expert run on the CPU: `a + b * n_tokens`."""

    alpha = 0.1  # EMA weight of a new measurement

    def __init__(self, a: float, b: float):
        self.a, self.b = a, b
        self.samples = 0

    @classmethod
    def calibrate(cls, hidden: int, inter: int, dtype: torch.dtype, fmt: str | None = None,
                  reps: int = 3, down_fmt: str | None = None) -> "CpuSpeed":
        """Time one expert of this shape at 1 and 32 tokens (best of `reps`): torch's SwiGLU,
        or with `fmt` the native quantized kernel on its packed blocks (down in `down_fmt`
        where it differs, as a GGUF file's experts may have it)."""
        run, nbytes = _one_expert(hidden, inter, dtype, fmt, down_fmt)
        times = {}
        with torch.inference_mode():
            for n in (1, 32):
                x = torch.zeros(n, hidden, dtype=dtype)
                run(x)  # first call: allocation and dispatch warm-up
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    run(x)
                    best = min(best, time.perf_counter() - t0)
                times[n] = best / nbytes
        b = max((times[32] - times[1]) / 31, 0.0)
        return cls(max(times[1] - b, 0.0), b)

    def seconds(self, n_tokens: int, nbytes: int) -> float:
        return nbytes * (self.a + self.b * n_tokens)

    def observe(self, n_tokens: int, nbytes: int, seconds: float) -> None:
        """Fold in one measured expert: few tokens inform the per-byte term, many the per-token one."""
        y = seconds / nbytes
        if n_tokens <= 2:
            self.a += self.alpha * (max(y - self.b * n_tokens, 0.0) - self.a)
        else:
            self.b += self.alpha * (max((y - self.a) / n_tokens, 0.0) - self.b)
        self.samples += 1


def _one_expert(hidden: int, inter: int, dtype: torch.dtype, fmt: str | None, down_fmt: str | None = None):
    """(x [n, H] -> y, weight bytes) for one zero-weight expert: float, or packed in `fmt`
    (down in `down_fmt`, default `fmt`)."""
    if fmt is None:

        w = (torch.zeros(inter, hidden, dtype=dtype), torch.zeros(inter, hidden, dtype=dtype),
             torch.zeros(hidden, inter, dtype=dtype))
        return (lambda x: swiglu(x, *w)), sum(t.numel() * t.element_size() for t in w)

    q = QuantizedExperts(1, hidden, inter, fmt, down_fmt)
    bufs = [t for _, t in q.named_buffers()]

    def run(x):
        ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
        return kernels.moe_experts(x, ids, torch.ones(x.shape[0], 1), *bufs, fmt, inter, down_fmt=down_fmt)

    return run, sum(t.numel() * t.element_size() for t in bufs)


@dataclass
class Miss:
    """One expert the device does not hold: its size, its tokens, whether its transfer is in flight."""

    nbytes: int
    n_tokens: int
    in_flight: bool = False


class CostModel:
    def __init__(self, link, cpu: CpuSpeed, itemsize: int, device: DeviceModel = DeviceModel()):
        self.link = link  # a LinkSpec: seconds(nbytes)
        self.cpu = cpu
        self.device = device
        self.itemsize = itemsize

    def device_s(self, n_tokens: int, nbytes: int) -> float:
        return self.device.seconds(n_tokens, nbytes, self.itemsize)

    def plan(self, misses: list[Miss], link_free_s: float = 0.0) -> list[str]:
        """Where each miss runs. `link_free_s`: how long until the transfer in flight ends."""
        link, cpu, out = link_free_s, 0.0, []
        for m in misses:
            # an expert in flight lands when the link frees; any other queues behind it
            xfer = 0.0 if m.in_flight else self.link.seconds(m.nbytes)
            t_wait = (link_free_s if m.in_flight else link + xfer) + self.device_s(m.n_tokens, m.nbytes)
            t_cpu = cpu + self.cpu.seconds(m.n_tokens, m.nbytes)
            if t_wait <= t_cpu:
                link += xfer
                out.append(DEVICE)
            else:
                cpu = t_cpu
                out.append(CPU)
        return out
