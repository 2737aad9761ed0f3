"""Held-out perplexity of the demo model with each KV cache format, and KV bytes per token.

  python benchmarks/kv_cache.py [--model moerun/demo_model] [--chunks 64] [--step 32]
  python benchmarks/kv_cache.py --attention-only [--threads 2]   # the timings alone

Needs the corpus (scripts/fetch_corpus.sh). Each 256-token held-out window goes through the
cache `--step` tokens at a time (prefill in pieces, as a long prompt or a chat turn would),
so every position after the first piece attends to keys and values read back from the
cache; within a piece too, since the cache returns the stored (for int8: dequantized) ones.
"Top-1 agreement" is the share of positions whose most likely next token equals the one
with the model's own dtype in the cache. Last, the time of one decode step of one attention
layer (Qwen3-30B-A3B shape) over S cached tokens (an int8 cache is read in place by the
native kernel, which applies the scales; with MOERUN_ISA=torch it is dequantized first).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import moerun
from moerun import kernels
from moerun.bench.random_model import PRESETS, preset_config
from moerun.layers.cache import Cache, KVSpec, kv_bytes_per_token, kv_cache_dtype
from moerun.layers.attention import attend
from moerun.models import module_for
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ is not installed
from tools.train.evaluate import heldout_windows  # noqa: E402


def cached_logits(llm, windows: torch.Tensor, kv_dtype, step: int, batch: int = 8) -> torch.Tensor:
    """Logits [N, T-1, V] of every window's tokens but the last, fed `step` at a time."""
    net, out = llm.net, []
    with torch.inference_mode():
        for i in range(0, len(windows), batch):
            x = windows[i : i + batch, :-1]
            cache = Cache(net.cache_spec(), len(x), x.shape[1], llm.dtype, kv_dtype)
            out.append(torch.cat([net(x[:, t : t + step], cache).float() for t in range(0, x.shape[1], step)], dim=1))
    return torch.cat(out)


def perplexity(logits: torch.Tensor, windows: torch.Tensor) -> float:
    return math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item())


def preset_kv_bytes(name: str) -> dict[str, int]:
    """KV bytes per token of a preset's full-size model (a meta-device net: no weights)."""
    cfg = preset_config(name)
    module = module_for(cfg["model_type"])
    args = module.ModelArgs.from_dict(module.text_config(cfg) if hasattr(module, "text_config") else cfg)
    with torch.device("meta"):
        specs = module.Model(args).cache_spec()
    return {kind: kv_bytes_per_token(specs, kv_cache_dtype(kind) or torch.bfloat16) for kind in ("auto", "int8")}


def attention_step_ms(kv_dtype, S: int, dtype: torch.dtype, reps: int = 30) -> float:
    """Best of `reps`: one new token's attention (32 query heads, 4 KV heads of 128) over S cached."""
    g = torch.Generator().manual_seed(0)
    kv = Cache([KVSpec(4, 128, 128)], 1, S + 1, dtype, kv_dtype).layers[0]
    one = torch.tensor([0])
    kv.update(one, one, *torch.randn(2, 1, 4, S, 128, generator=g).to(dtype))
    q, k, v = torch.randn(1, 32, 1, 128, generator=g).to(dtype), *torch.randn(2, 1, 4, 1, 128, generator=g).to(dtype)
    best = math.inf
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            attend(q, k, v, kv, one, torch.tensor([S]), 128**-0.5)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path(moerun.__file__).parent / "demo_model"))
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--chunks", type=int, default=64, help="held-out windows of 256 tokens (0 = all)")
    ap.add_argument("--step", type=int, default=32, help="tokens per forward pass through the cache")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention-only", action="store_true",
                    help="only the attention step timings (no corpus needed); MOERUN_ISA=torch times the torch path")
    a = ap.parse_args()
    if a.attention_only:
        torch.set_num_threads(a.threads)
        return attention_table(a.threads)
    windows, _ = heldout_windows(Path(a.model), Path(a.corpus), 256, a.chunks)
    print(f"held-out windows: {len(windows)} x 256 tokens, fed {a.step} at a time; model {a.model}")
    print("| model dtype | KV cache | KV bytes/token | perplexity | vs same-dtype cache | top-1 agreement |")
    print("|---|---|---|---|---|---|")
    for dtype in ("bfloat16", "float32"):
        llm = moerun.load(a.model, dtype=dtype, threads=a.threads)
        base = None
        for kind in ("auto", "int8"):
            kv_dtype = kv_cache_dtype(kind)
            logits = cached_logits(llm, windows, kv_dtype, a.step)
            ppl = perplexity(logits, windows)
            top1 = logits.argmax(-1)
            if base is None:
                base = (ppl, top1)
            name = f"{dtype} (auto)" if kind == "auto" else kind
            nbytes = kv_bytes_per_token(llm.net.cache_spec(), kv_dtype or llm.dtype)
            agree = (top1 == base[1]).float().mean().item()
            print(f"| {dtype} | {name} | {nbytes} | {ppl:.3f} | {100 * (ppl / base[0] - 1):+.2f}% | {100 * agree:.2f}% |")
    print("\nKV bytes per token of context, full-size models (bf16 cache vs int8):")
    for name in PRESETS:
        b = preset_kv_bytes(name)
        print(f"  {name}: {b['auto']} vs {b['int8']} ({b['int8'] / b['auto']:.3f}x); "
              f"32k tokens: {b['auto'] * 32768 / 2**30:.2f} vs {b['int8'] * 32768 / 2**30:.2f} GiB")
    attention_table(a.threads)


def attention_table(threads: int) -> None:
    print(f"\none attention layer's decode step, ms (best of 30, {threads} thread(s), kernels {kernels.isa()}):")
    print("| model dtype | cached tokens | model-dtype cache | int8 cache |\n|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for S in (1024, 4096):
            ms = [attention_step_ms(kv, S, dtype) for kv in (None, torch.int8)]
            print(f"| {str(dtype).removeprefix('torch.')} | {S} | {ms[0]:.2f} | {ms[1]:.2f} |")


if __name__ == "__main__":
    main()
