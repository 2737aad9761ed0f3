"""Sampled decoding (the model's generation config: temperature, top-k, top-p, repetition
penalty), as `moerun generate` runs it: decode tok/s and the time the sampler takes per token.

    python benchmarks/sampled_decode.py [-m PATH] [--threads 2] [--dtype bfloat16] [--gen-tokens 64]
                                        [--rounds 4] [--reference] [--import-from DIR]

Single stream, the four prompts of benchmarks/speculative.py, seeded. `--reference` turns the
native sampler ops off (`kernels.sample_row`, `kernels.greedy_picks`: their torch and numpy
references run instead). `--import-from DIR` measures another checkout (see checkout.py):
run it and this one in turn for a before/after comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from checkout import parse_args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reference", action="store_true", help="the sampler's torch/numpy references, not its native ops")
    a = parse_args(ap, argv)

    from moerun.errors import MoerunError

    try:
        return measure(a)
    except MoerunError as e:  # a bad model path or option: one line, as the CLI says it
        print(f"error: {e}", file=sys.stderr)
        return 1


def measure(a: argparse.Namespace) -> int:
    import torch

    import moerun
    from moerun import kernels
    from moerun.engine import generate
    from speculative import PROMPTS

    llm = moerun.load(a.model, dtype=a.dtype, threads=a.threads)
    if a.reference:
        for name in ("sample_row", "greedy_picks"):
            if hasattr(kernels, name):
                setattr(kernels, name, lambda *args, **kw: None)
    spent = [0.0, 0]
    plain = generate.sample

    def timed(*args, **kw):
        t = time.perf_counter()
        out = plain(*args, **kw)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return out

    generate.sample = timed
    ids = [llm.encode_prompt(p) for p in PROMPTS]
    for i in ids[:2]:  # warm-up
        llm.generate_ids([i], max_tokens=8, seed=0)
    spent[:] = [0.0, 0]
    tokens, seconds = 0, 0.0
    for r in range(a.rounds):
        for k, i in enumerate(ids):
            llm.generate_ids([i], max_tokens=a.gen_tokens, seed=100 * r + k)
            st = llm.last_stats
            tokens += st.generated_tokens - st.decode_rows_started
            seconds += st.decode_s
    p = llm.sampling_params()
    print(f"moerun from {Path(moerun.__file__).parent}; sampler: {'reference' if a.reference else 'native'}; "
          f"temperature {p.temperature}, top_k {p.top_k}, top_p {p.top_p}, repetition_penalty {p.repetition_penalty}")
    print(f"sampled decode {tokens / seconds:.1f} tok/s over {tokens} tokens; "
          f"sampler {1e6 * spent[0] / max(spent[1], 1):.1f} us per token ({torch.get_num_threads()} torch threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
