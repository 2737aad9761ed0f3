"""Qwen3-Next on the same GGUF file in moerun and llama.cpp (issue 36, item 1; by hand, not CI).

    python benchmarks/qwen3next_llamacpp.py [--source demo|random] [--types f32,q8_0] [--threads 1]

A Qwen3-Next checkpoint in its own Hugging Face layout (`model_type: qwen3_next`, fused
`in_proj_qkvz` / `in_proj_ba`) is exported with `moerun export-gguf` (qwen3next) and run by
both engines on the same token ids. `--source demo` (default): the trained demo model's
weights, which are Qwen3.5 layers, i.e. Qwen3-Next's maths, refused into Qwen3-Next's
checkpoint layout (float32, its MTP layer kept), so the comparison runs on a model with
learned routing; `--source random`: transformers' Qwen3NextForCausalLM with random weights
(seeded, norms moved off their identity).

- logits of every position of 4 windows of 128 tokens of README.md (tokenized by the demo
  tokenizer): the largest absolute difference (and the largest logit), top-1 agreement;
- greedy: 10 prompts of 12 tokens from the same text, 32 tokens by argmax through each
  engine's cache.

moerun runs the GGUF file (float32 activations) and, as the baseline, the HF directory;
transformers runs the HF directory too. llama.cpp runs with an f32 KV cache and flash
attention off (float32 attention throughout; `llamacpp.Session`). Needs the native
llama.cpp build (`python benchmarks/llamacpp.py build`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llamacpp  # noqa: E402

import moerun  # noqa: E402
from moerun.loaders.gguf_write import export  # noqa: E402

DEMO = ROOT / "moerun" / "demo_model"
CONFIG = dict(  # Qwen3-Next-80B-A3B's proportions, small: 2 value heads per key head, Dk = Dv (llama.cpp needs it)
    vocab_size=4096, hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=64, intermediate_size=256,
    shared_expert_intermediate_size=64, num_experts=16, num_experts_per_tok=4, initializer_range=0.06,
)


def make_model(path: Path, seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    ref = Qwen3NextForCausalLM(Qwen3NextConfig(**CONFIG, experts_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    ref.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, path / f)
    return ref


def demo_as_qwen3_next(path: Path) -> None:
    """The demo model (qwen3_5_moe_text) written as a qwen3_next checkpoint: each DeltaNet
    layer's in_proj_qkv/z and in_proj_b/a fused per key head where Qwen3-Next keeps them
    (`fused_rows`), float32, config.json in Qwen3-Next's terms."""
    from safetensors.torch import load_file, save_file

    from moerun.models.qwen3_next import ModelArgs, fused_rows

    cfg = json.loads((DEMO / "config.json").read_text())
    cfg.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], dtype="float32",
               intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    rows = fused_rows(ModelArgs.from_dict(cfg))
    state = {k: v.float() for k, v in load_file(DEMO / "model.safetensors").items()}
    for name in [n for n in state if n.endswith("linear_attn.in_proj_qkv.weight")]:
        prefix = name[: -len("in_proj_qkv.weight")]
        for fused, parts in (("in_proj_qkvz", ("in_proj_qkv", "in_proj_z")), ("in_proj_ba", ("in_proj_b", "in_proj_a"))):
            ws = [state.pop(f"{prefix}{p}.weight") for p in parts]
            w = torch.empty(sum(len(x) for x in ws), ws[0].shape[1])
            for p, x in zip(parts, ws):
                w[rows[p]] = x
            state[f"{prefix}{fused}.weight"] = w
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO / f, path / f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", choices=("demo", "random"), default="demo")
    ap.add_argument("--workdir", default="/tmp/qwen3next-llamacpp")
    ap.add_argument("--types", default="f32,q8_0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--experts", type=int, default=CONFIG["num_experts"])
    ap.add_argument("--top-k", type=int, default=CONFIG["num_experts_per_tok"],
                    help="experts per token (= --experts: no routing decision to flip)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    CONFIG.update(num_experts=a.experts, num_experts_per_tok=a.top_k)
    torch.set_num_threads(a.threads)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = work / a.source
    if a.source == "demo":
        from transformers import Qwen3NextForCausalLM

        demo_as_qwen3_next(hf_dir)
        ref = Qwen3NextForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, experts_implementation="eager").eval()
    else:
        ref = make_model(hf_dir)
    ids = moerun.load(None, threads=a.threads).tokenizer.encode((ROOT / "README.md").read_text())
    seqs = torch.tensor([ids[i * 128:(i + 1) * 128] for i in range(4)])
    prompts = [ids[600 + 40 * i:612 + 40 * i] for i in range(10)]
    with torch.no_grad():
        hf_logits = ref(seqs).logits.float()
    hf_llm = moerun.load(hf_dir, dtype="float32", threads=a.threads)
    base = hf_llm.forward(seqs).float()
    rows = [{"what": "moerun (HF dir) vs transformers", "max_abs": float((base - hf_logits).abs().max()),
             "max_logit": float(hf_logits.abs().max()),
             "top1": float((base.argmax(-1) == hf_logits.argmax(-1)).float().mean())}]
    base_greedy = hf_llm.generate_ids(prompts, max_tokens=32, temperature=0.0, repetition_penalty=1.0)
    for t in a.types.split(","):
        path = work / f"qwen3next-{t}.gguf"
        export(hf_dir, path, t, force=True)
        ours = moerun.load(path, dtype="float32", threads=a.threads)
        mine = ours.forward(seqs).float()
        mine_greedy = ours.generate_ids(prompts, max_tokens=32, temperature=0.0, repetition_penalty=1.0)
        with llamacpp.Session(path, n_ctx=256, threads=a.threads, kv_type="f32", flash_attn=False) as s:
            lc = torch.from_numpy(np.stack([s.logits(x.tolist()) for x in seqs]))
            lc_greedy = [s.greedy(p, 32) for p in prompts]
        d = (mine - lc).abs()
        rows.append({"what": f"{t}: moerun (GGUF) vs llama.cpp (GGUF)", "max_abs": float(d.max()),
                     "max_logit": float(lc.abs().max()), "top1": float((mine.argmax(-1) == lc.argmax(-1)).float().mean()),
                     "greedy_identical": sum(x == y for x, y in zip(mine_greedy, lc_greedy)),
                     "positions": int(seqs.numel())})
        if t == "f32":
            rows.append({"what": "f32: moerun (GGUF) vs moerun (HF dir)", "max_abs": float((mine - base).abs().max()),
                         "max_logit": float(base.abs().max()),
                         "top1": float((mine.argmax(-1) == base.argmax(-1)).float().mean()),
                         "greedy_identical": sum(x == y for x, y in zip(mine_greedy, base_greedy))})
    for r in rows:
        extra = f", greedy 32 tokens identical for {r['greedy_identical']}/10 prompts" if "greedy_identical" in r else ""
        print(f"{r['what']}: max |dlogit| {r['max_abs']:.3g} (largest logit {r['max_logit']:.3g}), "
              f"top-1 agreement {100 * r['top1']:.2f}%{extra}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
