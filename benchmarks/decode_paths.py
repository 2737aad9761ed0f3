"""Decode and prefill of one checkpoint with its experts resident and in the expert store's
RAM tier at several budgets, rounds interleaved, each run a fresh `moerun bench` process.

    python benchmarks/decode_paths.py -m /var/tmp/q3-8l-int4 [--budgets 100%,50%,25%]
        [--rounds 3] [--prompt-tokens 128] [--gen-tokens 32] [--threads 2] [--import-from DIR]
        [--batches 1,4,16] [--predictor layer_ahead1]

Prints each setting's median decode and prefill tok/s with their ranges, its ratio to the
resident setting of the same rounds, the store's hit rate and stall per token, and how the
decode pass ran (`decode_path`, where the checkout reports it). `--import-from` measures
another checkout's moerun instead (checkout.py), for before/after figures. `--batches`: also
greedy generation for batches of that many rows (prompts of different lengths, experts
resident), the aggregate decode tok/s of each against one row, rounds interleaved.
`--predictor NAME`: the store's settings run with that prefetch predictor attached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_one(a, budget: str | None) -> dict:
    """One `moerun bench --json` in a fresh process; budget None: experts resident."""
    argv = ["bench", "-m", a.model, "--threads", str(a.threads), "--prompt-tokens", str(a.prompt_tokens),
            "--gen-tokens", str(a.gen_tokens), "--json"]
    if budget:
        argv += ["--ram-budget", budget]
        if a.predictor:
            argv += ["--predictor", a.predictor]
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); from checkout import import_from; "
            f"import_from({a.import_from!r}); from moerun.cli import main; sys.exit(main({argv!r}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"decode_paths: `moerun {' '.join(argv)}` failed: {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_batches(a, batches: list[int]) -> dict[int, float]:
    """Aggregate decode tok/s of greedy generation for each batch width, in one fresh process."""
    code = f"""
import json, sys, torch
sys.path.insert(0, {str(HERE)!r})
from checkout import import_from
import_from({a.import_from!r})
import moerun
llm = moerun.load({a.model!r}, threads={a.threads})
g = torch.Generator().manual_seed(0)
V = llm.args.vocab_size
out = {{}}
for B in {batches!r}:
    prompts = [torch.randint(0, V, (16 + 5 * b,), generator=g).tolist() for b in range(B)]
    llm.generate_ids(prompts, max_tokens=4, temperature=0.0)  # warm-up: first use of this width's buffers
    llm.generate_ids(prompts, max_tokens={a.gen_tokens}, temperature=0.0)
    out[B] = llm.last_stats.decode_tok_s
print(json.dumps(out))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"decode_paths: the batch run failed: {p.stderr.strip().splitlines()[-1:]}")
    return {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


def _range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="checkpoint directory (a quantized one keeps its format) or GGUF file")
    ap.add_argument("--budgets", default="100%,50%,25%", help="comma-separated --ram-budget values")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each running every setting once")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--import-from", default=None, help="a checkout whose moerun to measure instead")
    ap.add_argument("--batches", default=None, help="comma-separated batch widths to time as well, e.g. 1,4,16")
    ap.add_argument("--predictor", default=None, help="a prefetch predictor for the store's settings, e.g. layer_ahead1")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not (Path(a.model, "config.json").is_file() or (a.model.endswith(".gguf") and Path(a.model).is_file())):
        ap.error(f"{a.model} is neither a model directory (no config.json) nor a GGUF file")
    settings = [None] + [b for b in a.budgets.split(",") if b]
    runs: dict[str | None, list[dict]] = {s: [] for s in settings}
    for r in range(a.rounds):
        for s in settings:
            runs[s].append(run_one(a, s))
            d = runs[s][-1]
            print(f"round {r + 1} {s or 'resident':>8}: decode {d['decode_tok_s']:.2f} prefill {d['prefill_tok_s']:.2f}",
                  file=sys.stderr)
    print(f"model {a.model}, {a.threads} threads, prompt {a.prompt_tokens}, {a.gen_tokens} tokens decoded, "
          f"{a.rounds} rounds interleaved{', moerun from ' + a.import_from if a.import_from else ''}")
    print("| setting | decode tok/s | x resident | prefill tok/s | hit rate | stall ms/token | decode path |")
    print("|---|---|---|---|---|---|---|")
    base = [d["decode_tok_s"] for d in runs[None]]
    for s in settings:
        ds = runs[s]
        dec = [d["decode_tok_s"] for d in ds]
        ratio = statistics.median(x / b for x, b in zip(dec, base))
        st = ds[-1]
        hit = f"{st['expert_hit_rate']:.3f}" if "expert_hit_rate" in st else "-"
        stall = f"{1000 * st['stall_s_per_token']:.1f}" if "stall_s_per_token" in st else "-"
        path = ds[-1].get("decode_path", "-")  # (checkouts before it have none)
        if isinstance(path, dict):
            path = f"{path['native_stack_passes']} stack / {path['module_passes']} modules" + \
                (f" ({path['why']})" if path["why"] else "")
        print(f"| {s or 'resident'} | {_range(dec)} | {ratio:.3f} | {_range([d['prefill_tok_s'] for d in ds])} | "
              f"{hit} | {stall} | {path} |")
    if a.batches:
        widths = sorted({1, *(int(b) for b in a.batches.split(","))})
        got = [run_batches(a, widths) for _ in range(a.rounds)]
        print("\n| rows | aggregate decode tok/s | x one row |\n|---|---|---|")
        for B in widths:
            xs = [r[B] for r in got]
            print(f"| {B} | {_range(xs)} | {statistics.median(r[B] / r[1] for r in got):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
