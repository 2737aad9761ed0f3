"""Load test of `moerun serve`: 1, 4, 16 concurrent streaming clients.

Prints, per concurrency level: aggregate generated tokens/s, p50/p99 time to first token,
p50/p99 inter-token latency (gap between streamed chunks), the mean decode batch the server
ran, and the expert store's hit rate and misses per generated token over that level when
the model has a store (--ram-budget). Lookups count once per expert per layer per step, so
a batch that shares an expert reads it once for all its rows. --unbatched repeats the largest level on a server with one slot
(max_concurrency=1: requests queue and are decoded one at a time) for the
with/without-batching comparison.

    python benchmarks/serve_load.py [-m DIR] [--clients 1,4,16] [--max-tokens 32] [--threads 1]
    python benchmarks/serve_load.py --url http://127.0.0.1:8000   # a server already running
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx

SERVER = """
import sys, json
opts = json.loads(sys.argv[1])
import moerun
from moerun.server import serve
if opts["ram_budget"]:
    from moerun.experts.attach import load
    from moerun.experts.store import StoreOptions
    llm = load(opts["model"], dtype=opts["dtype"], threads=opts["threads"],
               options=StoreOptions(ram_budget=opts["ram_budget"], cache_policy=opts["cache_policy"]))
else:
    llm = moerun.load(opts["model"], dtype=opts["dtype"], threads=opts["threads"])
serve(llm, "127.0.0.1", opts["port"], max_concurrency=opts["max_concurrency"], max_queue=1024, log_level="warning")
"""

TOPICS = ["the sea", "a robot", "mountains", "a library", "rain", "an old clock", "trains", "a garden",
          "the moon", "bread", "a violin", "winter", "bees", "a lighthouse", "maps", "the desert"]


def start_server(args, max_concurrency: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = dict(model=args.model, dtype=args.dtype, threads=args.threads, port=port, max_concurrency=max_concurrency,
                ram_budget=args.ram_budget, cache_policy=args.cache_policy)
    proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(opts)])
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit("the server did not start within 10 minutes")
        time.sleep(0.5)


def scrape(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def one_request(http: httpx.AsyncClient, model: str, i: int, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me a short story about {TOPICS[i % len(TOPICS)]}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0 if stamps else float("nan"),
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens}


async def run_level(base: str, model: str, clients: int, per_client: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=httpx.Limits(max_connections=clients + 4)) as http:
        async def client(c):
            return [await one_request(http, model, c * per_client + k, max_tokens) for k in range(per_client)]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    reqs = [r for rs in results for r in rs]
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in reqs), "ttft": [r["ttft"] for r in reqs],
            "gaps": [g for r in reqs for g in r["gaps"]], "requests": len(reqs)}


def pct(xs, q):
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def measure(base: str, model: str, clients: int, args) -> dict:
    # warm-up: one short request so that lazy work (first prefill, allocations) is not timed
    asyncio.run(run_level(base, model, 1, 1, 4))
    m0 = scrape(base)
    lv = asyncio.run(run_level(base, model, clients, args.requests_per_client, args.max_tokens))
    m1 = scrape(base)
    d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)  # noqa: E731
    row = {
        "clients": clients, "requests": lv["requests"], "tokens": lv["tokens"], "wall_s": round(lv["wall_s"], 3),
        "tok_s": round(lv["tokens"] / lv["wall_s"], 2),
        "ttft_p50_s": round(pct(lv["ttft"], 50), 4), "ttft_p99_s": round(pct(lv["ttft"], 99), 4),
        "itl_p50_s": round(pct(lv["gaps"], 50), 4), "itl_p99_s": round(pct(lv["gaps"], 99), 4),
        "mean_decode_batch": round(d("moerun_decode_batch_size_sum") / max(d("moerun_decode_batch_size_count"), 1), 2),
    }
    req0, req1 = m0.get("moerun_expert_store_requests"), m1.get("moerun_expert_store_requests")
    if req0 is not None and req1 is not None and req1 > req0:
        hits = m1["moerun_expert_store_expert_hit_rate"] * req1 - m0["moerun_expert_store_expert_hit_rate"] * req0
        row["expert_hit_rate"] = round(hits / (req1 - req0), 4)
        row["expert_lookups_per_token"] = round((req1 - req0) / max(lv["tokens"], 1), 2)
        row["expert_misses_per_token"] = round((req1 - req0 - hits) / max(lv["tokens"], 1), 2)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="model directory (default: the bundled demo model)")
    ap.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (EOS ignored)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--ram-budget", default=None, help="put the experts in a store with this RAM budget (e.g. 30%%)")
    ap.add_argument("--cache-policy", default="lru")
    ap.add_argument("--unbatched", action="store_true", help="also run the largest level with max_concurrency=1")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.model is None and args.url is None:
        from moerun.engine.llm import default_model_path

        args.model = str(default_model_path())
    levels = [int(x) for x in args.clients.split(",")]

    rows = []
    runs = [("batched", args.max_concurrency, levels)]
    if args.unbatched:
        runs.append(("unbatched", 1, [max(levels)]))
    for label, conc, lv in runs:
        proc = None
        base = args.url
        if base is None:
            proc, base = start_server(args, conc)
        try:
            model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            for c in lv:
                row = {"server": label, "max_concurrency": conc, **measure(base, model, c, args)}
                rows.append(row)
                if not args.json:
                    print(json.dumps(row), flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        if args.url:
            break
    if args.json:
        print(json.dumps({"model": args.model or args.url, "threads": args.threads, "max_tokens": args.max_tokens,
                          "levels": rows}))
    else:
        print(f"\n{'server':10} {'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
              f"{'batch':>6} {'hit rate':>8} {'miss/tok':>8}")
        for r in rows:
            print(f"{r['server']:10} {r['clients']:>7} {r['tok_s']:>8.1f} {r['ttft_p50_s']:>9.3f} {r['ttft_p99_s']:>9.3f} "
                  f"{r['itl_p50_s']:>8.4f} {r['itl_p99_s']:>8.4f} {r['mean_decode_batch']:>6.2f} "
                  f"{r.get('expert_hit_rate', float('nan')):>8.3f} {r.get('expert_misses_per_token', float('nan')):>8.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
