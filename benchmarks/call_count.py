"""Calls per decoded token, counted by cProfile: a figure this shared machine's noise cannot move.

    python benchmarks/call_count.py [-m PATH] [--quant int4|none] [--dtype float32|bfloat16]
                                    [--gen-tokens 64] [--import-from DIR]

One greedy generation (after a warm-up one) on the demo model by default; prints the torch
calls (functions and tensor methods), the Python-level function calls and everything cProfile
counted, per decoded token. Native calls (nanobind functions) are not seen by cProfile.
--import-from DIR counts another checkout's code instead (e.g. `git worktree add /tmp/old
COMMIT`, with its native extension copied or built there), for a before/after comparison.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from checkout import parse_args


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: float32 with --quant none, "
                                                   "else the checkpoint's)")
    a = parse_args(ap, argv)
    import moerun
    from moerun import kernels

    quant = None if a.quant == "none" else a.quant
    dtype = a.dtype or ("float32" if quant is None else "auto")
    llm = moerun.load(a.model, dtype=dtype, threads=a.threads, quant=quant)
    ids = llm.encode_prompt("The os module provides")
    llm.generate_ids([ids], max_tokens=a.gen_tokens, temperature=0.0)
    prof = cProfile.Profile()
    prof.enable()
    out = llm.generate_ids([ids], max_tokens=a.gen_tokens, temperature=0.0)[0]
    prof.disable()
    n = len(out)
    torch_calls = python_calls = total = 0
    for (file, _, name), (_, calls, *_rest) in pstats.Stats(prof).stats.items():
        total += calls
        if file == "~":  # builtins and C methods
            torch_calls += calls if ("torch" in name or "TensorBase" in name) else 0
        else:
            python_calls += calls
    print(f"{moerun.__file__} ({a.quant}, {dtype}, kernels {kernels.isa()}): {n} tokens; per decoded token: "
          f"torch calls {torch_calls / n:.0f}, Python function calls {python_calls / n:.0f}, all {total / n:.0f}")


if __name__ == "__main__":
    main()
