"""Throughput of the native GEMM (`kernels.qlinear`; float weights through `qlinear_multi`)
at decode, verification and prefill shapes, for int4 and int8, and float32 / bfloat16 rows.

    python benchmarks/gemm.py [--threads 1] [--shapes 1x32768x2048,4x32768x2048,48x768x2048]
                              [--formats int4,int8,bfloat16,float32] [--rounds 5] [--import-from DIR]

A shape is TOKENSxROWSxINPUTS. Weights with many rows come from DRAM (decode streams them);
for rows that fit in the caches the same matrix is reused, as a prefill tile reuses an
expert's rows. It prints GMAC/s and the weight bytes read per second, best of --rounds.
--import-from DIR measures another checkout's code instead (`git worktree add /tmp/old
COMMIT`, its native extension built or copied into DIR/moerun), for a before/after
comparison run back to back; each checkout quantizes with its own formats.
"""

from __future__ import annotations

import argparse
import time

from checkout import parse_args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default="1x32768x2048,4x32768x2048,48x768x2048")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--rounds", type=int, default=5)
    a = parse_args(ap, argv)
    import torch

    from moerun import kernels
    from moerun.quant import formats

    torch.manual_seed(0)
    kernels.set_threads(a.threads)
    print(f"{kernels.describe()}; {a.threads} thread(s); code from {kernels.__file__}")
    print("| format | tokens x rows x inputs | GMAC/s | weight GB/s |")
    print("|---|---|---|---|")
    for fmt in a.formats.split(","):
        for shape in a.shapes.split(","):
            T, N, K = map(int, shape.split("x"))
            x = torch.randn(T, K)
            if fmt in ("float32", "bfloat16"):  # unquantized rows, read as they are
                w = (torch.randn(N, K) * 0.02).to(getattr(torch, fmt))
                s = torch.empty(0)
                p = kernels.float_packed(w)
                run = lambda: kernels.qlinear_multi(x, [p])  # noqa: E731
            else:
                w, s = formats.quantize(torch.randn(N, K) * 0.02, fmt)
                run = lambda: kernels.qlinear(x, w, s, fmt, K)  # noqa: E731
            run()  # warm-up (and the workspace)
            best = float("inf")
            for _ in range(a.rounds):
                t = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t)
            nbytes = w.numel() * w.element_size() + s.numel() * s.element_size()
            print(f"| {fmt} | {shape} | {T * N * K / best / 1e9:.1f} | {nbytes / best / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
