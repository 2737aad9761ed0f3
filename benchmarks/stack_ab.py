"""Decode with the layer stack as one loop of native calls (`layers.stack.stack_run`) and with
the modules one by one, taking turns in one process.

    python benchmarks/stack_ab.py [--rounds 3] [--threads 2]              # the demo model, bf16
    python benchmarks/stack_ab.py --random-30b [--layers 8] [--row int4]  # Qwen3-30B-A3B shapes

Demo model: greedy decoding of the speculative benchmark's prompts (64 tokens each) through
`generate`, plain and at N=2 drafts, each round once with the stack and once without; prints
tok/s per round and says whether the outputs were the same. --random-30b: the random
Qwen3-30B-A3B-shaped model of vs_llamacpp.py (built in memory, quantized by --row), one-token
decode steps at 512 tokens of context, blocks of 10 steps taking turns; prints the median
step time of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from moerun.layers import stack


STACK = stack.stack_run


def modules_only(*args):
    return None


def demo(a) -> None:
    import moerun
    from speculative import PROMPTS, run_one

    llm = moerun.load(None, threads=a.threads, dtype="bfloat16")
    tok_s, outs, same = {}, {}, True
    for _ in range(a.rounds):
        for mode, fn in (("stack", STACK), ("modules", modules_only)):
            stack.stack_run = fn
            for draft in (0, 2):
                n = dec = 0
                for p in PROMPTS:
                    out, fig = run_one(llm, p, 64, draft)
                    n, dec = n + len(out), dec + fig["decode_s"]
                    same &= outs.setdefault(p, out) == out
                tok_s.setdefault((mode, draft), []).append(n / dec)
    stack.stack_run = STACK
    for (mode, draft), v in tok_s.items():
        print(f"{mode:8s} {'plain' if draft == 0 else 'N=2':5s} tok/s per round: " + " / ".join(f"{x:.0f}" for x in v))
    for draft in (0, 2):
        print(f"stack / modules, {'plain' if draft == 0 else 'N=2'}: "
              + " / ".join(f"{x / y:.2f}x" for x, y in zip(tok_s[("stack", draft)], tok_s[("modules", draft)])))
    print(f"same greedy output in every run: {same}")


def random_30b(a) -> None:
    from moerun import kernels
    from moerun.layers.cache import Cache
    from vs_llamacpp import build_model

    net, args = build_model(a.layers, a.row)
    torch.set_num_threads(a.threads)
    kernels.set_threads(None)
    kernels.split_threads(net, a.threads)
    prompt = torch.randint(300, args.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    cache = Cache(net.cache_spec(), 1, 512 + 16, torch.bfloat16)
    plans, times = {}, {"stack": [], "modules": []}
    with torch.inference_mode():
        net(prompt, cache, last_only=True, plans=plans)
        for _ in range(a.rounds):
            for mode in times:
                stack.stack_run = STACK if mode == "stack" else modules_only
                for i in range(10):
                    cache.lengths[0] = 512
                    t = time.perf_counter()
                    net(prompt[:, i : i + 1], cache, last_only=True, plans=plans)
                    if i >= 2:  # a run's first steps warm its buffers up
                        times[mode].append(time.perf_counter() - t)
    stack.stack_run = STACK
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{a.layers} Qwen3-30B-A3B-shaped layers, {a.row}, {a.threads} threads, 512 tokens of context: "
          f"stack {med['stack'] * 1e3:.2f} ms, modules {med['modules'] * 1e3:.2f} ms a step "
          f"({med['stack'] / med['modules']:.2f}x), medians of {len(times['stack'])} steps each")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--random-30b", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--row", default="int4", help="--random-30b: quantization policy, int4 or int8")
    a = ap.parse_args(argv)
    random_30b(a) if a.random_30b else demo(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
