"""MTP self-speculative decoding: decode tok/s without speculation and with N draft tokens.

    python benchmarks/speculative.py [-m PATH] [--threads 2] [--gen-tokens 64] [--drafts 0,1,2,3,auto]
                                     [--draft-vocab all,1024] [--rounds R] [--ram-budget 50%]
                                     [--prefetch both|on|off] [--pass-times] [--sampled] [--json]

Single stream (one prompt at a time), greedy (--sampled: the model's generation config,
seeded per prompt and round, the same seeds for every setting). For every setting it prints decode tok/s (over
all prompts, settings interleaved prompt by prompt so a shared machine's load falls on all
alike), the acceptance rate of drafts, tokens emitted per verification step, and the
routed-expert bytes the trunk reads per emitted token (the union of the experts of a
verification pass) against one plain decode token. It checks that every speculative output
equals the plain greedy output (greedy only), and prints the machine's load average before and after.

With --ram-budget the routed experts sit in an expert store holding that share in RAM (the
rest read from disk on a miss); each speculative setting then runs with and without
hinting the drafts' experts to the store (`DraftPrefetch`), and the rows add the bytes read
from disk and the seconds waited for experts, per emitted token. Every run starts from an
emptied store (`ExpertStore.evict_all`): otherwise each would find what the run before it,
on the same prompt, left in RAM.

--draft-vocab lists draft vocabularies (`all`, or N: draft among the first N token ids);
each speculative setting runs with each, interleaved too, and --pass-times times an MTP
call with each.

Without -m it uses the bundled demo model; when that is missing it builds a tiny random
qwen3_5_moe model with an MTP head (and says so): its random head is a poor drafter, so
only the cost side of the figures means anything there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import moerun
from moerun.engine.generate import Sequence, run_plans
from moerun.engine.llm import DEMO_MODEL
from moerun.engine.draft_extras import draft_head, store_figures
from moerun.engine.speculative import SpeculativeStats, new_draft_length, run_speculative
from moerun.errors import MoerunError

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


def run_one(llm, prompt: str, gen_tokens: int, draft, prefetch: bool = True, chooser=None,
            draft_vocab: int | None = None, sampling: dict | None = None) -> tuple[list[int], dict]:
    """One continuation, greedy unless `sampling` (SamplingParams fields over the model's
    generation config): plain (draft 0) or speculative; its ids and figures."""
    sampling = {"temperature": 0.0} if sampling is None else sampling
    ids = llm.encode_prompt(prompt)
    store = getattr(llm, "store", None)
    if store is not None:  # every run starts from the same cold store, not from what the one before left
        store.evict_all()
    before = store_figures(store) if store is not None else (0, 0.0)
    cpu0 = time.thread_time()
    if draft == 0:
        out = llm.generate_ids([ids], max_tokens=gen_tokens, **sampling)[0]
        st = llm.last_stats
    else:
        seq = Sequence(ids, llm.sampling_params(max_tokens=gen_tokens, **sampling))
        st = SpeculativeStats()
        for _ in run_speculative(llm.net, [seq], llm.eos_ids(), llm.dtype, st, draft, chooser=chooser,
                                 kv_dtype=llm.kv_dtype, prefetch=prefetch, draft_vocab=draft_vocab):
            pass
        out = seq.out_ids
    cpu = time.thread_time() - cpu0
    after = store_figures(store) if store is not None else (0, 0.0)
    fig = {"decode_tok_s": st.decode_tok_s, "generated_tokens": st.generated_tokens, "decode_s": st.decode_s, "cpu_s": cpu,
           "moved_bytes": after[0] - before[0], "stall_s": after[1] - before[1]}
    if draft != 0:
        fig.update(st.as_dict())
    return out, fig


def pass_times(llm, max_tokens: int = 4, repeats: int = 50, draft_vocabs=(None,)) -> dict:
    """Median wall time (ms) of a trunk pass of T = 1..max_tokens tokens after a prompt (a
    decode step, then verification passes) and of one MTP head call on one token (through a
    `Drafter` where the model makes one, as single-stream decoding does): what a speculative
    step is made of. Each pass takes other tokens at another place in the cache (seeded), as
    a run's passes do, not the same ones each time. The passes take turns (T = 1..4, then
    the MTP calls), so each trunk pass follows another pass or the head's call: a loop's
    order matters (ad hoc, one-token passes back to back took 1.08 ms, one after two MTP
    calls 1.18)."""
    import random

    from moerun.layers.cache import Cache, RecurrentState

    net = llm.net
    ids = torch.tensor([llm.encode_prompt(PROMPTS[1])])
    rnd = random.Random(0)
    V = net.lm_head.out_features
    slack = 64  # the places a pass may start at, after the prompt
    cache = Cache(net.cache_spec(), 1, ids.shape[1] + slack + max_tokens + 8, llm.dtype, llm.kv_dtype)
    mtp_cache = Cache(net.mtp_cache_spec(), 1, ids.shape[1] + slack + max_tokens + 8, llm.dtype, llm.kv_dtype)
    for layer in cache.layers:
        if isinstance(layer, RecurrentState):
            layer.positions = {}  # as speculative decoding runs them: every token's state kept
    slots = torch.tensor([0])

    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        _, hidden = net(ids, cache, slots, last_only=True, return_hidden=True)
        n0 = int(cache.lengths[0])

        plans = run_plans(net)  # as a run makes its passes

        def trunk(T):  # the recurrent state moves on each time; its cost does not depend on it
            cache.lengths[0] = n0 + rnd.randrange(slack)
            net(torch.tensor([[rnd.randrange(V) for _ in range(T)]]), cache, slots, return_hidden=True, **plans)

        def mtp(head):  # as a single-stream run calls the head: through its drafter, where it has one
            drafter = drafters.get(head)
            tok, at = torch.tensor([[rnd.randrange(V)]]), n0 + rnd.randrange(slack)
            if drafter is None or drafter.run(hidden[:, -1:], tok, at) is None:
                mtp_cache.lengths[0] = at
                net.mtp_logits(hidden[:, -1:], tok, mtp_cache, slots, return_hidden=True, head=head)

        drafters = {}

        jobs = {f"trunk_{T}_ms": (lambda T=T: trunk(T)) for T in range(1, max_tokens + 1)}
        for dv in draft_vocabs:
            head = None if dv is None else draft_head(net.lm_head, dv)
            if hasattr(net, "mtp_drafter"):
                drafters[head] = net.mtp_drafter(mtp_cache, 0, head)
            jobs["mtp_call_ms" if dv is None else f"mtp_call_v{dv}_ms"] = lambda head=head: mtp(head)
        for i in range(repeats + 1):  # interleaved, so that a drifting machine load falls on all alike
            for key, f in jobs.items():
                t = time.perf_counter()
                f()
                if i:  # the first round warms up
                    times.setdefault(key, []).append(1e3 * (time.perf_counter() - t))
    out = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", default=None, help="quantize at load (int4: routed experts int4 in native kernels)")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--drafts", default="0,1,2,3,auto", help="comma-separated: 0 (no speculation), 1..4, auto")
    ap.add_argument("--draft-vocab", default="all", help="comma-separated draft vocabularies: all, or N first token ids")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts (settings interleaved)")
    ap.add_argument("--ram-budget", default=None, help="experts in an expert store with this RAM budget (4GiB, 50%%)")
    ap.add_argument("--prefetch", default="both", choices=["both", "on", "off"],
                    help="with --ram-budget: speculative rows with the drafts' experts hinted to the store, without, or both")
    ap.add_argument("--pass-times", action="store_true",
                    help="also time a trunk pass of 1-4 tokens and one MTP call (medians), after the table")
    ap.add_argument("--sampled", action="store_true",
                    help="sample with the model's generation config (seeded per prompt and round) instead of greedy")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    note = ""
    if args.model is None:
        if (DEMO_MODEL / "config.json").is_file():
            args.model = DEMO_MODEL
        else:
            args.model = random_model(Path(tempfile.mkdtemp(prefix="moerun_spec_")))
            note = "demo model missing: a tiny RANDOM qwen3_5_moe with a random MTP head"
    if args.ram_budget and args.quant:
        raise SystemExit("--quant together with --ram-budget is not supported (the expert store holds unquantized experts)")
    load_before = os.getloadavg()
    if args.ram_budget:
        from moerun.experts import StoreOptions
        from moerun.experts import load as load_with_store

        llm = load_with_store(args.model, dtype=args.dtype, threads=args.threads, options=StoreOptions(ram_budget=args.ram_budget))
    else:
        llm = moerun.load(args.model, dtype=args.dtype, threads=args.threads, quant=args.quant)
    if not llm.net.has_mtp:
        raise SystemExit(f"{args.model} has no MTP head")
    drafts = [d if d == "auto" else int(d) for d in args.drafts.split(",")]
    vocabs = [None if v == "all" else int(v) for v in args.draft_vocab.split(",")]
    prefetch = {"both": (True, False), "on": (True,), "off": (False,)}[args.prefetch] if args.ram_budget else (True,)
    settings = [(d, pf, dv) for d in drafts for pf in ((True,) if d == 0 else prefetch)
                for dv in ((None,) if d == 0 else vocabs)]
    name = {(d, pf, dv): "plain" if d == 0 else f"mtp_{d}" + ("" if dv is None else f"_v{dv}")
            + ("" if not args.ram_budget else "_prefetch" if pf else "_noprefetch") for d, pf, dv in settings}
    choosers = {st: new_draft_length(llm.net) for st in settings if st[0] == "auto"}  # each learns across prompts
    prompts = PROMPTS[: args.prompts]
    # warm up every path once (allocator, first-call costs)
    for d, pf, dv in settings:
        run_one(llm, prompts[0], 8, d, pf, choosers.get((d, pf, dv)), dv)

    # settings interleaved prompt by prompt and round by round, so that the load of a shared
    # machine falls on all of them alike
    plain_out: dict = {}
    figs: dict = {st: [] for st in settings}
    same = {st: True for st in settings}
    for rnd in range(args.rounds):
        for k, p in enumerate(prompts):
            for st in settings:
                d, pf, dv = st
                sampling = {"seed": 1000 * rnd + k} if args.sampled else None
                out, fig = run_one(llm, p, args.gen_tokens, d, pf, choosers.get(st), dv, sampling)
                if d == 0 and not args.sampled:  # sampled runs share a law, not tokens: nothing to compare
                    plain_out[p] = out
                elif p in plain_out:
                    same[st] &= out == plain_out[p]
                figs[st].append(fig)
    results = {}
    for st in settings:
        d, fs = st[0], figs[st]
        tokens = sum(f["generated_tokens"] - 1 for f in fs)
        secs = sum(f["decode_s"] for f in fs)
        # a loaded machine slows some runs more than others: also the fastest round of each prompt
        best = sum(min(f["decode_s"] for f in fs[i :: len(prompts)]) for i in range(len(prompts))) / args.rounds
        r = {"decode_tok_s": tokens / secs if secs else 0.0, "best_round_decode_tok_s": tokens / best if best else 0.0,
             # the main thread's CPU time per generated token (prefill included): with --threads 1 and no
             # store, the figure a shared machine's load disturbs least
             "cpu_ms_per_token": 1e3 * sum(f["cpu_s"] for f in fs) / max(sum(f["generated_tokens"] for f in fs), 1)}
        if args.ram_budget:  # per token out of the decode loop (the first comes from prefill)
            r["moved_expert_bytes_per_token"] = sum(f["moved_bytes"] for f in fs) / max(tokens, 1)
            r["expert_stall_s_per_token"] = sum(f["stall_s"] for f in fs) / max(tokens, 1)
        if d != 0:
            mean = lambda key: sum(f[key] for f in fs) / len(fs)  # noqa: E731
            r.update(
                acceptance_rate=mean("acceptance_rate"),
                accepted_tokens_per_step=mean("accepted_tokens_per_step"),
                expert_bytes_per_token=mean("expert_bytes_per_token"),
                single_token_expert_bytes=fs[0]["single_token_expert_bytes"],
                extra_expert_bytes_per_token=mean("extra_expert_bytes_per_token"),
                draft_expert_bytes_per_token=mean("draft_expert_bytes_per_token"),
                identical_to_plain=same[st] if plain_out else None,
            )
            if d == "auto":
                hist: dict = {}
                for f in fs:
                    for n, c in f["draft_tokens_used"].items():
                        hist[n] = hist.get(n, 0) + c
                r["draft_tokens_used"] = hist
        results[name[st]] = r
    plain = results.get("plain")
    for r in results.values():
        if plain:
            r["speedup"] = r["decode_tok_s"] / plain["decode_tok_s"]
            r["best_round_speedup"] = r["best_round_decode_tok_s"] / plain["best_round_decode_tok_s"]
            r["cpu_speedup"] = plain["cpu_ms_per_token"] / r["cpu_ms_per_token"]
    report = {"model": str(args.model), "note": note, "threads": args.threads, "dtype": args.dtype, "quant": args.quant,
              "sampled": args.sampled, "gen_tokens": args.gen_tokens,
              "prompts": len(prompts), "rounds": args.rounds, "ram_budget": args.ram_budget,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "results": results}
    if args.pass_times:
        report["pass_times"] = pass_times(llm, draft_vocabs=vocabs)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    if note:
        print(f"NOTE: {note}")
    print(f"{args.model}  threads={args.threads}  {len(prompts)} prompts x {args.gen_tokens} tokens x {args.rounds} rounds, "
          + ("sampled (generation config, seeded)" if args.sampled else "greedy") + ", single stream"
          + (f", RAM budget {args.ram_budget}" if args.ram_budget else ""))
    print("load average before/after: " + " / ".join(" ".join(f"{x:.2f}" for x in la) for la in (load_before, os.getloadavg())))
    store_cols = f" {'diskB/tok':>10} {'wait ms/tok':>11}" if args.ram_budget else ""
    print(f"{'setting':22} {'tok/s':>7} {'speedup':>7} {'best-round':>10} {'cpu ms/tok':>10} {'cpu x':>6} {'accept':>6} "
          f"{'tok/step':>8} {'expertB/tok':>11} {'extra':>8}{store_cols} {'same':>5}")
    for label, r in results.items():
        cols = (f" {r['moved_expert_bytes_per_token']:10.0f} {1e3 * r['expert_stall_s_per_token']:11.2f}"
                if args.ram_budget else "")
        print(f"{label:22} {r['decode_tok_s']:7.1f} {r.get('speedup', 1.0):7.2f} {r.get('best_round_speedup', 1.0):10.2f} "
              f"{r['cpu_ms_per_token']:10.2f} {r.get('cpu_speedup', 1.0):6.2f} "
              f"{r.get('acceptance_rate', float('nan')):6.2f} {r.get('accepted_tokens_per_step', 1.0):8.2f} "
              f"{r.get('expert_bytes_per_token', r.get('single_token_expert_bytes', 0)):11.0f} "
              f"{r.get('extra_expert_bytes_per_token', 0):8.0f}{cols} {str(r.get('identical_to_plain', '')):>5}")
        if "draft_tokens_used" in r:
            print(f"{'':22} auto chose N: {r['draft_tokens_used']}")
    if args.pass_times:
        pt = report["pass_times"]
        one = pt["trunk_1_ms"]
        print("pass times (median ms): " + ", ".join(
            f"trunk T={k.split('_')[1]} {v:.2f} ({v / one:.2f}x)" for k, v in pt.items() if k.startswith("trunk_"))
            + "".join(f", MTP call{'' if k == 'mtp_call_ms' else ' (' + k[9:-3] + ')'} {v:.2f} ({v / one:.2f}x)"
                      for k, v in pt.items() if k.startswith("mtp_call")))


if __name__ == "__main__":
    try:
        main()
    except MoerunError as e:  # a bad model path or option: one line, as the CLI says it
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
