"""Held-out perplexity of the demo model under each quantization policy, run by moerun.

  python benchmarks/quant_perplexity.py [--model moerun/demo_model] [--chunks 64]

Needs the corpus (scripts/fetch_corpus.sh). The bf16 row is the reference; issue 35 asks
the default policy to stay within 1% of it (benchmarks/quant_policies.py quality adds
greedy agreement, and the bytes and speed of each candidate).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import moerun
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ is not installed
from tools.train.evaluate import heldout_windows  # noqa: E402


def perplexity(llm, windows: torch.Tensor, batch: int = 8) -> float:
    nll, n = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(windows), batch):
            w = windows[i : i + batch]
            logits = llm.net(w[:, :-1]).float()
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
            n += w[:, 1:].numel()
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path(moerun.__file__).parent / "demo_model"))
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--chunks", type=int, default=64, help="held-out windows of 256 tokens (0 = all)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    windows, _ = heldout_windows(Path(a.model), Path(a.corpus), 256, a.chunks)
    rows = []
    for quant in ("none", "int4", "int8", "int4-all", "int4-q6k", "int4-kq", "kq"):
        # dtype auto: the bf16 checkpoint as it is, and each quantized policy as moerun runs
        # it by default (float32 activations beside the packed weights)
        llm = moerun.load(a.model, threads=a.threads, quant=quant)
        rows.append((quant, perplexity(llm, windows)))
    base = rows[0][1]
    print(f"held-out windows: {len(windows)} x 256 tokens, model {a.model}")
    print("| policy | perplexity | vs bf16 |\n|---|---|---|")
    for quant, ppl in rows:
        name = "bf16 (none)" if quant == "none" else quant
        print(f"| {name} | {ppl:.2f} | {100 * (ppl / base - 1):+.1f}% |")


if __name__ == "__main__":
    main()
