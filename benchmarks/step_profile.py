"""Where a decode step and a prefill pass spend their time, on the Qwen3-30B-A3B-shaped model
of benchmarks/vs_llamacpp.py (random weights, quantized by a policy, built in memory).

    .venv/bin/python benchmarks/step_profile.py [--layers 4] [--row int4] [--threads 2] \
        [--context 512] [--steps 30] [--dtype float32|bfloat16] [--no-fuse]

Wall time per part, measured with forward hooks around each module while the model runs as
moerun.load sets it up (kernels.split_threads; the fused attention block,
`layers.attention.attention_fuses`, unless --no-fuse): attention blocks (everything from the normed input to o_proj), routed experts,
the router and the rest of each MoE block, the LM head, and what is left (embedding, norms,
residual adds, Python). Weight-streaming parts also show GB/s: the bytes they read per token
over their time. Medians over --steps decode steps at --context tokens of context.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from moerun import kernels
from moerun.layers.cache import Cache
from moerun.layers import attention
from moerun.layers.quantized import QuantizedExperts
from vs_llamacpp import build_model


def timed_parts(net) -> tuple[dict, list]:
    """Forward hooks adding each part's wall time into the returned dict."""
    spent, start, hooks = defaultdict(float), {}, []
    parts = {"LM head": [net.lm_head]}
    for layer in net.model.layers:
        parts.setdefault("attention blocks", []).append(layer.self_attn)
        parts.setdefault("MoE blocks", []).append(layer.mlp)
        if hasattr(layer.mlp, "experts"):
            parts.setdefault("routed experts", []).append(layer.mlp.experts)
    for name, mods in parts.items():
        for m in mods:
            hooks.append(m.register_forward_pre_hook(lambda m, a, k=id(m): start.__setitem__(k, time.perf_counter())))
            hooks.append(m.register_forward_hook(
                lambda m, a, o, k=id(m), n=name: spent.__setitem__(n, spent[n] + time.perf_counter() - start[k])))
    return spent, hooks


def part_bytes(net, args) -> dict:
    """Weight bytes each part reads per decoded token."""
    K, E = args.num_experts_per_tok, args.num_experts
    nbytes = lambda m: sum(b.nbytes for b in [*m.parameters(), *m.buffers()])  # noqa: E731
    out = defaultdict(int)
    for layer in net.model.layers:
        out["attention blocks"] += nbytes(layer.self_attn)
        if isinstance(getattr(layer.mlp, "experts", None), QuantizedExperts):
            out["routed experts"] += nbytes(layer.mlp.experts) * K // E
    out["LM head"] = nbytes(net.lm_head)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--row", default="int4", help="quantization policy: int4 or int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-fuse", action="store_true", help="leave attention blocks unfused")
    a = p.parse_args(argv)

    dtype = getattr(torch, a.dtype)
    net, args = build_model(a.layers, a.row)
    for prm in net.parameters():  # norms, router, embedding: the quantized buffers keep theirs
        prm.data = prm.data.to(dtype)
    torch.set_num_threads(a.threads)
    kernels.split_threads(net, a.threads)
    if a.no_fuse:
        attention.attention_fuses = lambda m: False
    fused = sum(attention.attention_fuses(m) for m in net.modules())
    print(f"{a.layers} layers, policy {a.row}, {a.dtype}, {a.threads} threads, kernels {kernels.isa()}, "
          f"{fused} attention blocks fused", file=sys.stderr)
    prompt = torch.randint(300, args.vocab_size, (1, a.context), generator=torch.Generator().manual_seed(0))
    spent, _ = timed_parts(net)
    rows = []
    with torch.inference_mode():
        cache = Cache(net.cache_spec(), 1, a.context + a.steps + 8, dtype)
        net(prompt[:, :16], Cache(net.cache_spec(), 1, 16, dtype), last_only=True)  # warm-up
        spent.clear()
        t0 = time.perf_counter()
        net(prompt, cache, last_only=True)
        rows.append(("prefill", time.perf_counter() - t0, dict(spent), a.context))
        steps, per = [], defaultdict(list)
        tok = prompt[:, -1:]
        for i in range(a.steps + 2):
            spent.clear()
            t0 = time.perf_counter()
            net(tok, cache, last_only=True)
            if i >= 2:  # the first steps warm the pool and the caches
                steps.append(time.perf_counter() - t0)
                for k, v in spent.items():
                    per[k].append(v)
    bts = part_bytes(net, args)
    for name, total, parts, ntok in rows:
        print(f"\n{name}: {total * 1e3:.0f} ms for {ntok} tokens ({ntok / total:.1f} tok/s)")
        print_parts(parts, total, {})
    total = statistics.median(steps)
    print(f"\ndecode at {a.context} tokens of context: {total * 1e3:.2f} ms per token ({1 / total:.2f} tok/s), "
          f"median of {a.steps} steps")
    print_parts({k: statistics.median(v) for k, v in per.items()}, total, bts)
    return 0


def print_parts(parts: dict, total: float, bts: dict) -> None:
    moe = parts.pop("MoE blocks", 0.0)
    if "routed experts" in parts:
        parts["router and the rest of the MoE blocks"] = moe - parts["routed experts"]
    parts["the rest (embedding, norms, residuals, Python)"] = total - sum(parts.values())
    print("| part | ms | share | GB/s of its weights |\n|---|---|---|---|")
    for k, v in parts.items():
        bw = f"{bts[k] / v / 1e9:.1f}" if bts.get(k) and v > 0 else ""
        print(f"| {k} | {v * 1e3:.2f} | {100 * v / total:.0f}% | {bw} |")


if __name__ == "__main__":
    sys.exit(main())
