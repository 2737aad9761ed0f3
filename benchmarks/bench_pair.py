"""`moerun bench` on this checkout and on another one, taking turns in fresh processes.

    python benchmarks/bench_pair.py --import-from /tmp/old [-m PATH] [--dtype bfloat16] [--quant none]
                                    [--prompt-tokens 128] [--gen-tokens 16] [--pairs 2] [--threads 2]

Each pair runs the other checkout first, then this one, each in its own process (load,
warm-up, one `moerun.bench.run.bench`), so a drifting machine falls on both alike; it
prints every run's prefill and decode tok/s and each pair's ratio (this / other). The other
checkout is e.g. `git worktree add /tmp/old COMMIT` with its native extension built or
copied into /tmp/old/moerun (see checkout.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_one(a, src: str | None) -> dict:
    """One bench in a fresh process importing moerun from `src` (None: this checkout)."""
    code = f"""
import json, sys
sys.path.insert(0, {str(HERE)!r})
from checkout import import_from
import_from({src!r})
import moerun
from moerun.bench.run import bench
llm = moerun.load({a.model!r}, dtype={a.dtype!r}, threads={a.threads}, quant={a.quant!r})
bench(llm, prompt_tokens=8, gen_tokens=2)
print(json.dumps(bench(llm, prompt_tokens={a.prompt_tokens}, gen_tokens={a.gen_tokens})))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--import-from", required=True, help="the other checkout")
    ap.add_argument("-m", "--model", default=None, help="default: the bundled demo model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quant", default="none")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    print(f"model {a.model or 'demo'}, dtype {a.dtype}, quant {a.quant}, {a.threads} threads, "
          f"prompt {a.prompt_tokens}, decode {a.gen_tokens}; other = {a.import_from}")
    ratios: dict[str, list[float]] = {"prefill": [], "decode": []}
    for i in range(a.pairs):
        other, this = run_one(a, a.import_from), run_one(a, None)
        for k in ratios:
            ratios[k].append(this[f"{k}_tok_s"] / other[f"{k}_tok_s"])
        print(f"pair {i + 1}: prefill {other['prefill_tok_s']:.1f} -> {this['prefill_tok_s']:.1f} tok/s "
              f"({ratios['prefill'][-1]:.2f}x), decode {other['decode_tok_s']:.2f} -> "
              f"{this['decode_tok_s']:.2f} tok/s ({ratios['decode'][-1]:.2f}x)")
    print("median of the pairs' ratios (this / other): "
          + ", ".join(f"{k} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
