"""Throughput of the native GEMM (`kernels.qlinear`; float weights through `qlinear_multi`)
at decode, verification and prefill shapes, for int4 and int8, and float32 / bfloat16 rows.

    python benchmarks/gemm.py [--threads 1] [--shapes 1x32768x2048,4x32768x2048,48x768x2048]
                              [--formats int4,int8,bfloat16,float32,q4_k,q5_k,q6_k,q5_0] [--rounds 5]
                              [--import-from DIR]
                              [--isas avx512vnni,amx] [--read-bandwidth] [--sum-column]

A shape is TOKENSxROWSxINPUTS. The raw GGUF formats (q4_k, q5_k, q6_k, q5_0) run on random
blocks (random quants, small fp16 scales). Weights with many rows come from DRAM (decode streams them);
for rows that fit in the caches the same matrix is reused, as a prefill tile reuses an
expert's rows. It prints GMAC/s and the weight bytes read per second, best of --rounds.
--import-from DIR measures another checkout's code instead (`git worktree add /tmp/old
COMMIT`, its native extension built or copied into DIR/moerun), for a before/after
comparison run back to back; each checkout quantizes with its own formats. --isas runs each
shape on several kernel paths of this CPU (`kernels.available_isas()`), taking turns call by
call, and says whether they gave the same bits. --read-bandwidth first prints what `torch.sum`
over 1 GiB reads per second on --threads threads (best of 3; vs_llamacpp.read_bandwidth), the
roofline a one-token product streaming its weights from DRAM is held against; the LM head of
the Qwen3.6-35B-A3B shape is `--shapes 1x248320x2048 --formats q6_k,q4_k,int8` (Q6_K in
llama-quantize's Q4_K_M; int8 is moerun's Q8_0). --sum-column adds, per shape, what
`torch.sum` reads per second over as many bytes as that shape's weights (float32 ones, on
--threads threads): the same roofline at the product's own size, in cache where it fits.
"""

from __future__ import annotations

import argparse
import time

from checkout import parse_args


def random_raw(fmt: str, n: int, k: int):
    """n rows of k inputs of a raw GGUF format: random bytes with small fp16 scales in place."""
    import torch

    from moerun.kernels import ggml

    be, bb, _ = ggml.BLOCKS[fmt]
    raw = torch.randint(0, 256, (n, k // be, bb), dtype=torch.uint8)
    d = (torch.rand(n, k // be) * 1e-3).half().view(torch.uint8).reshape(n, k // be, 2)
    for off in ((208,) if fmt == "q6_k" else (0,) if fmt == "q5_0" else (0, 2)):
        raw[..., off : off + 2] = d
    return raw.reshape(n, -1)


def sum_seconds(nbytes: int, rounds: int) -> float:
    """Best time of torch.sum over a float32 tensor of about nbytes bytes (the roofline a
    one-token product streaming the same bytes is held against; in cache when they fit)."""
    import torch

    x = torch.ones(max(1, nbytes // 4))
    x.sum()
    best = float("inf")
    for _ in range(max(rounds, 3)):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return best * nbytes / (x.numel() * 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default="1x32768x2048,4x32768x2048,48x768x2048")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isas", default=None, help="kernel paths to compare side by side (default: the one in use)")
    ap.add_argument("--read-bandwidth", action="store_true", help="print torch.sum's read bandwidth over 1 GiB first")
    ap.add_argument("--sum-column", action="store_true",
                    help="add a column: torch.sum (float32) over as many bytes as each shape's weights, best of --rounds")
    a = parse_args(ap, argv)
    import torch

    from moerun import kernels
    from moerun.kernels import formats

    torch.manual_seed(0)
    kernels.set_threads(a.threads)
    isas = a.isas.split(",") if a.isas else [kernels.isa()]
    for isa in isas:
        if isa not in kernels.available_isas():
            print(f"error: kernel path {isa!r} is not available here ({', '.join(kernels.available_isas())})")
            return 1
    print(f"{kernels.describe()}; {a.threads} thread(s); code from {kernels.__file__}")
    if a.read_bandwidth:
        from vs_llamacpp import read_bandwidth

        print(f"read bandwidth (torch.sum over 1 GiB, {a.threads} thread(s)): {read_bandwidth(a.threads) / 1e9:.1f} GB/s")
    print("| format | tokens x rows x inputs | " + " | ".join(f"{i} GMAC/s | {i} weight GB/s" for i in isas)
          + (" | same bits" if len(isas) > 1 else "") + (" | torch.sum GB/s, same bytes" if a.sum_column else "") + " |")
    print("|---|---|" + "---|---|" * len(isas) + ("---|" if len(isas) > 1 else "") + ("---|" if a.sum_column else ""))
    torch.set_num_threads(a.threads)
    for fmt in a.formats.split(","):
        for shape in a.shapes.split(","):
            T, N, K = map(int, shape.split("x"))
            x = torch.randn(T, K)
            if fmt == "bfloat16":  # a bf16 model's activations are bf16 values (the avx512bf16 path needs them)
                x = x.to(torch.bfloat16)
            if fmt in ("float32", "bfloat16"):  # unquantized rows, read as they are
                w = (torch.randn(N, K) * 0.02).to(getattr(torch, fmt))
                s = torch.empty(0)
                p = kernels.float_packed(w)
                run = lambda: kernels.qlinear_multi(x, [p])[0]  # noqa: E731
            elif fmt in getattr(formats, "RAW_FORMATS", ()):
                w, s = random_raw(fmt, N, K), torch.empty(N, 0, dtype=torch.float16)
                run = lambda: kernels.qlinear(x, w, s, fmt, K)  # noqa: E731
            else:
                w, s = formats.quantize(torch.randn(N, K) * 0.02, fmt)
                run = lambda: kernels.qlinear(x, w, s, fmt, K)  # noqa: E731
            best, outs = {}, {}
            for isa in isas:
                with kernels.use_isa(isa):
                    outs[isa] = run().clone()  # warm-up (and the workspace); the bits compared
            for _ in range(a.rounds):
                for isa in isas:
                    with kernels.use_isa(isa):
                        t = time.perf_counter()
                        run()
                        best[isa] = min(best.get(isa, float("inf")), time.perf_counter() - t)
            nbytes = w.numel() * w.element_size() + s.numel() * s.element_size()
            row = " | ".join(f"{T * N * K / best[i] / 1e9:.1f} | {nbytes / best[i] / 1e9:.1f}" for i in isas)
            same = all(torch.equal(outs[isas[0]], outs[i]) for i in isas)
            line = f"| {fmt} | {shape} | {row} |" + (f" {'yes' if same else 'no'} |" if len(isas) > 1 else "")
            if a.sum_column:
                line += f" {nbytes / sum_seconds(nbytes, a.rounds) / 1e9:.1f} |"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
