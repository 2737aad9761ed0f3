"""moerun against llama.cpp on the same GGUF files, taking turns (issue 36 item 6).

    python benchmarks/same_file.py FILE.gguf [FILE2.gguf ...] [--threads 2,1] [--rounds 2]
                                   [--prompt 512] [--gen 128] [--reps 1] [--moerun-warmup full|short]
                                   [--json OUT]

Per round, file and thread count: `moerun bench -m FILE --threads T --prompt-tokens P
--gen-tokens G --reps R --json` and `llama-bench -m FILE -p P -n 0 -t T -r R -o json` plus
`llama-bench -m FILE -p 0 -n G -d P -t T -r R -o json` (the native build of
benchmarks/llamacpp.py), in alternating order from round to round. Both engines decode their
G tokens after P tokens of context (moerun after its timed prompt, llama-bench with -d P).

The warm-ups are the same (2026-12-03): each engine is a fresh process that loads the file
and runs one untimed prefill of P tokens before its timed prefills (llama-bench's warm-up
`test_prompt(ctx, n_prompt)`; moerun bench's default `--warmup full`), then one (llama-bench)
or three (moerun) decode steps before its timed decode. Each figure is the mean of the R
timed runs (llama-bench's avg_ts; moerun's prefill_tok_s). `--moerun-warmup short` gives
moerun bench's earlier protocol, a 4-token warm-up pass, whose first timed prefill pays the
first touch of what a prompt of P tokens needs and 4 tokens do not (the file's expert pages,
workspaces grown to P, the chunked paths' code), which llama.cpp's warm-up pays outside its
timing; it is there to show what the protocol alone moves. (llama.cpp also maps the file with
MAP_POPULATE at load, moerun does not by default, `--populate`: measured, that did not make
its first pass faster; docs/benchmarks.md, 2026-12-03.)

It prints, per file: the tensor types' bytes read per decoded token (the
routed experts' top-k share, the embedding's one row; from the file, as
vs_llamacpp.gguf_bytes_per_token) and, per thread count, the median and range of each
engine's prefill and decode tok/s, their ratio, and the bytes per second each decode reads
against the read bandwidth (`torch.sum` over 1 GiB, best of 3, before and after the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def bytes_by_type(path: Path) -> dict:
    """Bytes per decoded token by (component, GGUF type), and the totals."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")

    def meta(key):
        f = r.fields[f"{arch}.{key}"]
        return int(f.parts[-1][0])

    n_used, n_exp = meta("expert_used_count"), meta("expert_count")
    by = {}
    for t in r.tensors:
        nb = float(t.n_bytes)
        if "_exps." in t.name:
            comp, nb = "routed experts " + t.name.split(".")[2].removesuffix("_exps"), nb * n_used / n_exp
        elif t.name.startswith("token_embd"):
            comp, nb = "embedding", nb / int(t.shape[-1])
        elif t.name.startswith("output."):
            comp = "head"
        elif ".attn_" in t.name and "norm" not in t.name:
            comp = "attention"
        else:
            comp = "norms, router"
        key = f"{comp} ({t.tensor_type.name})"
        by[key] = by.get(key, 0.0) + nb
    del r
    return {"by": {k: int(v) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}, "total": int(sum(by.values()))}


def run_moerun(path: Path, threads: int, prompt: int, gen: int, reps: int = 1, warmup: str = "full") -> dict:
    exe = Path(sys.executable).with_name("moerun")
    cmd = [str(exe), "bench", "-m", str(path), "--threads", str(threads), "--prompt-tokens", str(prompt),
           "--gen-tokens", str(gen), "--reps", str(reps), "--warmup", warmup, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: moerun bench failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    j = json.loads(r.stdout.strip().splitlines()[-1])
    return {"pp": j["prefill_tok_s"], "tg": j["decode_tok_s"], "why": (j.get("decode_path") or {}).get("why")}


def run_llama(path: Path, threads: int, prompt: int, gen: int, reps: int = 1) -> dict:
    import llamacpp

    bench = str(llamacpp.tool("llama-bench"))
    out = {}
    for args in (["-p", str(prompt), "-n", "0"], ["-p", "0", "-n", str(gen), "-d", str(prompt)]):
        cmd = [bench, "-m", str(path), *args, "-t", str(threads), "-r", str(reps), "-o", "json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"error: llama-bench failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        for t in json.loads(r.stdout):
            out["pp" if t["n_gen"] == 0 else "tg"] = float(t["avg_ts"])
    return out


def med_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1, help="timed runs per engine turn (llama-bench -r, moerun --reps)")
    ap.add_argument("--moerun-warmup", choices=("full", "short"), default="full",
                    help="moerun bench --warmup: full (a pass of the prompt's size, as llama-bench) or short "
                         "(the 4-token pass moerun bench had before 2026-12-03)")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.rounds < 1:
        print("error: --reps and --rounds must be at least 1", file=sys.stderr)
        return 1
    for f in a.files:
        if not f.is_file():
            print(f"error: {f}: no such file", file=sys.stderr)
            return 1
    from vs_llamacpp import machine, read_bandwidth

    threads = [int(t) for t in a.threads.split(",")]
    res = {"machine": machine(), "bw_before": {t: read_bandwidth(t) for t in threads}, "files": {}}
    for f in a.files:
        res["files"][str(f)] = {"bytes": bytes_by_type(f), "runs": {t: {"moerun": [], "llama.cpp": []} for t in threads}}
    for rnd in range(a.rounds):
        for f in a.files:
            for t in threads:
                order = [("moerun", lambda *x: run_moerun(*x, warmup=a.moerun_warmup)), ("llama.cpp", run_llama)]
                for name, fn in order if rnd % 2 == 0 else order[::-1]:
                    r = fn(f, t, a.prompt, a.gen, a.reps)
                    res["files"][str(f)]["runs"][t][name].append(r)
                    print(f"[{time.strftime('%H:%M:%S')}] round {rnd} {f.name} t{t} {name}: pp {r['pp']:.1f} "
                          f"tg {r['tg']:.2f}" + (f" (native stack off: {r['why']})" if r.get("why") else ""),
                          file=sys.stderr, flush=True)
    res["bw_after"] = {t: read_bandwidth(t) for t in threads}
    m = res["machine"]
    print(f"{m['date']}, {m['cpu']}, L3 {m['l3']}, moerun {m['moerun_commit']} ({m['moerun_kernels']})")
    print(f"protocol: prompt {a.prompt}, gen {a.gen} after it, {a.reps} timed run(s) per turn; warm-up pass: "
          f"llama-bench {a.prompt} tokens, moerun {a.prompt if a.moerun_warmup == 'full' else 4} tokens")
    print("read bandwidth GB/s (before / after): " + ", ".join(
        f"{t} thread(s) {res['bw_before'][t] / 1e9:.1f} / {res['bw_after'][t] / 1e9:.1f}" for t in threads))
    for f, d in res["files"].items():
        b = d["bytes"]
        print(f"\n{f}: {b['total'] / 2**20:.0f} MiB read per decoded token: " + ", ".join(
            f"{k} {v / 2**20:.0f}" for k, v in b["by"].items()))
        print("| threads | moerun pp / tg tok/s | llama.cpp pp / tg tok/s | pp ratio (rounds) | tg ratio | "
              "tg GB/s moerun / llama.cpp (of bandwidth) |")
        print("|---|---|---|---|---|---|")
        for t, runs in d["runs"].items():
            mo, ll = runs["moerun"], runs["llama.cpp"]
            mpp, mtg = [r["pp"] for r in mo], [r["tg"] for r in mo]
            lpp, ltg = [r["pp"] for r in ll], [r["tg"] for r in ll]
            bw = max(res["bw_before"][t], res["bw_after"][t])
            gm, gl = statistics.median(mtg) * b["total"], statistics.median(ltg) * b["total"]
            print(f"| {t} | {med_range(mpp)} / {med_range(mtg)} | {med_range(lpp)} / {med_range(ltg)} | "
                  f"{statistics.median(mpp) / statistics.median(lpp):.2f}x "
                  f"({', '.join(f'{x / y:.2f}' for x, y in zip(mpp, lpp))}) | "
                  f"**{statistics.median(mtg) / statistics.median(ltg):.2f}x** | "
                  f"{gm / 1e9:.1f} ({gm / bw:.0%}) / {gl / 1e9:.1f} ({gl / bw:.0%}) |")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
