"""What a user meets after load: the load's time and the first prompt's, with and without
paging the model file in at load (`moerun.load(populate=...)`, `--no-populate`).

    python benchmarks/first_prompt.py -m FILE.gguf [--prompt 512] [--threads 2] [--rounds 2]
                                      [--cold] [--json OUT]

Each run is a fresh process: `moerun.load(FILE, populate=P)` timed, then a prefill of
--prompt random tokens into an empty cache (the first pass the net makes: no warm-up), then
a second prefill of fresh tokens (by then the pages the first touched are in). Runs alternate
populate on / off, --rounds times. --cold drops the page cache before each run (`sync; echo 3
> /proc/sys/vm/drop_caches`: root, and every other process's cached files go too), so the
file is read from disk, by the load's populate or by the first prompt's page faults.
Prints per setting the median (range) of load s, first-prefill tok/s, second-prefill tok/s,
and load + first prefill, the time to the first token's logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
import moerun
from moerun.layers.cache import Cache
from moerun.engine.generate import run_plans
path, populate, n, threads = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
llm = moerun.load(path, threads=threads, populate=populate)
load_s = time.perf_counter() - t0
net, g = llm.net, torch.Generator().manual_seed(0)
out = {"load_s": load_s}
with torch.inference_mode():
    for k in ("first", "second"):
        cache = Cache(net.cache_spec(), 1, n + 1, llm.dtype, llm.kv_dtype)
        plans = run_plans(net, cache, (1,))
        ids = torch.randint(0, net.args.vocab_size, (1, n), generator=g)
        t0 = time.perf_counter()
        net(ids, cache, last_only=True, **plans)
        out[k + "_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run(path: Path, populate: bool, n: int, threads: int, cold: bool) -> dict:
    if cold:
        drop_caches()
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), "1" if populate else "0", str(n), str(threads)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: the run failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    d["process_s"] = time.perf_counter() - t0
    return d


def med(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    if not a.model.is_file():
        print(f"error: {a.model}: no such file", file=sys.stderr)
        return 1
    if a.prompt < 1 or a.rounds < 1 or a.threads < 1:
        print("error: --prompt, --rounds and --threads must be at least 1", file=sys.stderr)
        return 1
    res: dict[str, list] = {"populate": [], "no populate": []}
    for rnd in range(a.rounds):
        order = [True, False] if rnd % 2 == 0 else [False, True]
        for p in order:
            d = run(a.model, p, a.prompt, a.threads, a.cold)
            res["populate" if p else "no populate"].append(d)
            print(f"[{time.strftime('%H:%M:%S')}] round {rnd} {'populate' if p else 'no populate'}: load "
                  f"{d['load_s']:.2f} s, first {a.prompt / d['first_s']:.1f} tok/s, second "
                  f"{a.prompt / d['second_s']:.1f} tok/s", file=sys.stderr, flush=True)
    print(f"{a.model} ({a.model.stat().st_size / 2**30:.2f} GiB), {a.threads} threads, prompt {a.prompt}, "
          f"page cache {'dropped before each run' if a.cold else 'as it is (warm after the first run)'}")
    print("| load | load s | first prefill tok/s | second prefill tok/s | load + first prefill s |")
    print("|---|---|---|---|---|")
    for k, ds in res.items():
        print(f"| {k} | {med([d['load_s'] for d in ds])} | {med([a.prompt / d['first_s'] for d in ds], '.1f')} | "
              f"{med([a.prompt / d['second_s'] for d in ds], '.1f')} | "
              f"{med([d['load_s'] + d['first_s'] for d in ds])} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a) | {"model": str(a.model)}, "runs": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
