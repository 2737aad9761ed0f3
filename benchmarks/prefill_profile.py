"""Where one prompt pass of a Qwen3.5/3.6-MoE model (a GGUF file or a checkpoint) spends its
time, layer by layer: each Gated DeltaNet half cut into its projections, the native call
between them (conv, gates, delta rule, gated norm: `kernels.deltanet_decode`) and the rest
(input norm, out_proj, residual), each attention half and each MoE half.

    .venv/bin/python benchmarks/prefill_profile.py -m FILE.gguf [--threads 2] [--prompt 512] [--rounds 3] \
        [--torch-deltanet]

--torch-deltanet runs the DeltaNet halves as before the native prefill: the modules, with
torch's conv, chunked delta rule and gated norm (`deltanet.NATIVE_PASSES` off and
`chunk_gated_delta_rule` in place of the native op).

Wall time of wrapped calls (no module hooks: those would send the layers down the modules'
path), the pass as `moerun bench` runs it (one row, a fresh cache, last_only); the fastest of
--rounds passes after one warm-up pass. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

import moerun
from moerun import kernels
from moerun.layers.cache import Cache
from moerun.models import qwen3_5_moe as q35


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch-deltanet", action="store_true", help="the DeltaNet halves' modules in torch (as before)")
    a = p.parse_args(argv)
    if a.torch_deltanet:
        from moerun.layers import deltanet

        deltanet.NATIVE_PASSES = False
        q35.gated_delta_rule = deltanet.chunk_gated_delta_rule
    llm = moerun.load(a.model, threads=a.threads)
    net = llm.net
    if not isinstance(net.model.layers[0], q35.DecoderLayer):
        print("error: not a Qwen3.5/3.6-MoE model", file=sys.stderr)
        return 1
    spent = defaultdict(float)
    layer_of = {}
    for i, layer in enumerate(net.model.layers):
        for m in layer.modules():
            layer_of[id(m)] = i
    current = [None]

    def timed(name, fn, layer_arg=None):
        def wrapper(*args, **kw):
            if layer_arg is not None:
                current[0] = layer_of.get(id(args[layer_arg]), current[0])
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[(current[0], name)] += time.perf_counter() - t0
        return wrapper

    # the layer halves (the MoE half's block is its 3rd argument, attention's module its 3rd)
    patches = [(q35.GatedDeltaNet, "residual", timed("deltanet half", q35.GatedDeltaNet.residual, 0)),
               (q35, "attn_residual", timed("attention half", q35.attn_residual, 2)),
               (q35, "moe_residual", timed("MoE half", q35.moe_residual, 2)),
               (q35, "project", timed("  in_proj_qkv/z/a/b", q35.project)),
               (kernels, "deltanet_decode", timed("  conv + delta rule + gated norm", kernels.deltanet_decode))]
    for obj, name, fn in patches:
        setattr(obj, name, fn)
    prompt = torch.randint(300, net.args.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(0))
    best, best_parts = None, None
    with torch.inference_mode():
        for r in range(a.rounds + 1):
            cache = Cache(net.cache_spec(), 1, a.prompt + 8, llm.dtype)
            spent.clear()
            t0 = time.perf_counter()
            net(prompt, cache, torch.tensor([0]), last_only=True)
            total = time.perf_counter() - t0
            if r and (best is None or total < best):
                best, best_parts = total, dict(spent)
    print(f"{a.model}: {a.prompt}-token prompt pass {best * 1e3:.0f} ms ({a.prompt / best:.1f} tok/s), "
          f"{a.threads} threads, kernels {kernels.isa()}, best of {a.rounds}"
          + (", DeltaNet halves in torch" if a.torch_deltanet else ""))
    print("| layer | part | ms | share |\n|---|---|---|---|")
    for (layer, name), v in sorted(best_parts.items(), key=lambda kv: (kv[0][0], kv[0][1].startswith(" "), kv[0][1])):
        print(f"| {layer} | {name} | {v * 1e3:.1f} | {100 * v / best:.0f}% |")
    halves = sum(v for (_, n), v in best_parts.items() if not n.startswith(" "))
    print(f"| | the rest (embedding, final norm, LM head, Python) | {(best - halves) * 1e3:.1f} | "
          f"{100 * (best - halves) / best:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
