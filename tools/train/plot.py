"""Plot the training curves of runs/demo/train_log.jsonl to a PNG (needs matplotlib).

    python -m tools.train.plot --log runs/demo/train_log.jsonl --out moerun/demo_model/loss_curve.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def smooth(xs, k=10):
    out, acc = [], []
    for x in xs:
        acc.append(x)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, nargs="+", default=[Path("runs/demo/train_log.jsonl")],
                    help="one log per training stage, in order")
    ap.add_argument("--out", type=Path, default=Path("moerun/demo_model/loss_curve.png"))
    ap.add_argument("--heldout-ppl", type=float, default=None)
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs, bounds, offset = [], [], 0
    for path in args.log:
        stage = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
        recs += [{**r, "step": r["step"] + offset} for r in stage]
        offset += stage[-1]["step"]
        bounds.append(offset)
    step = [r["step"] for r in recs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("ce", "next token (CE)"), ("ce_mtp", "MTP: token after next (CE)")):
        a1.plot(step, [r[key] for r in recs], alpha=0.25)
        a1.plot(step, smooth([r[key] for r in recs]), label=label, color=a1.lines[-1].get_color())
    if args.heldout_ppl:
        import math

        a1.axhline(math.log(args.heldout_ppl), ls="--", color="gray", label=f"held-out next-token CE (ppl {args.heldout_ppl:.1f})")
    for b in bounds[:-1]:
        a1.axvline(b, color="k", lw=0.5, ls=":")
        a2.axvline(b, color="k", lw=0.5, ls=":")
    a1.set_xlabel("step (dotted: start of the next stage)")
    a1.set_ylabel("cross-entropy (nats)")
    a1.set_title("training loss (light: per step, dark: mean of 10)")
    a1.legend()
    a2.plot(step, [r["aux"] for r in recs], label="load-balancing loss (1.0 = uniform)")
    a2.set_xlabel("step")
    a2.set_title("router balance loss, mean over 9 MoE layers")
    a2.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
