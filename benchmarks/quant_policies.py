"""Candidate quantization policies against llama.cpp's Q4_K_M (issue 35 item 4): bytes read
per decoded token on the Qwen3-30B-A3B shape, perplexity and greedy agreement vs bf16 on the
demo model's held-out text, decode speed on the Qwen3-30B-A3B-shaped model.

  python benchmarks/quant_policies.py bytes [--layers 8]
  python benchmarks/quant_policies.py quality [--chunks 64]        # needs data/corpus
  python benchmarks/quant_policies.py quality --policies experts=int4+attention=int4+lm_head=q5_0
  python benchmarks/quant_policies.py speed [--layers 8] [--threads 2] [--policies int4,kq]

bytes: moerun's from `moerun.engine.info.describe` (what `moerun info` prints) on the net
with each policy's modules (formats fitted to the row widths as `quantize_model` does),
llama.cpp's Q4_K_M from `quant.gguf_types.tensor_type` over the GGUF tensors of the same shape
(routed experts x k/E, one embedding row), the same way benchmarks/vs_llamacpp.py counts a
written GGUF (533 MB there at 8 layers).

quality: teacher-forced on held-out windows of 256 tokens: perplexity, and the share of
positions whose argmax (the greedy next token) is bf16's.

speed: decode tok/s of one sequence (16 tokens of prompt, then 64 timed steps, median of
3), the net built as vs_llamacpp's Qwen3MoeRandom (float weights N(0, 0.02), bf16) with
every quantized module's rows drawn as 256 quantized random rows tiled (the bytes streamed
are the same; the values repeat).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tools/ is not installed

import moerun  # noqa: E402
from moerun.bench.random_model import preset_config  # noqa: E402
from moerun.engine.info import describe  # noqa: E402
from moerun.layers.moe import Experts  # noqa: E402
from moerun.models import qwen3_moe  # noqa: E402
from moerun.kernels import formats  # noqa: E402
from moerun.quant import POLICIES, component_of, compute_in_float32, replace_module  # noqa: E402
from moerun.quant.gguf_types import tensor_type  # noqa: E402
from moerun.layers.quantized import QuantizedExperts, QuantizedLinear  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from vs_llamacpp import read_bandwidth  # noqa: E402

CANDIDATES = ["int4", "int4-all", "int4-q6k", "int4-kq", "kq", "int8"]
GGML_BYTES = {"q4_k": 144 / 256, "q5_k": 176 / 256, "q6_k": 210 / 256, "q5_0": 22 / 32, "q8_0": 34 / 32,
              "q4_0": 18 / 32, "f32": 4, "bf16": 2, "f16": 2}


def shaped_net(layers: int, policy: str | None):
    """The Qwen3-30B-A3B-shaped net with `policy`'s (empty, uninitialised) quantized modules."""
    cfg = preset_config("qwen3-30b-a3b", layers=layers)
    args = qwen3_moe.ModelArgs.from_dict(cfg)
    with torch.device("meta"):
        net = qwen3_moe.Model(args)
    pol = POLICIES[policy] if policy else None
    for name, mod in list(net.named_modules()):
        comp = component_of(name, mod)
        fmt = getattr(pol, comp) if pol is not None and comp is not None else None
        if fmt is None:
            continue
        with torch.device("meta"):
            if isinstance(mod, Experts):
                E, I, H = mod.gate_proj.shape
                new = QuantizedExperts(E, H, I, formats.fit(fmt, H), formats.fit(fmt, I))
            else:
                new = QuantizedLinear(mod.in_features, mod.out_features, formats.fit(fmt, mod.in_features),
                                      bias=mod.bias is not None)
        replace_module(net, name, new)
    net = net.to_empty(device="cpu")
    for m in net.modules():  # the float weights bf16, as a bf16 checkpoint loads them
        for p in m.parameters(recurse=False):
            p.data = p.data.to(torch.bfloat16)
    return net, args


def q4_k_m_bytes(args) -> dict:
    """llama.cpp's Q4_K_M bytes per decoded token, by component, from llama_tensor_get_type."""
    n, H, E, k = args.num_hidden_layers, args.hidden_size, args.num_experts, args.num_experts_per_tok
    I, V, D = args.moe_intermediate_size, args.vocab_size, args.head_dim
    q, kv = args.num_attention_heads * D, args.num_key_value_heads * D
    by: dict[str, float] = {}

    def add(comp, name, shape, share=1.0):
        t = tensor_type("q4_k_m", name, shape, n, "qwen3moe", n_expert=E)
        nel = math.prod(shape)
        by[comp] = by.get(comp, 0) + nel * GGML_BYTES[t] * share

    add("embedding", "token_embd.weight", (V, H), 1 / V)
    add("head", "output.weight", (V, H))
    add("norms", "output_norm.weight", (H,))
    for i in range(n):
        b = f"blk.{i}."
        add("attention", b + "attn_q.weight", (q, H))
        add("attention", b + "attn_k.weight", (kv, H))
        add("attention", b + "attn_v.weight", (kv, H))
        add("attention", b + "attn_output.weight", (H, q))
        add("attention", b + "attn_q_norm.weight", (D,))
        add("attention", b + "attn_k_norm.weight", (D,))
        add("router", b + "ffn_gate_inp.weight", (E, H))
        add("routed experts", b + "ffn_gate_exps.weight", (E, I, H), k / E)
        add("routed experts", b + "ffn_up_exps.weight", (E, I, H), k / E)
        add("routed experts", b + "ffn_down_exps.weight", (E, H, I), k / E)
        add("norms", b + "attn_norm.weight", (H,))
        add("norms", b + "ffn_norm.weight", (H,))
    return {"bytes_per_token": int(sum(by.values())), "by_component": {c: int(v) for c, v in by.items()}}


def cmd_bytes(a) -> dict:
    out = {}
    for pol in a.policies:
        net, args = shaped_net(a.layers, pol)
        compute_in_float32(net)  # as moerun.load runs a quantized bf16 checkpoint
        d = describe(net, args)
        out[pol] = {"bytes_per_token": d["bytes_per_token"], "by_component": d["bytes_per_token_by_component"]}
        print(f"{pol}: {d['bytes_per_token'] / 1e6:.0f} MB/token {json.dumps({c: round(v / 1e6) for c, v in d['bytes_per_token_by_component'].items()})}", flush=True)
        del net
    ref = q4_k_m_bytes(args)
    out["Q4_K_M"] = ref
    print(f"Q4_K_M: {ref['bytes_per_token'] / 1e6:.0f} MB/token {json.dumps({c: round(v / 1e6) for c, v in ref['by_component'].items()})}")
    return out


def as_policy(p: str):
    """A POLICIES name, or components joined by '+': `experts=int4+attention=int4+lm_head=q5_0`
    (the rest as QuantPolicy's defaults)."""
    if "=" not in p:
        return p
    from moerun.quant import QuantPolicy

    return QuantPolicy(**{k: (None if v == "none" else v) for k, v in (c.split("=") for c in p.split("+"))})


def cmd_quality(a) -> dict:
    from tools.train.evaluate import heldout_windows

    windows, _ = heldout_windows(Path(a.model), Path(a.corpus), 256, a.chunks)
    torch.set_num_threads(a.threads)
    base_logits = None
    out = {}
    for pol in ["none"] + a.policies:
        llm = moerun.load(a.model, threads=a.threads, quant=as_policy(pol))
        nll, n, agree = 0.0, 0, 0
        argmaxes = []
        with torch.inference_mode():
            for i in range(0, len(windows), 8):
                w = windows[i : i + 8]
                logits = llm.net(w[:, :-1]).float()
                nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
                n += w[:, 1:].numel()
                argmaxes.append(logits.argmax(-1))
        top = torch.cat(argmaxes)
        if base_logits is None:
            base_logits = top
        agree = (top == base_logits).float().mean().item()
        fmts = moerun.quant.formats_in_use(llm.net)
        out[pol] = {"perplexity": math.exp(nll / n), "greedy_agreement": agree, "formats": fmts}
        print(f"{pol}: ppl {out[pol]['perplexity']:.4f} agree {100 * agree:.2f}% formats {fmts}", flush=True)
    base = out["none"]["perplexity"]
    for pol in out:
        out[pol]["vs_bf16"] = out[pol]["perplexity"] / base - 1
    return {"windows": len(windows), "rows": out}


def fill_tiled(net, seed: int = 0) -> None:
    """Float weights N(0, 0.02) (1-D ones), quantized modules 256 quantized random rows tiled."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, QuantizedLinear):
                blk = formats.quantize(torch.randn(256, m.in_features, generator=g) * 0.02, m.fmt)
                for dst, src in zip((m.qweight, m.scales), blk):
                    if not dst.numel():
                        continue
                    for r in range(0, dst.shape[0], 256):
                        dst[r : r + 256] = src[: dst.shape[0] - r]
            elif isinstance(m, QuantizedExperts):
                for which, f, cols in (("gate", m.fmt, m.hidden_size), ("up", m.fmt, m.hidden_size),
                                       ("down", m.down_fmt, m.intermediate_size)):
                    blk = formats.quantize(torch.randn(256, cols, generator=g) * 0.02, f)
                    for dst, src in zip((getattr(m, f"{which}_q"), getattr(m, f"{which}_scales")), blk):
                        if not dst.numel():
                            continue  # a raw format's empty scales
                        flat = dst.view(-1, dst.shape[-1])
                        for r in range(0, flat.shape[0], 256):
                            flat[r : r + 256] = src[: flat.shape[0] - r]
            else:
                for p in m.parameters(recurse=False):
                    if p.ndim == 1:
                        p.fill_(1.0)
                    else:
                        p.normal_(0.0, 0.02, generator=g)


def cmd_speed(a) -> dict:
    from moerun import kernels
    from moerun.layers.cache import Cache
    from moerun.engine.generate import run_plans

    out = {}
    for pol in a.policies:
        net, args = shaped_net(a.layers, pol)
        fill_tiled(net)
        compute_in_float32(net)
        net.eval()
        torch.set_num_threads(a.threads)
        kernels.split_threads(net, a.threads)
        spec = net.cache_spec()
        g = torch.Generator().manual_seed(1)
        rates = []
        with torch.inference_mode():
            for rnd in range(a.rounds + 1):
                cache = Cache(spec, 1, 16 + a.steps + 2, torch.float32, torch.bfloat16)
                plans = run_plans(net)
                net(torch.randint(0, args.vocab_size, (1, 16), generator=g), cache, last_only=True, **plans)
                toks = torch.randint(0, args.vocab_size, (a.steps,), generator=g).tolist()
                t0 = time.perf_counter()
                for t in toks:
                    net(torch.tensor([[t]]), cache, last_only=True, **plans)
                if rnd:  # the first round warms up
                    rates.append(a.steps / (time.perf_counter() - t0))
        bw = read_bandwidth(a.threads)
        out[pol] = {"tok_s": statistics.median(rates), "rounds": rates, "read_bandwidth": bw}
        print(f"{pol}: {statistics.median(rates):.1f} tok/s ({', '.join(f'{r:.1f}' for r in rates)}); "
              f"read bandwidth after it {bw / 1e9:.1f} GB/s", flush=True)
        del net
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["bytes", "quality", "speed"])
    ap.add_argument("--policies", default=",".join(CANDIDATES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--model", default=str(Path(moerun.__file__).parent / "demo_model"))
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--chunks", type=int, default=64, help="held-out windows of 256 tokens (0 = all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.policies = [p for p in a.policies.split(",") if p]
    res = {"bytes": cmd_bytes, "quality": cmd_quality, "speed": cmd_speed}[a.what](a)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
