"""Issue 7 figures on a model directory: a routing trace of held-out text, the predictor
table, the simulator tables, the plots.

  python benchmarks/predictors.py moerun/demo_model runs/issue7

Needs the corpus (scripts/fetch_corpus.sh writes data/corpus/heldout.jsonl)."""
import json, sys, time
from pathlib import Path
model, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
t0 = time.time()
from moerun.experts.profile import profile, Trace, hit_rate_curves, plot_trace
from moerun.experts.predict import evaluate, format_table
from moerun.bench.simulate import simulate, format_table as sim_table
s = profile(model, "data/corpus/heldout.jsonl", str(out / "heldout.npz"), mode="text", max_tokens=512, threads=1)
(out / "profile.json").write_text(json.dumps(s, indent=1)); print(json.dumps(s), flush=True)
tr = Trace.load(out / "heldout.npz")
res = evaluate(tr)
(out / "predict.json").write_text(json.dumps(res, indent=1))
(out / "predict.txt").write_text(format_table(res, tr) + "\n"); print(format_table(res, tr), flush=True)
print("t", time.time() - t0, flush=True)
for tag, kw in [("24gb", {}), ("12gb", {"vram_gb": 12.0}), ("24gb_8bit", {"bits": 8.5})]:
    r = simulate(tr, "pcie4+rtx4090", "qwen3.6-35b-a3b", quiet=True, **kw)
    (out / f"sim_{tag}.json").write_text(json.dumps(r, indent=1))
    txt = sim_table({k: v for k, v in r.items() if not k.startswith("_")}, r["_setup"])
    (out / f"sim_{tag}.txt").write_text(txt + "\n"); print(txt, flush=True)
    print("t", time.time() - t0, flush=True)
curves = hit_rate_curves(tr)
(out / "hit_rate.json").write_text(json.dumps({p: {str(k): v for k, v in c.items()} for p, c in curves.items()}, indent=1))
print(plot_trace(tr, out / "plots", curves=curves))
print("done", time.time() - t0)
# greedy continuations of held-out document openings (the decode regime the seeds measured)
