"""Evaluate a demo-model directory on the held-out split of the corpus.

    python -m tools.train.evaluate [--model moerun/demo_model] [--chunks 128] [--json out.json]

Reports: perplexity (next token), next-token top-1, MTP top-1 for the token after next,
and per MoE layer (the 8 trunk layers and the MTP layer) the share of routed token-slots
that go to the 10% most used experts and the number of experts never chosen.

The held-out stream (every held-out document followed by <|endoftext|>) is cut into
non-overlapping windows of --seq-len tokens; --chunks of them, evenly spaced, are scored
(0 = all). The model runs in float32 through transformers' Qwen3_5MoeForCausalLM plus the
MTP head of tools.train.model, with the weights exactly as shipped (bf16 in the file).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def load_demo_model(model_dir: Path):
    """Trunk with transformers (it ignores mtp.*), MTP head from the same safetensors file."""
    from safetensors import safe_open
    from transformers import Qwen3_5MoeForCausalLM

    from .model import DemoModel, MTPHead, RouterRecorder

    trunk = Qwen3_5MoeForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    trunk.eval()
    model = DemoModel.__new__(DemoModel)
    torch.nn.Module.__init__(model)
    model.config = trunk.config
    model.trunk = trunk
    model.mtp = MTPHead(trunk.config)
    E = trunk.config.num_experts
    sd = {}
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        names = [k for k in f.keys() if k.startswith("mtp.")]
        raw = {k[len("mtp."):]: f.get_tensor(k).float() for k in names}
    for layer_prefix in sorted({k.split(".mlp.experts.")[0] for k in raw if ".mlp.experts." in k}):
        p = layer_prefix + ".mlp.experts."
        gate = torch.stack([raw.pop(f"{p}{e}.gate_proj.weight") for e in range(E)])
        up = torch.stack([raw.pop(f"{p}{e}.up_proj.weight") for e in range(E)])
        down = torch.stack([raw.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
        sd[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        sd[p + "down_proj"] = down
    sd.update(raw)
    model.mtp.load_state_dict(sd, strict=True)
    model.routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    model.recorder = RouterRecorder(model.routers)
    model.eval()
    return model


def heldout_windows(model_dir: Path, corpus: Path, seq_len: int, chunks: int) -> torch.Tensor:
    from tokenizers import Tokenizer

    from .corpus import read_documents
    from .tokenizer import ENDOFTEXT

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    eot = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for enc in tok.encode_batch(read_documents(corpus / "heldout.jsonl"), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    n = len(ids) // seq_len
    windows = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    if chunks and chunks < n:
        windows = windows[np.linspace(0, n - 1, chunks).round().astype(int)]
    return windows, len(ids)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int = 8) -> dict:
    cfg = model.config
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    n_layers = len(model.routers)
    counts = torch.zeros(n_layers, E, dtype=torch.long)
    nll = n_tok = top1 = mtp_top1 = n_mtp = 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits, mtp_logits, router_logits = model.forward_all(x)
        V = logits.shape[-1]
        tgt = x[:, 1:]
        lp = logits[:, :-1].float()
        nll += F.cross_entropy(lp.reshape(-1, V), tgt.reshape(-1), reduction="sum").item()
        top1 += (lp.argmax(-1) == tgt).sum().item()
        n_tok += tgt.numel()
        mtp_tgt = x[:, 2:]
        mtp_top1 += (mtp_logits[:, :-1].argmax(-1) == mtp_tgt).sum().item()
        n_mtp += mtp_tgt.numel()
        for layer, rl in enumerate(router_logits):
            idx = torch.topk(rl.float(), K, dim=-1).indices.reshape(-1)
            counts[layer] += torch.bincount(idx, minlength=E)
    top_n = max(1, round(0.1 * E))
    layers = []
    names = [f"model.layers.{i}" for i in range(cfg.num_hidden_layers)] + ["mtp.layers.0"]
    for layer in range(n_layers):
        c = counts[layer].sort(descending=True).values
        layers.append({
            "layer": names[layer],
            "type": (cfg.layer_types[layer] if layer < cfg.num_hidden_layers else "full_attention (MTP)"),
            "top10pct_share": c[:top_n].sum().item() / c.sum().item(),
            "zero_use_experts": int((c == 0).sum().item()),
            "max_over_mean": c[0].item() / c.float().mean().item(),
            "min_over_mean": c[-1].item() / c.float().mean().item(),
        })
    return {
        "heldout_tokens_scored": n_tok,
        "perplexity": math.exp(nll / n_tok),
        "next_token_top1": top1 / n_tok,
        "mtp_top1_token_after_next": mtp_top1 / n_mtp,
        "experts_per_layer": E,
        "top10pct_experts": top_n,
        "uniform_top10pct_share": top_n / E,
        "layers": layers,
        "zero_use_experts_total": sum(l["zero_use_experts"] for l in layers),
    }


def format_report(r: dict) -> str:
    lines = [
        f"held-out tokens scored: {r['heldout_tokens_scored']}",
        f"perplexity: {r['perplexity']:.2f}",
        f"next-token top-1: {100 * r['next_token_top1']:.1f}%",
        f"MTP top-1 (token after next): {100 * r['mtp_top1_token_after_next']:.1f}%",
        f"expert usage (top {r['top10pct_experts']} of {r['experts_per_layer']} experts; uniform would be "
        f"{100 * r['uniform_top10pct_share']:.1f}%):",
        "| layer | type | share to top 10% experts | experts with zero use | most used / mean | least used / mean |",
        "|---|---|---|---|---|---|",
    ]
    for l in r["layers"]:
        lines.append(f"| {l['layer']} | {l['type']} | {100 * l['top10pct_share']:.1f}% | {l['zero_use_experts']} | "
                     f"{l['max_over_mean']:.2f} | {l['min_over_mean']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path(__file__).resolve().parents[2] / "moerun" / "demo_model")
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=128, help="windows scored, evenly spaced; 0 = all")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    model = load_demo_model(args.model)
    windows, total = heldout_windows(args.model, args.corpus, args.seq_len, args.chunks)
    r = evaluate(model, windows)
    r["heldout_tokens_total"] = total
    r["eval_seconds"] = round(time.time() - t0, 1)
    print(format_report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
