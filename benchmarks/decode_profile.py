"""Where one decode step of a GGUF model goes, tensor class by tensor class, against the
machine's read bandwidth (issue 35: decode at >= 85% of it).

    .venv/bin/python benchmarks/decode_profile.py -m FILE.gguf [--policy int4-q6k] \
        [--threads 2,1] [--steps 20] [--context 64]

The model is loaded as `benchmarks/vs_llamacpp.py` loads it (`load_gguf`; with --policy its
quantized tensors are first requantized to that policy's formats, as the benchmark's
`default` row does). Per thread count:

- the **step**: median wall time of --steps one-token decode steps (the run's native stack,
  the final norm and the LM head: what `moerun bench` times), after --context tokens;
- the **pieces**: each native call of a step made on its own, in the step's order, on random
  inputs (routing therefore picks other experts every step, as real decoding does, so the
  weights come from DRAM, not from the L3 of the last step), median of --steps passes:
  the DeltaNet half's projections (in_proj_qkv, z, a, b: one call), its recurrent step
  (`deltanet_decode`: conv, q/k norms, the gated delta rule over the 32 x 128 x 128 float
  state, the gated RMSNorm), out_proj; the attention half's q/k/v projections and o_proj;
  the router (`route_softmax_topk`), the routed experts (`moe_experts`, top-k), the shared
  expert (`swiglu_mlp`); the final RMSNorm and the LM head. Each half is also timed as the
  one native call the stack makes of it (`deltanet_block`, `attn_block_run`,
  `moe_block_run`), so that "half - its pieces" is what the fusion saves or costs and
  "step - halves - head" what lies between the calls (the stack's own driving, Python).

For each weight-reading piece: MB read per token, ms, GB/s, and its share of the read
bandwidth (`torch.sum` over 1 GiB at that thread count, `vs_llamacpp.read_bandwidth`, best
of 3, measured before the thread count's runs); "lost" is its time beyond bytes /
bandwidth, the ms it costs against a kernel that streamed at the measured bandwidth. The
pieces' own Python (a few microseconds a call) is inside their times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import load_gguf, read_bandwidth  # noqa: E402

from moerun import kernels  # noqa: E402
from moerun.engine.generate import run_plans  # noqa: E402
from moerun.layers.attention import attn_half_plan  # noqa: E402
from moerun.layers.cache import Cache  # noqa: E402
from moerun.layers.linear import native_call_views  # noqa: E402
from moerun.layers.moe import moe_fusable  # noqa: E402

MB = 1e6


def nbytes(*arrays) -> int:
    return sum(int(a.nbytes) for a in arrays)


def packed_bytes(p) -> int:
    return nbytes(p.w, p.s)


class Pieces:
    """Each native call of a decode step, callable on its own (random inputs)."""

    def __init__(self, llm, cache: Cache, pos: int, seed: int = 0):
        self.net = llm.net
        m = self.net.model
        self.g = torch.Generator().manual_seed(seed)
        self.H = llm.args.hidden_size
        self.cache, self.pos = cache, pos
        self.dtype = llm.dtype
        x3 = torch.zeros(1, 1, self.H, dtype=self.dtype)
        self.layers = []
        for i, layer in enumerate(m.layers):
            mods = layer._modules
            norm = mods["input_layernorm"]
            st = cache.layers[i]
            if "linear_attn" in mods:
                dn = mods["linear_attn"]
                conv, S = st.tensors["conv"], st.tensors["recurrent"]
                views, (proj, out_proj, normargs) = dn.half_plan(x3, norm, conv, S)
                first = ("deltanet", dn, views, proj, out_proj, normargs, conv.clone(), S.clone())
            else:
                attn = mods["self_attn"]
                plan, half = attn_half_plan(x3, norm, attn, st)
                first = ("attention", attn, plan, half, st, kernels.norm_args(norm))
            post = mods["post_attention_layernorm"]
            e, moe_args = moe_fusable(x3.view(1, self.H), post, mods["mlp"])
            self.layers.append((first, (mods["mlp"], e, moe_args, kernels.norm_args(post))))
        self.final_norm = kernels.norm_args(m.norm)
        self.head = self.views(self.net.lm_head)

    def views(self, lin):
        return native_call_views(lin, torch.zeros(1, 1, self.H, dtype=self.dtype))

    def x(self) -> torch.Tensor:
        return (torch.randn(1, self.H, generator=self.g) * 0.5).to(self.dtype)

    def bytes(self) -> dict:
        out = defaultdict(int)
        for first, (mlp, e, moe_args, _) in self.layers:
            if first[0] == "deltanet":
                _, dn, views, proj, out_proj, *_ = first
                out["deltanet in_proj (qkv, z, a, b)"] += sum(packed_bytes(p) for p in proj)
                out["deltanet out_proj"] += packed_bytes(out_proj)
                S = first[7]
                out["deltanet recurrent step"] += 2 * S.numel() * 4  # the state read and written
            else:
                attn = first[1]
                q, k, v, o = map(self.views, (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
                out["attention q/k/v"] += sum(map(packed_bytes, (q, k, v)))
                out["attention o_proj"] += packed_bytes(o)
            ev = e.fused_views(torch.zeros(1, self.H))
            K, E = mlp.top_k, e.num_experts
            per_expert = sum(nbytes(*ws) for ws in ev[1:7]) / E
            out["routed experts (top-k)"] += int(per_expert * K)
            se = getattr(mlp, "shared_expert", None)  # Qwen3-MoE has none
            if se is not None:
                out["shared expert"] += sum(packed_bytes(self.views(m)) for m in (se.gate_proj, se.up_proj, se.down_proj))
            out["router"] += mlp.gate.weight.numel() * mlp.gate.weight.element_size()
        out["LM head"] = packed_bytes(self.head)
        return out

    def run(self, spent: dict) -> None:
        """One pass over the pieces in a step's order, adding each one's seconds to `spent`."""
        nat = kernels._native()

        def timed(name, fn, *args, **kw):
            t = time.perf_counter()
            r = fn(*args, **kw)
            spent[name] += time.perf_counter() - t
            return r

        # the halves as one call each, a pass over all layers; then the pieces, another pass:
        # a layer's weights (the Qwen3-30B shape's attention, 20 MB) fit in the L3, so a piece
        # timed right after its own half would read them from the cache
        for first, (mlp, e, moe_args, post_norm) in self.layers:
            x = self.x()
            if first[0] == "deltanet":
                _, dn, views, proj, out_proj, normargs, conv, S = first
                timed("deltanet half (one call)", kernels.deltanet_block, x.view(1, 1, -1), normargs, proj, out_proj,
                      conv, S, views, float(dn.norm.eps), dn.n_k)
            else:
                _, attn, plan, half, kv, normargs = first
                rope = self.net.model.rope.float_rows(self.pos, 1, self.dtype)  # numpy rows, as the stack takes them
                timed("attention half (one call)", kernels.attn_block_run, x, plan, rope, kernels._cache_slot(kv, 0),
                      self.pos, half)
            timed("MoE half (one call)", kernels.moe_block_run, self.x(), moe_args)
        for first, (mlp, e, moe_args, post_norm) in self.layers:
            x = self.x()
            if first[0] == "deltanet":
                _, dn, views, proj, out_proj, normargs, conv, S = first
                h = timed("norms", kernels.rms_norm, x, *normargs)
                qkv, z, a, b = timed("deltanet in_proj (qkv, z, a, b)", kernels.qlinear_multi, h, list(proj))
                Hv, Dv = S.shape[1], S.shape[3]
                o, _, _ = timed("deltanet recurrent step", kernels.deltanet_decode, qkv.view(1, 1, -1), None, conv,
                                a.reshape(1, 1, -1), b.reshape(1, 1, -1), None, None, S, z.reshape(1, 1, Hv, Dv), None,
                                float(dn.norm.eps), dn.n_k, views=views)
                timed("deltanet out_proj", kernels.qlinear_multi, o.reshape(1, -1), [out_proj])
            else:
                _, attn, plan, half, kv, normargs = first
                h = timed("norms", kernels.rms_norm, x, *normargs)
                q, k, v, o = map(self.views, (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
                timed("attention q/k/v", kernels.qlinear_multi, h, [q, k, v])
                timed("attention o_proj", kernels.qlinear_multi, torch.randn(1, attn.o_proj.in_features, generator=self.g),
                      [o])
            x = self.x()
            h = timed("norms", kernels.rms_norm, x, *post_norm)
            w, ids = timed("router", kernels.route_softmax_topk, h, kernels.float32_weight(mlp.gate), mlp.top_k,
                           mlp.norm_topk_prob)
            ev = e.fused_views(h)
            inter = e.intermediate_size
            out = torch.empty(1, self.H)
            xa, ia, wa = kernels._np(h), kernels._np(ids.contiguous()), kernels._np(w)
            timed("routed experts (top-k)", nat.moe_experts, xa, ia, wa, *ev[1:7], kernels._np(out), ev.code, inter)
            se = getattr(mlp, "shared_expert", None)
            if se is not None:
                timed("shared expert", kernels.swiglu_mlp, h, *map(self.views, (se.gate_proj, se.up_proj, se.down_proj)),
                      kernels.float32_weight(mlp.shared_expert_gate).reshape(-1))
        x = self.x()
        h = timed("final norm", kernels.rms_norm, x, *self.final_norm)
        timed("LM head", kernels.qlinear_multi, h, [self.head])


def step_times(llm, threads: int, context: int, steps: int, seed: int) -> list[float]:
    net = llm.net
    g = torch.Generator().manual_seed(seed)
    vocab = llm.args.vocab_size
    cache = Cache(net.cache_spec(), 1, context + steps + 4, llm.dtype, llm.kv_dtype)
    plans = run_plans(net)
    out = []
    with torch.inference_mode():
        net(torch.randint(0, vocab, (1, context), generator=g), cache, last_only=True, **plans)
        for i in range(steps + 1):
            t = time.perf_counter()
            net(torch.randint(0, vocab, (1, 1), generator=g), cache, last_only=True, **plans)
            if i:  # the first step: a warm-up
                out.append(time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="a GGUF file (Qwen3.5/3.6-MoE or Qwen3-MoE)")
    p.add_argument("--policy", help="requantize to this policy first (vs_llamacpp's default row: int4-q6k)")
    p.add_argument("--threads", default="2,1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    path = Path(a.model)
    if not path.is_file():
        print(f"error: {path}: no such file", file=sys.stderr)
        return 2
    try:
        threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        print(f"error: --threads {a.threads!r}: comma-separated integers", file=sys.stderr)
        return 2
    llm, _ = load_gguf(path, a.policy, "profile")
    print(f"# {path.name}{' as ' + a.policy if a.policy else ''}; kernels {kernels.describe()}; "
          f"context {a.context}, {a.steps} steps")
    for t in threads:
        torch.set_num_threads(t)
        kernels.split_threads(llm.net, t)
        bw = read_bandwidth(t)
        steps = step_times(llm, t, a.context, a.steps, a.seed)
        cache = Cache(llm.net.cache_spec(), 1, a.context + 8, llm.dtype, llm.kv_dtype)
        with torch.inference_mode():
            llm.net(torch.zeros(1, a.context, dtype=torch.long), cache, last_only=True, **run_plans(llm.net))
            pieces = Pieces(llm, cache, a.context, a.seed)
            size = pieces.bytes()
            runs = []
            for i in range(a.steps + 1):
                spent = defaultdict(float)
                pieces.run(spent)
                if i:
                    runs.append(spent)
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        step = statistics.median(steps)
        total_bytes = sum(size.values())
        print(f"\n## {t} thread(s): read bandwidth {bw / 1e9:.1f} GB/s (torch.sum, 1 GiB); step {step * 1e3:.2f} ms = "
              f"{1 / step:.1f} tok/s; {total_bytes / MB:.0f} MB/token -> {total_bytes / step / 1e9:.1f} GB/s = "
              f"{100 * total_bytes / step / bw:.0f}% of it (min step {min(steps) * 1e3:.2f} ms)\n")
        print("| piece | MB/token | ms/token | GB/s | share of bandwidth | lost ms (vs bandwidth) |")
        print("|---|---|---|---|---|---|")
        gemv_total = 0.0
        for name in ("deltanet in_proj (qkv, z, a, b)", "deltanet out_proj", "attention q/k/v", "attention o_proj",
                     "routed experts (top-k)", "shared expert", "router", "LM head", "deltanet recurrent step"):
            if name not in med:
                continue
            s, b = med[name], size[name]
            gemv_total += s
            print(f"| {name} | {b / MB:.1f} | {s * 1e3:.3f} | {b / s / 1e9:.1f} | {100 * b / s / bw:.0f}% | "
                  f"{(s - b / bw) * 1e3:.3f} |")
        print(f"| norms (the halves' input RMSNorms, one call each) | | {med['norms'] * 1e3:.3f} | | | |")
        print(f"| final norm | | {med['final norm'] * 1e3:.3f} | | | |")
        pieces_sum = gemv_total + med["norms"] + med["final norm"]
        halves = sum(med[k] for k in med if "one call" in k) + med["LM head"] + med["final norm"]
        print(f"| **sum of the pieces** | {total_bytes / MB:.1f} | {pieces_sum * 1e3:.3f} | "
              f"{total_bytes / pieces_sum / 1e9:.1f} | {100 * total_bytes / pieces_sum / bw:.0f}% | "
              f"{(pieces_sum - total_bytes / bw) * 1e3:.3f} |")
        for k in sorted(med):
            if "one call" in k:
                print(f"| {k} | | {med[k] * 1e3:.3f} | | | |")
        print(f"| halves (one call each) + final norm + head | | {halves * 1e3:.3f} | | | |")
        print(f"| **step (the native stack + head)** | {total_bytes / MB:.1f} | {step * 1e3:.3f} | "
              f"{total_bytes / step / 1e9:.1f} | {100 * total_bytes / step / bw:.0f}% | {(step - total_bytes / bw) * 1e3:.3f} |")
        print(f"\nstep - (halves + head): {(step - halves) * 1e3:.3f} ms (between the native calls: the stack's "
              f"driving, embedding, rope rows, Python); pieces - halves: {(pieces_sum - halves) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
