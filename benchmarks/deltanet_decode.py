"""Decode with Gated DeltaNet's native step (`kernels.deltanet_decode`) against its torch
reference (`kernels.reference.few_tokens_ref`), side by side in one process.

    python benchmarks/deltanet_decode.py [-m PATH] [--threads 2] [--context 64] [--steps 10] [--rounds 5]
    python benchmarks/deltanet_decode.py [-m PATH] --op-only   # the native op alone, 1-5 tokens

PATH is a Qwen3.5/3.6-MoE checkpoint (default: the bundled demo model); for Qwen3.6-35B-A3B
layer shapes make one with `moerun random-model qwen3.6-35b-a3b --layers 4 -o DIR` (and
`moerun quantize -m DIR -o DIR-int4` for the int4 policy). Each round prefills --context
random tokens and times --steps one-token decode steps (LM head over the last token only)
with the native step, then with the reference; the rounds alternate so that a shared
machine's load falls on both. Prints the median ms per token of each, and the median time
inside one DeltaNet layer (forward hooks; its projections included), which the LM head's
and experts' memory traffic does not blur.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import moerun
from moerun import kernels
from moerun.layers.cache import Cache
from moerun.engine.llm import DEMO_MODEL


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=DEMO_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--op-only", action="store_true",
                    help="time the native op alone at the model's shapes: one token in place, and passes of 2-5 "
                         "tokens that keep every token's state (a speculative verification pass)")
    args = ap.parse_args(argv)

    llm = moerun.load(args.model, dtype=args.dtype, threads=args.threads)
    net = llm.net
    types = getattr(net.args, "layer_types", ())
    n_delta = sum(t == "linear_attention" for t in types)
    if not n_delta:
        raise SystemExit(f"{args.model} has no Gated DeltaNet layers")
    if args.op_only:
        return op_only(net, args.threads, args.rounds)
    native = kernels.deltanet_decode_is_native
    # time inside the DeltaNet layers too (projections included): less noisy than whole steps
    layer_s, started = [0.0], {}
    deltas = [layer.linear_attn for layer in net.model.layers if hasattr(layer, "linear_attn")]

    def enter(mod, args):
        started[id(mod)] = time.perf_counter()

    def leave(mod, args, out):
        layer_s[0] += time.perf_counter() - started[id(mod)]

    for m in deltas:
        m.register_forward_pre_hook(enter)
        m.register_forward_hook(leave)
    in_layers: dict[str, list[float]] = {"native": [], "torch": []}
    ids = torch.randint(0, net.args.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"native": [], "torch": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name in times:
                kernels.deltanet_decode_is_native = native if name == "native" else (lambda *a: False)
                try:
                    cache = Cache(net.cache_spec(), 1, args.context + args.steps + 4, llm.dtype, llm.kv_dtype)
                    slots = torch.tensor([0])
                    net(ids, cache, slots, last_only=True)
                    x = ids[:, -1:]
                    for _ in range(2):  # warm
                        net(x, cache, slots, last_only=True)
                    layer_s[0] = 0.0
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        net(x, cache, slots, last_only=True)
                    times[name].append((time.perf_counter() - t) / args.steps * 1e3)
                    in_layers[name].append(layer_s[0] / args.steps / n_delta * 1e3)
                finally:
                    kernels.deltanet_decode_is_native = native
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.model}  {llm.dtype}  threads={args.threads}  {n_delta} of {len(types)} layers Gated DeltaNet  "
          f"kernels {kernels.isa()}  load {' '.join('%.2f' % x for x in os.getloadavg())}")
    lay = {k: statistics.median(v) for k, v in in_layers.items()}
    for k, v in times.items():
        print(f"{k:7s} {med[k]:8.2f} ms/token, {lay[k]:6.2f} ms per DeltaNet layer   "
              f"rounds (per token): {' '.join('%.2f' % x for x in v)}")
    print(f"one DeltaNet layer's decode step: native {lay['native']:.2f} ms, torch {lay['torch']:.2f} ms "
          f"({lay['torch'] / lay['native']:.2f}x); whole step {med['torch'] / med['native']:.2f}x")


def op_only(net, threads: int, rounds: int) -> None:
    """kernels.deltanet_decode alone on random inputs of one DeltaNet layer's shapes."""
    layer = next(layer.linear_attn for layer in net.model.layers if hasattr(layer, "linear_attn"))
    C, Hv, Dk, Dv = layer.in_proj_qkv.out_features, layer.n_v, layer.dk, layer.dv
    K = layer.conv1d.weight.shape[-1]
    g = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {}
    with torch.inference_mode():
        for _ in range(rounds * 20):
            for T in range(1, 6):  # interleaved
                r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
                conv, S, qkv = r(1, C, K - 1), 0.1 * r(1, Hv, Dk, Dv), r(1, T, C)
                a, b, z = r(1, T, Hv), r(1, T, Hv), r(1, T, Hv, Dv)
                t = time.perf_counter()
                kernels.deltanet_decode(qkv, layer.conv1d.weight, conv, a, b, layer.A_log, layer.dt_bias, S, z,
                                        layer.norm.weight, 1e-6, layer.n_k, T > 1)
                times.setdefault(T, []).append(time.perf_counter() - t)
    state_mb = Hv * Dk * Dv * 4 / 2**20
    print(f"kernels.deltanet_decode alone, {threads} threads, kernels {kernels.isa()}: C={C}, {Hv} value heads of "
          f"{Dk}x{Dv} ({state_mb:.1f} MiB of state per row)")
    one = statistics.median(times[1])
    for T, v in times.items():
        med = statistics.median(v)
        mode = "in place" if T == 1 else "every state kept"
        print(f"  T={T} ({mode}): {1e6 * med:8.0f} us  ({med / one:.2f}x one token)")


if __name__ == "__main__":
    main()
