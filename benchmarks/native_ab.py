"""Two builds of the native extension in one process, taking turns: kernel changes A/B.

    python benchmarks/native_ab.py --other /tmp/old/moerun/_native*.so [--threads 2] [--rounds 7]

Loads this checkout's extension and another build of it (e.g. a worktree of an older commit
built with cmake, see checkout.py) side by side, and times the same calls on both,
alternating call by call, so that a drifting machine falls on both alike: one decode step's
attention (`attn_decode`, bf16 keys and values, heads of 128, 8 layers' caches so that they
come from memory) at a few cache lengths and head groupings, and int8 matrix-vector products
of Qwen3-30B-A3B's attention and LM-head shapes. Prints the median time of each and says
whether both builds gave the same bits.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from moerun import kernels
from moerun.quant import formats


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"{name}._native", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bf16_np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).view(torch.uint16).numpy()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", type=Path, required=True, help="the other build's _native*.so")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    builds = {"this": kernels._native(), "other": load(a.other, "other")}
    if builds["this"] is None:
        raise SystemExit("this checkout's native extension is not built")
    for m in builds.values():
        m.set_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    jobs = []
    for S in (64, 512, 2048):
        for hq, hkv in ((32, 4), (16, 2)):
            k = [bf16_np(torch.randn(hkv, 2048, 128, generator=g)) for _ in range(8)]
            v = [bf16_np(torch.randn(hkv, 2048, 128, generator=g)) for _ in range(8)]
            q = torch.randn(hq, 128, generator=g).numpy()

            def attn(m, out, k=k, v=v, q=q, S=S):
                for kl, vl in zip(k, v):
                    m.attn_decode(q, kl[:, :S], vl[:, :S], out, 128**-0.5, None, None)

            jobs.append((f"attention, {S} positions, {hq}/{hkv} heads, per layer", attn, (hq, 128), 8))
    for rows, cols in ((5120, 2048), (2048, 4096), (151936 // 2, 2048)):
        w = [kernels.packed(*formats.quantize(torch.randn(rows, cols, generator=g) * 0.02, "int8"), "int8")
             for _ in range(max(1, 8 * 2048 * 5120 // (rows * cols)))]
        x = torch.randn(1, cols, generator=g).numpy()

        def linear(m, out, w=w, x=x):
            for p in w:
                m.qlinear_multi(x, [p.w], [p.s], [p.code], out)

        jobs.append((f"int8 {rows}x{cols} product, each", linear, (1, rows), len(w)))
    print(f"this build vs {a.other}, {a.threads} threads, median of {a.rounds} alternating rounds (us)")
    for name, run, shape, n in jobs:
        times: dict[str, list[float]] = {b: [] for b in builds}
        outs = {}
        for _ in range(a.rounds):
            for b, m in builds.items():
                out = np.empty(shape, np.float32)
                t = time.perf_counter()
                run(m, out)
                times[b].append((time.perf_counter() - t) / n * 1e6)
                outs[b] = out
        this, other = statistics.median(times["this"]), statistics.median(times["other"])
        same = np.array_equal(outs["this"], outs["other"])
        print(f"{name}: this {this:.1f}, other {other:.1f} ({this / other:.2f}x){'' if same else ', DIFFERENT bits'}")


if __name__ == "__main__":
    main()
