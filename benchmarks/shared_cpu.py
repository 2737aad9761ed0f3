"""Decode speed when another process keeps a core busy: the default threads against `--threads 1`.

    python benchmarks/shared_cpu.py [--models demo,/var/tmp/q3-4l-int4] [--rounds 3]
                                    [--import-from /tmp/old] [--pin-busy CPU] [--json OUT]

Every run is a fresh process (load, a short warm-up, then `moerun.bench.run.bench`: a random
prompt, then decode timed), the way `moerun bench` runs. Per model and round, in this order:

- idle: the default threads (all cores, as `moerun generate` without --threads), on this
  checkout, and on the one given by --import-from (the "before"), when given;
- busy: the same runs while a busy-loop process of the benchmark's own keeps one core busy
  (`while True: pass`, pinned to --pin-busy if given), default threads and `--threads 1`,
  for this checkout (and the other one).

The busy loop is started for each busy run and stopped after it; it also stops itself after
--busy-timeout seconds, whatever happens to this script. The whole script should run under
`flock /tmp/moerun-heavy.lock` on a shared machine. It prints every run, then per model the
medians and ranges over the rounds: decode tok/s, and the ratio default / --threads 1 with
one core busy (the target: never below 0.8).

The Qwen3-30B-A3B-shaped model is made when missing (a random checkpoint, 4 layers, written
int4 by `moerun quantize`), under `flock /tmp/moerun-model.lock`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
Q3 = "/var/tmp/q3-4l-int4"


def machine() -> dict:
    """CPU model, cores and L3 size as lscpu reports them."""
    out = {"cpus": os.cpu_count()}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "L3 cache", "CPU family", "Model"):
            out[key.strip()] = value.strip()
    return out


def ensure_q3(path: str) -> None:
    """The random Qwen3-30B-A3B-shaped int4 model at `path` (made once, under a lock)."""
    if (Path(path) / "config.json").is_file():
        return
    raw = path.removesuffix("-int4") if path.endswith("-int4") else path + "-raw"
    moerun = str(Path(sys.executable).with_name("moerun"))
    script = (f"test -f {path}/config.json || {{ test -f {raw}/config.json || "
              f"{moerun} random-model qwen3-30b-a3b --layers 4 -o {raw}; {moerun} quantize -m {raw} -o {path}; }}")
    subprocess.run(["flock", "/tmp/moerun-model.lock", "sh", "-c", script], check=True)


RUN = """
import json, sys, time
sys.path.insert(0, {here!r})
from checkout import import_from
import_from({src!r})
import moerun
from moerun import kernels
from moerun.bench.run import bench
from moerun.cli import _threads
llm = moerun.load({model!r}, threads={threads!r})
bench(llm, prompt_tokens=8, gen_tokens=4)
r = bench(llm, prompt_tokens={prompt}, gen_tokens={gen})
nat = kernels._native()
r["threads_used"] = _threads()
r["cpu_shared"] = bool(nat.cpu_shared()) if nat is not None and hasattr(nat, "cpu_shared") else None
r["pool_stats"] = list(nat.pool_stats()) if nat is not None and hasattr(nat, "pool_stats") else None
print(json.dumps(r))
"""

BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def start_busy(seconds: float, cpu: int | None) -> subprocess.Popen:
    """A process that keeps one core busy for `seconds` at most (it stops itself)."""
    cmd = [sys.executable, "-c", BUSY.format(s=seconds)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    p = subprocess.Popen(cmd)
    time.sleep(0.2)  # running before the measured process starts
    return p


def stop_busy(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def run_one(a, model: str | None, threads: int | None, src: str | None, busy: bool, gen: int) -> dict:
    code = RUN.format(here=str(HERE), src=src, model=model, threads=threads, prompt=a.prompt_tokens, gen=gen)
    hog = start_busy(a.busy_timeout, a.pin_busy) if busy else None
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=a.run_timeout)
    except subprocess.TimeoutExpired:
        return {"decode_tok_s": 0.0, "error": f"timed out after {a.run_timeout} s"}
    finally:
        if hog is not None:
            stop_busy(hog)
    if out.returncode != 0:
        raise SystemExit(f"run failed ({model}, threads {threads}, {src or 'this checkout'}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=f"demo,{Q3}", help="comma-separated: demo (the bundled model) or paths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--gen-tokens", default="256,32", help="tokens decoded per run, per model (one value: all)")
    ap.add_argument("--import-from", default=None, help="another checkout to measure as 'before' (benchmarks/checkout.py)")
    ap.add_argument("--pin-busy", type=int, default=None, help="pin the busy loop to this CPU (default: not pinned)")
    ap.add_argument("--busy-timeout", type=float, default=300.0, help="the busy loop stops itself after this long")
    ap.add_argument("--run-timeout", type=float, default=240.0, help="a run that takes longer counts as 0 tok/s")
    ap.add_argument("--json", default=None, help="also write every run and the summary here")
    a = ap.parse_args(argv)

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    gens = [int(g) for g in a.gen_tokens.split(",")]
    gens = gens + [gens[-1]] * (len(models) - len(gens))
    for m in models:
        if m == Q3 or m.rstrip("/") == Q3:
            ensure_q3(Q3)
    info = machine()
    head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"CPU {info.get('Model name')} (family {info.get('CPU family')} model {info.get('Model')}), "
          f"{info['cpus']} CPUs, L3 {info.get('L3 cache')}; commit {head}; busy loop "
          f"{'pinned to CPU %d' % a.pin_busy if a.pin_busy is not None else 'not pinned'}")
    sources = [("after", None)] + ([("before", a.import_from)] if a.import_from else [])
    runs = []
    for r in range(a.rounds):
        for model, gen in zip(models, gens):
            path = None if model == "demo" else model
            for busy in (False, True):
                for label, src in sources:
                    for threads in ((None, 1) if busy else (None,)):
                        res = run_one(a, path, threads, src, busy, gen)
                        row = {"round": r + 1, "model": model, "busy": busy, "code": label,
                               "threads_arg": threads or "default", "threads_used": res.get("threads_used"),
                               "decode_tok_s": res["decode_tok_s"], "prefill_tok_s": res.get("prefill_tok_s"),
                               "cpu_shared": res.get("cpu_shared"), "pool_stats": res.get("pool_stats"),
                               "error": res.get("error")}
                        runs.append(row)
                        print(f"round {r + 1} {model} {'busy' if busy else 'idle'} {label} threads "
                              f"{row['threads_arg']} (used {row['threads_used']}): decode {row['decode_tok_s']:.2f} tok/s"
                              f"{'' if row['cpu_shared'] is None else ', pool saw the CPU shared: %s' % row['cpu_shared']}"
                              f"{'  ' + row['error'] if row['error'] else ''}", flush=True)

    summary = {}
    for model in models:
        print(f"\n{model}: decode tok/s, median (range) of {a.rounds} rounds")
        for label, _ in sources:
            def pick(busy, threads):
                return [x for x in runs if x["model"] == model and x["code"] == label and x["busy"] == busy
                        and x["threads_arg"] == threads]
            idle, b_def, b_one = pick(False, "default"), pick(True, "default"), pick(True, 1)
            ratios = [d["decode_tok_s"] / o["decode_tok_s"] for d, o in zip(b_def, b_one) if o["decode_tok_s"] > 0]
            s = {"idle_default": [x["decode_tok_s"] for x in idle], "busy_default": [x["decode_tok_s"] for x in b_def],
                 "busy_threads1": [x["decode_tok_s"] for x in b_one], "busy_ratio": ratios}
            summary[f"{model} {label}"] = s
            print(f"  {label:6s} idle, default threads: {fmt(s['idle_default'])}")
            print(f"  {label:6s} one core busy, default threads: {fmt(s['busy_default'])}; --threads 1: "
                  f"{fmt(s['busy_threads1'])}; ratio default / 1: {fmt(ratios)}"
                  f"{'' if not ratios else ('  (target >= 0.8: ' + ('met' if min(ratios) >= 0.8 else 'MISSED') + ')')}")
        if a.import_from:
            before, after = summary[f"{model} before"]["idle_default"], summary[f"{model} after"]["idle_default"]
            print(f"  idle, default threads, after / before: {fmt([x / y for x, y in zip(after, before)])}")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": info, "commit": head, "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
