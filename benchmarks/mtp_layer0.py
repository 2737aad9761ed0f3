"""The next token's layer 0 from the MTP head's draft (`--predictor lookahead_mtp`, issue 37) on a
model whose routing is not random: how well each source names the experts layer 0 then uses.

Per decode pass, layer 0's hints for the next token come from
  last    this token's layer-0 choice (what `lookahead` hints)
  draft   the MTP head's draft of the next token, its embedding normed by layer 0's
          post-attention norm, through layer 0's router (what `lookahead_mtp` hints)
  token   not a hint: the right next token through the same approximate route, scored once it
          is sampled (the ceiling of a perfect draft under that approximation)
each scored as precision and recall against the experts layer 0 then chose (at a budget of
`--factor` x top-k hints), with the drafts' token accuracy and the head's time per token.

    python benchmarks/mtp_layer0.py --prompts data/corpus/heldout.jsonl --sequences 8 --max-tokens 64

(default model: the bundled demo model, which has an MTP head). The store holds every expert
(`--ram-budget 100%`): the figures are the predictions', not a speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="model directory or GGUF file (default: the demo model)")
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with a `text` field per line")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--factor", type=float, default=1.0, help="hints per layer, x top-k")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if not a.prompts.is_file():
        print(f"mtp_layer0: error: {a.prompts} is not a file", file=sys.stderr)
        return 1
    import moerun
    from moerun.experts import StoreOptions, load
    from moerun.experts.predict import attach_predictor

    path = a.model or str(Path(moerun.__file__).parent / "demo_model")
    llm = load(path, threads=a.threads, options=StoreOptions(ram_budget="100%"))
    drv = llm.predictor = attach_predictor(llm.net, llm.store, "lookahead_mtp", factor=a.factor)
    docs = []
    for line in a.prompts.read_text().splitlines():
        if line.strip():
            ids = llm.tokenizer.encode(json.loads(line)["text"])
            if len(ids) >= a.prompt_tokens:
                docs.append(ids[: a.prompt_tokens])
        if len(docs) == a.sequences:
            break
    out = {"model": path, "sequences": len(docs), "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
           "factor": a.factor, "top_k": drv.top_k, "budget": drv.budget, "runs": []}
    print(f"# {Path(path).name}: {len(docs)} prompts of {a.prompt_tokens} tokens from {a.prompts.name}, "
          f"{a.max_tokens} tokens each; layer 0 hinted with {drv.budget} experts (top-{drv.top_k})")
    print("\n| sampling | decode passes | this token's choice: precision / recall | MTP draft: precision / recall "
          "| right token, same route (ceiling) | draft token accuracy | MTP head ms/token |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for t in a.temperature:
        drv.reset_layer0_stats()
        for i, ids in enumerate(docs):
            llm.generate_ids([ids], max_tokens=a.max_tokens, temperature=t, seed=i)
        c = drv.layer0_stats()
        out["runs"].append({"temperature": t, **c})

        def pr(src):
            return "-" if c[f"{src}_precision"] is None else f"{c[f'{src}_precision']:.2f} / {c[f'{src}_recall']:.2f}"
        print(f"| {'greedy' if t == 0 else f'temperature {t}'} | {c['passes']} | {pr('last')} | {pr('draft')} | "
              f"{pr('token')} | {c['draft_accuracy']:.2f} | {c['draft_ms']:.2f} |", flush=True)
    llm.store.close()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
