"""Each native call of one prompt pass, timed inside the pass and again alone: where a
model's prefill GEMMs run slower in the pass than their kernels do on their own.

    .venv/bin/python benchmarks/prefill_gemms.py -m FILE.gguf [--threads 2] [--prompt 512] [--replays 5]

The extension module is wrapped so that every call it gets during one 512-token pass (the
pass `moerun bench` times: one row, a fresh cache, last_only; after one warm-up pass) is
timed and its arguments kept. Then each `qlinear_multi` call (the projections: one call per
group of linears sharing an input) is run again alone --replays times on the same arrays,
and the best is printed next to the in-pass time, with the multiply-adds per second both
ways. The other calls (the MoE halves, the DeltaNet step, attention) are listed with their
in-pass times, grouped by name. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import numpy as np
import torch

import moerun
from moerun import kernels
from moerun.layers.cache import Cache

# calls that write only their output: run again alone on the same arrays
REPLAYABLE = {"qlinear_multi", "qlinear", "moe_experts", "swiglu_mlp"}
FMT_NAMES = {4: "int4", 8: "int8", 16: "bf16", 32: "f32", 106: "q5_0", 112: "q4_k", 113: "q5_k", 114: "q6_k"}


class Recorder:
    """Stands in for the extension module: times and records every call."""

    def __init__(self, nat):
        self._nat = nat
        self.calls = []
        self.on = False

    def __getattr__(self, name):
        fn = getattr(self._nat, name)
        if not callable(fn):
            return fn

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                if self.on:
                    self.calls.append((name, args, time.perf_counter() - t0))
        return timed


def qlinear_desc(args) -> tuple[str, int]:
    """(a description, multiply-adds) of a qlinear_multi call's arguments."""
    x, ws, _, codes, out = args
    M, K = x.shape
    rows = [int(w.shape[0]) for w in ws]
    fmts = "+".join(sorted({FMT_NAMES.get(int(c) & 0xFF, str(c)) for c in codes}))
    return f"{M} x {'+'.join(map(str, rows))} x {K} ({fmts})", M * K * sum(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--loop", default=None, metavar="NAME:SECONDS",
                   help="afterwards, replay the pass's calls of NAME for SECONDS (to profile them: perf record -p)")
    a = p.parse_args(argv)
    llm = moerun.load(a.model, threads=a.threads)
    net = llm.net
    nat = kernels._native()
    if nat is None:
        print("error: the native kernels are not in use", file=sys.stderr)
        return 1
    rec = Recorder(nat)
    kernels._state["native"] = rec
    prompt = torch.randint(300, net.args.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for r in range(2):
            cache = Cache(net.cache_spec(), 1, a.prompt + 8, llm.dtype)
            rec.on = r == 1
            t0 = time.perf_counter()
            net(prompt, cache, torch.tensor([0]), last_only=True)
            total = time.perf_counter() - t0
    rec.on = False
    kernels._state["native"] = nat
    print(f"{a.model}: {a.prompt}-token pass {total * 1e3:.0f} ms, {a.threads} threads, kernels {kernels.isa()}")
    print("\n| call | in pass ms | GMAC/s | alone ms (best of %d) | GMAC/s |\n|---|---|---|---|---|" % a.replays)
    sums = defaultdict(lambda: [0.0, 0.0, 0])
    for name, args, dt in rec.calls:
        if name != "qlinear_multi":
            s = sums[name]
            s[0] += dt
            s[2] += 1
            if name in REPLAYABLE:
                s[1] += min(_timed(getattr(nat, name), args) for _ in range(a.replays))
            continue
        desc, macs = qlinear_desc(args)
        best = min(_timed(nat.qlinear_multi, args) for _ in range(a.replays))
        print(f"| {desc} | {dt * 1e3:.1f} | {macs / dt / 1e9:.0f} | {best * 1e3:.1f} | {macs / best / 1e9:.0f} |")
        s = sums["qlinear_multi"]
        s[0] += dt
        s[1] += best
        s[2] += 1
    print("\n| native call | calls | in pass ms | share of the pass | alone ms |\n|---|---|---|---|---|")
    for name, (t, alone, n) in sorted(sums.items(), key=lambda kv: -kv[1][0]):
        al = f"{alone * 1e3:.1f}" if name in REPLAYABLE else "-"
        print(f"| {name} | {n} | {t * 1e3:.1f} | {100 * t / total:.0f}% | {al} |")
    outside = total - sum(v[0] for v in sums.values())
    print(f"| (outside native calls) | | {outside * 1e3:.1f} | {100 * outside / total:.0f}% |")
    if a.loop:
        name, secs = a.loop.split(":")
        mine = [c for c in rec.calls if c[0] == name]
        fn, end, n = getattr(nat, name), time.perf_counter() + float(secs), 0
        while time.perf_counter() < end:
            for _, args, _ in mine:
                fn(*args)
            n += 1
        print(f"looped {name} {n} times over {len(mine)} calls")
    return 0


def _timed(fn, args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
