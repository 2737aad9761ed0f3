"""MTP self-speculative decoding: decode tok/s without speculation and with N draft tokens.

    python benchmarks/speculative.py [-m PATH] [--threads 2] [--gen-tokens 64] [--drafts 0,1,2,3,auto] [--rounds R] [--json]

Single stream (one prompt at a time), greedy. For every setting it prints decode tok/s (the
mean over the prompts, each timed in the same run), the acceptance rate of drafts, tokens
emitted per verification step, and the routed-expert bytes the trunk reads per emitted
token (the union of the experts of a verification pass) against one plain decode token.
It checks that every speculative output equals the plain greedy output.

Without -m it uses the bundled demo model; when that is missing it builds a tiny random
qwen3_5_moe model with an MTP head (and says so): its random head is a poor drafter, so
only the cost side of the figures means anything there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import moerun
from moerun.engine.llm import DEMO_MODEL

PROMPTS = [
    "def fibonacci(n):\n",
    "The os module provides",
    "import sys\nimport os\n\n\nclass ",
    "Changed in version 3.8:",
]


def random_model(path: Path) -> Path:
    """A tiny random qwen3_5_moe checkpoint with an MTP head (transformers needed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_speculative import build_qwen

    from conftest import make_tokenizer

    build_qwen(path, vocab_size=300, hidden_size=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)
    make_tokenizer(path)
    return path


def run_one(llm, prompt: str, gen_tokens: int, draft) -> tuple[list[int], dict]:
    ids = llm.encode_prompt(prompt)
    kw = dict(max_tokens=gen_tokens, temperature=0.0)
    if draft != 0:
        kw.update(speculative="mtp", draft_tokens=draft)
    out = llm.generate_ids([ids], **kw)[0]
    st = llm.last_stats
    fig = {"decode_tok_s": st.decode_tok_s, "generated_tokens": st.generated_tokens, "decode_s": st.decode_s}
    if draft != 0:
        fig.update(st.as_dict())
    return out, fig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--drafts", default="0,1,2,3,auto", help="comma-separated: 0 (no speculation), 1..4, auto")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts (settings interleaved)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    note = ""
    if args.model is None:
        if (DEMO_MODEL / "config.json").is_file():
            args.model = DEMO_MODEL
        else:
            args.model = random_model(Path(tempfile.mkdtemp(prefix="moerun_spec_")))
            note = "demo model missing: a tiny RANDOM qwen3_5_moe with a random MTP head"
    llm = moerun.load(args.model, dtype=args.dtype, threads=args.threads)
    if not llm.net.has_mtp:
        raise SystemExit(f"{args.model} has no MTP head")
    drafts = [d if d == "auto" else int(d) for d in args.drafts.split(",")]
    prompts = PROMPTS[: args.prompts]
    # warm up every path once (allocator, first-call costs)
    for d in drafts:
        run_one(llm, prompts[0], 8, d)

    # settings interleaved prompt by prompt and round by round, so that the load of a shared
    # machine falls on all of them alike
    plain_out: dict = {}
    figs: dict = {d: [] for d in drafts}
    same = {d: True for d in drafts}
    for _ in range(args.rounds):
        for p in prompts:
            for d in drafts:
                out, fig = run_one(llm, p, args.gen_tokens, d)
                if d == 0:
                    plain_out[p] = out
                elif p in plain_out:
                    same[d] &= out == plain_out[p]
                figs[d].append(fig)
    results = {}
    for d in drafts:
        fs = figs[d]
        tokens = sum(f["generated_tokens"] - 1 for f in fs)
        secs = sum(f["decode_s"] for f in fs)
        r = {"decode_tok_s": tokens / secs if secs else 0.0}
        if d != 0:
            mean = lambda key: sum(f[key] for f in fs) / len(fs)  # noqa: E731
            r.update(
                acceptance_rate=mean("acceptance_rate"),
                accepted_tokens_per_step=mean("accepted_tokens_per_step"),
                expert_bytes_per_token=mean("expert_bytes_per_token"),
                single_token_expert_bytes=fs[0]["single_token_expert_bytes"],
                extra_expert_bytes_per_token=mean("extra_expert_bytes_per_token"),
                draft_expert_bytes_per_token=mean("draft_expert_bytes_per_token"),
                identical_to_plain=same[d] if plain_out else None,
            )
            if d == "auto":
                hist: dict = {}
                for f in fs:
                    for n, c in f["draft_tokens_used"].items():
                        hist[n] = hist.get(n, 0) + c
                r["draft_tokens_used"] = hist
        results["plain" if d == 0 else f"mtp_{d}"] = r
    base = results.get("plain", {}).get("decode_tok_s")
    for r in results.values():
        if base:
            r["speedup"] = r["decode_tok_s"] / base
    report = {"model": str(args.model), "note": note, "threads": args.threads, "dtype": args.dtype, "gen_tokens": args.gen_tokens,
              "prompts": len(prompts), "rounds": args.rounds, "results": results}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    if note:
        print(f"NOTE: {note}")
    print(f"{args.model}  threads={args.threads}  {len(prompts)} prompts x {args.gen_tokens} tokens, greedy, single stream")
    print(f"{'setting':10} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/step':>9} {'expertB/tok':>12} {'extra':>10} {'same':>5}")
    for name, r in results.items():
        print(f"{name:10} {r['decode_tok_s']:8.1f} {r.get('speedup', 1.0):8.2f} "
              f"{r.get('acceptance_rate', float('nan')):7.2f} {r.get('accepted_tokens_per_step', 1.0):9.2f} "
              f"{r.get('expert_bytes_per_token', r.get('single_token_expert_bytes', 0)):12.0f} "
              f"{r.get('extra_expert_bytes_per_token', 0):10.0f} {str(r.get('identical_to_plain', '')):>5}")
        if "draft_tokens_used" in r:
            print(f"{'':10} auto chose N: {r['draft_tokens_used']}")


if __name__ == "__main__":
    main()
