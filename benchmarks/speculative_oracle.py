"""MTP speculative decoding on a model whose own head cannot draft: what the steps cost, and
what they would give at a chosen acceptance (SIMULATED acceptance).

A random-weight checkpoint (`moerun random-model`, e.g. Qwen3.6-35B-A3B's layer shapes) has
an MTP head that predicts nothing, so its drafts are never accepted. Here every MTP call
still runs (its cost is real, the head's LM head read included), but the logits it returns
are replaced by the plain greedy continuation, right at a chosen share of the positions and
wrong at the others (a draw per position, the same in every run): the trunk's
verification, rollback and expert traffic are then what a head accepted that often would
cause. Decoding stays lossless (the output is checked against plain decoding). What is not
real is the acceptance, and with it how often rejections fall: the demo model's own head is
accepted 0.76 of the time at one draft, and 0.78 top-8 is claimed for Qwen3.6's.

    python benchmarks/speculative_oracle.py -m /var/tmp/q36-20l-e64 --quant int4 --acceptance 0.76
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import moerun
from moerun.engine.generate import Sequence
from moerun.engine.speculative import SpeculativeDecoder, SpeculativeStats, run_speculative
from moerun.errors import MoerunError


def oracle(sequence: list[int], acceptance: float, vocab: int):
    """A replacement for `SpeculativeDecoder._mtp` whose logits put the token of `sequence`
    at each predicted position where the position's fixed draw falls under `acceptance`,
    another token elsewhere."""
    real = SpeculativeDecoder._mtp

    def right(pos: int) -> bool:  # each position's own draw (an even pattern aliases with the steps' strides)
        return random.Random(pos).random() < acceptance

    def _mtp(dec, hidden, tokens, slots):
        start = int(dec.mtp_cache.lengths[slots[0]])  # (one row)
        logits, h = real(dec, hidden, tokens, slots)
        logits = logits.clone()
        T, rows = tokens.shape[1], logits.shape[1]
        for t in range(T - rows, T):
            pos = start + t + 2  # the position row t predicts
            if pos < len(sequence):
                want = sequence[pos] if right(pos) else (sequence[pos] + 1) % vocab
                logits[0, t - (T - rows)] = 0.0
                logits[0, t - (T - rows), want] = 50.0
        return logits, h

    return _mtp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--quant", default="int4", help="quantize at load (int4, int8, or none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--acceptance", type=float, default=0.76, help="share of positions whose draft is right")
    ap.add_argument("--drafts", default="1,2", help="comma-separated draft counts")
    ap.add_argument("--rounds", type=int, default=2, help="plain and each draft count taking turns")
    ap.add_argument("--pass-times", action="store_true",
                    help="also time trunk passes of 1-3 tokens and one MTP call, with all ids and with the first 32768")
    args = ap.parse_args(argv)
    if not 0.0 <= args.acceptance <= 1.0:
        ap.error(f"--acceptance must be between 0 and 1, not {args.acceptance}")
    try:
        llm = moerun.load(args.model, threads=args.threads, quant=None if args.quant == "none" else args.quant)
    except MoerunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    net = llm.net
    if not net.has_mtp:
        print(f"error: {args.model} has no MTP head", file=sys.stderr)
        return 1
    vocab = net.lm_head.out_features
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    drafts = [int(d) for d in args.drafts.split(",")]
    return run(args, llm, prompt, drafts, vocab)


def run(args, llm, prompt: list[int], drafts: list[int], vocab: int) -> int:
    net = llm.net

    def plain():
        t = time.perf_counter()
        out = llm.generate_ids([prompt], max_tokens=args.gen_tokens, temperature=0.0)[0]
        return out, llm.last_stats.decode_tok_s, time.perf_counter() - t

    def speculative(n, sequence):
        SpeculativeDecoder._mtp = oracle(sequence, args.acceptance, vocab)
        try:
            seq = Sequence(list(prompt), llm.sampling_params(max_tokens=args.gen_tokens, temperature=0.0))
            st = SpeculativeStats()
            for _ in run_speculative(net, [seq], llm.eos_ids(), llm.dtype, st, n, kv_dtype=llm.kv_dtype):
                pass
        finally:
            SpeculativeDecoder._mtp = real_mtp
        return seq.out_ids, st

    real_mtp = SpeculativeDecoder._mtp
    out, _, _ = plain()  # warm up, and the continuation the oracle drafts from
    sequence = prompt + out
    for n in drafts:
        speculative(n, sequence)
    figs: dict = {"plain": []}
    for _ in range(args.rounds):
        figs["plain"].append(plain()[1])
        for n in drafts:
            got, st = speculative(n, sequence)
            if got != out:
                raise SystemExit(f"N={n}: speculative output differs from plain decoding")
            figs.setdefault(n, []).append(st)
    base = sum(figs["plain"]) / len(figs["plain"])
    print(f"{args.model}  quant={args.quant}  threads={args.threads}  {args.gen_tokens} tokens x {args.rounds} rounds, "
          f"greedy; SIMULATED acceptance {args.acceptance} (oracle drafts, real head calls)")
    print(f"{'setting':10s} {'tok/s':>8s} {'x plain':>8s} {'accept':>7s} {'tok/step':>9s} {'extra expert B/tok':>19s}")
    print(f"{'plain':10s} {base:8.2f} {1.0:8.2f}")
    for n in drafts:
        sts = figs[n]
        tps = sum(s.decode_tok_s for s in sts) / len(sts)
        print(f"{'mtp_' + str(n):10s} {tps:8.2f} {tps / base:8.2f} {sts[-1].acceptance_rate:7.2f} "
              f"{sts[-1].accepted_tokens_per_step:9.2f} {sts[-1].extra_expert_bytes_per_token:19.0f}")
    if args.pass_times:
        print("pass times (median ms): " + ", ".join(f"{k} {v:.1f}" for k, v in pass_times(llm, prompt).items()))
    return 0


def pass_times(llm, prompt: list[int], repeats: int = 7) -> dict:
    """Median ms of trunk passes of 1-3 tokens after the prompt and of one MTP head call
    (all ids, and the first 32768: `--draft-vocab`), taking turns."""
    from moerun.layers.cache import Cache, RecurrentState
    from moerun.engine.generate import run_plans
    from moerun.engine.draft_extras import draft_head

    net = llm.net
    cache = Cache(net.cache_spec(), 1, len(prompt) + 16, llm.dtype, llm.kv_dtype)
    mtp_cache = Cache(net.mtp_cache_spec(), 1, len(prompt) + 16, llm.dtype, llm.kv_dtype)
    for layer in cache.layers:
        if isinstance(layer, RecurrentState):
            layer.positions = {}
    slots, n0 = torch.tensor([0]), len(prompt)
    heads = {"MTP call": None, "MTP call, 32768 ids": draft_head(net.lm_head, 32768)}
    drafters = {k: net.mtp_drafter(mtp_cache, 0, h) for k, h in heads.items()}
    times: dict = {}
    with torch.inference_mode():
        _, hidden = net(torch.tensor([prompt]), cache, slots, last_only=True, return_hidden=True)
        plans = run_plans(net)
        jobs = {f"trunk T={T}": (lambda T=T: (cache.lengths.__setitem__(0, n0),
                                              net(torch.tensor([prompt[:T]]), cache, slots, **plans)))
                for T in (1, 2, 3)}
        def mtp(key):  # as a single-stream run calls the head: through its drafter where it makes one
            tok = torch.tensor([[prompt[0]]])
            if drafters[key] is None or drafters[key].run(hidden[:, -1:], tok, n0) is None:
                mtp_cache.lengths[0] = n0
                net.mtp_logits(hidden[:, -1:], tok, mtp_cache, slots, return_hidden=True, head=heads[key])

        jobs.update({k: (lambda k=k: mtp(k)) for k in heads})
        for i in range(repeats + 1):
            for k, f in jobs.items():
                t = time.perf_counter()
                f()
                if i:
                    times.setdefault(k, []).append(1e3 * (time.perf_counter() - t))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


if __name__ == "__main__":
    sys.exit(main())
