"""The server under hostile load, as figures: memory and stream gaps under large bodies, and
what SIGTERM does to streams in flight.

Starts `moerun serve` (the demo model unless -m) as a subprocess on a loopback port, then:
1. reads the server's RSS, sends bodies of --big-mib MiB (over the 4 MiB cap: 413) and
   bodies just under the cap, --bodies of each, while a stream decodes back to back; prints
   the RSS before and after and the worst gap between a stream's chunks;
2. starts 4 long streams, sends SIGTERM, and prints how each ended, the exit code and how
   long the shutdown took (--shutdown-timeout given to the server).

    python benchmarks/serve_hostile.py [-m DIR] [--bodies 20] [--shutdown-timeout 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

CHAT = "/v1/chat/completions"


def cpu() -> str:
    model = re.search(r"model name\s*:\s*(.*)", open("/proc/cpuinfo").read())
    l3 = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    l3 = re.search(r"L3 cache:\s*(.*)", l3)
    return f"{model.group(1) if model else platform.processor()}, L3 {l3.group(1).strip() if l3 else '?'}"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def start(model, port, threads, *flags):
    cmd = [sys.executable, "-m", "moerun.cli", "serve", "--port", str(port), "--threads", str(threads), *flags]
    if model:
        cmd += ["-m", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base, httpx.get(base + "/v1/models").json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("the server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def large_bodies(a) -> None:
    proc, base, model = start(a.model, free_port(), a.threads)
    try:
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        httpx.post(base + CHAT, json=body, timeout=60)  # warm
        over = json.dumps({**body, "messages": [{"role": "user", "content": "x" * (a.big_mib << 20)}]}).encode()
        under = json.dumps({**body, "messages": [{"role": "user", "content": "word " * ((4 << 20) // 5 - 40)}]}).encode()
        gaps, stop = [], threading.Event()

        def stream():
            while not stop.is_set():
                with httpx.stream("POST", base + CHAT, timeout=60, json={
                        **body, "max_tokens": 256, "stream": True, "ignore_eos": True}) as r:
                    last = None
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        before = rss_mib(proc.pid)
        post = lambda raw: httpx.post(base + CHAT, content=raw, timeout=120,  # noqa: E731
                                      headers={"Content-Type": "application/json"}).status_code
        with ThreadPoolExecutor(3) as pool:
            watcher = pool.submit(stream)
            t0 = time.perf_counter()
            codes_over = list(pool.map(lambda _: post(over), range(a.bodies)))
            codes_under = list(pool.map(lambda _: post(under), range(a.bodies)))
            took = time.perf_counter() - t0
            stop.set()
            watcher.result()
        after = rss_mib(proc.pid)
        gaps.sort()
        print(f"large bodies: {a.bodies} x {len(over) / 2**20:.1f} MiB -> {sorted(set(codes_over))}, "
              f"{a.bodies} x {len(under) / 2**20:.2f} MiB -> {sorted(set(codes_under))}, in {took:.1f} s")
        print(f"  server RSS before {before:.0f} MiB, after {after:.0f} MiB")
        print(f"  a stream meanwhile: {len(gaps)} gaps between chunks, median {gaps[len(gaps) // 2] * 1e3:.1f} ms, "
              f"worst {gaps[-1] * 1e3:.1f} ms")
    finally:
        proc.terminate()
        proc.wait(60)


def shutdown(a) -> None:
    proc, base, model = start(a.model, free_port(), a.threads, "--shutdown-timeout", str(a.shutdown_timeout),
                              "--max-concurrency", "4")
    ends = [None] * 4
    first = [threading.Event() for _ in range(4)]

    def stream(i):
        body = {"model": model, "max_tokens": 100_000, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"story {i}"}]}
        finish, error, chunks = None, None, 0
        with httpx.stream("POST", base + CHAT, json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                first[i].set()
                if "error" in ev:
                    error = ev["error"]["code"]
                elif ev["choices"] and ev["choices"][0]["finish_reason"]:
                    finish = ev["choices"][0]["finish_reason"]
                chunks += 1
        ends[i] = (chunks, finish, error)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for e in first:
        e.wait(120)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        httpx.post(base + CHAT, json={"model": model, "messages": [{"role": "user", "content": "hi"}]}, timeout=5)
        refused = "answered (not refused)"
    except httpx.HTTPError as e:
        refused = f"refused ({type(e).__name__})"
    for t in threads:
        t.join()
    code = proc.wait(120)
    print(f"shutdown (--shutdown-timeout {a.shutdown_timeout:g}): exit code {code} after {time.perf_counter() - t0:.2f} s; "
          f"a new request after SIGTERM: {refused}")
    for i, (chunks, finish, error) in enumerate(ends):
        print(f"  stream {i}: {chunks} events, finish_reason {finish!r}, error event {error!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--threads", type=int, default=1, help="the server's threads")
    p.add_argument("--bodies", type=int, default=20, help="large bodies of each kind")
    p.add_argument("--big-mib", type=int, default=20, help="MiB of the bodies over the cap")
    p.add_argument("--shutdown-timeout", type=float, default=2.0, help="the server's --shutdown-timeout")
    a = p.parse_args()
    print(f"CPU: {cpu()}; {os.cpu_count()} cores; server threads {a.threads}")
    large_bodies(a)
    shutdown(a)


if __name__ == "__main__":
    main()
