"""Write the demo model as a Hugging Face directory that transformers and moerun both load.

Trunk tensors are written by transformers' own `save_pretrained` (so names follow the
Qwen3.5 checkpoint convention, experts split as `experts.{e}.{gate,up,down}_proj.weight`);
the MTP head's tensors are added to the same model.safetensors under `mtp.*` with the same
per-expert naming. config.json gets `mtp_num_hidden_layers: 1`, as real Qwen3.5 configs have.

    python -m tools.train.export --ckpt runs/demo/ckpt.pt --out moerun/demo_model
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from .tokenizer import ENDOFTEXT, IM_END


def mtp_tensors(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.mtp.state_dict().items():
        key = "mtp." + name
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows first, then up
            base = key[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            base = key[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[key] = t
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def export_model(model, tokenizer_dir: Path, out: Path):
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        trunk = model.trunk
        trunk.config.eos_token_id = eot
        trunk.config.pad_token_id = eot
        trunk.config.bos_token_id = None
        trunk.generation_config.eos_token_id = [eot, im_end]
        trunk.generation_config.pad_token_id = eot
        dtype = next(trunk.parameters()).dtype
        trunk.to(torch.bfloat16).save_pretrained(tmp)
        trunk.to(dtype)
        tensors = load_file(f"{tmp}/model.safetensors")
        tensors.update(mtp_tensors(model))
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads(Path(tmp, "config.json").read_text())
        cfg["mtp_num_hidden_layers"] = 1
        cfg.pop("output_router_logits", None)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        gen = json.loads(Path(tmp, "generation_config.json").read_text())
        gen.pop("transformers_version", None)
        gen.pop("_from_model_config", None)
        # Greedy decoding of a model this small loops; sampling reads better by default.
        gen.update(do_sample=True, temperature=0.7, top_k=40, top_p=0.95, repetition_penalty=1.1)
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return out


def load_checkpoint(ckpt: Path):
    from .train_demo import build_model

    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    vocab = state["model"]["trunk.lm_head.weight"].shape[0]
    model = build_model(vocab, 0, **state.get("arch", {}))
    model.load_state_dict(state["model"])
    return model, state


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=Path("runs/demo/ckpt.pt"))
    ap.add_argument("--tokenizer", type=Path, default=Path("runs/tokenizer"))
    ap.add_argument("--out", type=Path, default=Path("moerun/demo_model"))
    args = ap.parse_args(argv)
    model, state = load_checkpoint(args.ckpt)
    export_model(model, args.tokenizer, args.out)
    size = (args.out / "model.safetensors").stat().st_size
    print(f"exported step {state['step']} to {args.out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
