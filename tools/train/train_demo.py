"""Train the bundled demo model (moerun/demo_model) on the corpus from scripts/fetch_corpus.sh.

    python -m tools.train.tokenizer                       # runs/tokenizer/
    python -m tools.train.train_demo --seed 0 --steps N   # runs/demo/ then --export DIR

Objective: next-token cross-entropy + mtp_weight * cross-entropy of the MTP head on the
token after next + aux_coef * per-layer Switch load-balancing loss (trunk and MTP routers).
AdamW, linear warm-up then cosine decay to 10%, random 256-token windows from the
concatenated training documents (separated by <|endoftext|>), all drawn from one seeded
generator, so a run is reproducible for a given seed, thread count and torch build.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .corpus import read_documents
from .tokenizer import ENDOFTEXT


def tokenize_split(corpus: Path, split: str, tokenizer_dir: Path, cache_dir: Path) -> np.ndarray:
    """All documents of a split as one uint16 array, each document followed by <|endoftext|>."""
    from tokenizers import Tokenizer

    cache = cache_dir / f"{split}_tokens.npy"
    tok_path = tokenizer_dir / "tokenizer.json"
    if cache.is_file() and cache.stat().st_mtime >= tok_path.stat().st_mtime:
        return np.load(cache)
    tok = Tokenizer.from_file(str(tok_path))
    eot = tok.token_to_id(ENDOFTEXT)
    docs = read_documents(corpus / f"{split}.jsonl")
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    arr = np.asarray(ids, dtype=np.uint16)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(cache, arr)
    return arr


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


def build_model(vocab_size: int, seed: int, **overrides):
    from .model import DemoModel, make_config

    torch.manual_seed(seed)
    cfg = make_config(vocab_size, **overrides)
    cfg._attn_implementation = "sdpa"
    model = DemoModel(cfg)
    return model


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "norm" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arch", type=str, default="{}", help="JSON overrides of the model config")
    ap.add_argument("--experts-impl", default="eager", help="transformers experts implementation")
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--tokenizer", type=Path, default=Path("runs/tokenizer"))
    ap.add_argument("--out", type=Path, default=Path("runs/demo"))
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="stop early (with the schedule cut short) after this many minutes; 0 = no limit")
    ap.add_argument("--export", type=Path, default=None, help="write the HF model directory here at the end")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this checkpoint's weights (fresh optimizer and schedule): a second stage")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    train = torch.from_numpy(tokenize_split(args.corpus, "train", args.tokenizer, args.out).astype(np.int64))
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")).get_vocab_size()
    model = build_model(vocab, args.seed, **json.loads(args.arch))
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu", weights_only=False)["model"])
    model.trunk.config._experts_implementation = args.experts_impl
    model.mtp.layers[0].mlp.experts.config._experts_implementation = args.experts_impl
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    T = args.seq_len
    log = open(args.out / "train_log.jsonl", "w")
    print(f"params {n_params / 1e6:.2f}M  train tokens {len(train) / 1e6:.2f}M  steps {args.steps}  "
          f"tokens/step {args.batch * T}", flush=True)
    t0 = time.time()
    step = 0
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train) - T - 1, (args.batch,), generator=gen)
        x = torch.stack([train[s : s + T] for s in starts.tolist()])
        model.train()
        loss, parts = model.losses(x, args.mtp_weight, args.aux_coef)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        elapsed = time.time() - t0
        rec = {"step": step + 1, "lr": lr, "loss": loss.item(), **parts, "gnorm": gnorm, "elapsed_s": elapsed}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % 10 == 0 or step == args.steps - 1:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True)
        if (step + 1) % args.save_every == 0:
            save_checkpoint(model, args, step + 1, elapsed)
        if args.max_minutes and elapsed > args.max_minutes * 60:
            print(f"time limit reached after {step + 1} steps", flush=True)
            break
    wall = time.time() - t0
    save_checkpoint(model, args, step + 1, wall)
    info = {"seed": args.seed, "steps": step + 1, "wall_s": round(wall), "tokens_per_step": args.batch * T,
            "train_tokens": len(train), "params": n_params, "command": " ".join(sys.argv[1:]),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    (args.out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"done: {step + 1} steps in {wall / 60:.1f} min", flush=True)
    if args.export:
        from .export import export_model

        export_model(model, args.tokenizer, args.export)


def save_checkpoint(model, args, step: int, elapsed: float):
    tmp = args.out / "ckpt.pt.tmp"
    torch.save({"model": model.state_dict(), "step": step, "elapsed_s": elapsed,
                "arch": json.loads(args.arch), "args": {k: str(v) for k, v in vars(args).items()}}, tmp)
    os.replace(tmp, args.out / "ckpt.pt")


if __name__ == "__main__":
    main()
