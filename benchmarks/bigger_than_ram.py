"""A model bigger than RAM (issue 37): moerun's expert store against llama.cpp's mmap on the
same GGUF file, each run in its own process with the page cache dropped before it.

    python benchmarks/bigger_than_ram.py -m /var/tmp/moerun-big/qwen36-35b-a3b-q8_0.gguf \\
        --ram-budget 12GiB --rows direct,direct+layer_ahead1,buffered --llama --threads 2

Rows (moerun, each `--ram-budget`): `direct` (O_DIRECT reads into aligned bounce buffers,
an expert's gate/up/down ranges read at once on a pool of pread threads), `buffered` (the
read path before: one pread per range through the page cache, dropped after each read with
POSIX_FADV_DONTNEED), either with `+PREDICTOR` (the asynchronous prefetcher driven by that
predictor, e.g. `direct+layer_ahead1`). `--llama` adds llama-bench on the same file (its
default mmap), a decode run and a prefill run.

Per run: prefill and decode tok/s, peak RSS (VmHWM; llama-bench: the peak of VmRSS polled),
bytes read from disk per token (/proc/PID/io read_bytes), and for moerun the store's hit rate,
stall, the expert read time hidden by prefetch against the time waited for, and the disk
bandwidth the reads got (bytes of the reads over the wall time of the phase). A run is killed
past `--rss-limit` (default 14 GiB) or `--timeout` seconds and reported as such: the machine
is shared. For llama-bench the limit applies to its private memory (RssAnon): the file pages
its mapping holds (RssFile) are page cache the kernel reclaims, so its RSS may pass the limit
(up to what the page cache holds) without taking memory from anyone; it is also stopped if the
machine's MemAvailable falls under `--llama-min-available` (2 GiB). No cgroup limits memory
here (memory.limit_in_bytes of the process's cgroup is unlimited): these limits are the
benchmark's own, for the other jobs on the machine. `--llama-runs` takes llama-bench's own
flags per run, e.g. `tg:--repack 0` (mmap, weights used in place) or `tg:-lm none` (no mmap:
read into memory). The page cache is dropped before each run with /proc/sys/vm/drop_caches when
permitted, else the file's pages with POSIX_FADV_DONTNEED (the line `page cache:` says which).
Random weights route almost uniformly: the worst case for any cache.

`+lookahead` (issue 37): at layer l's router, layer l+1's experts (router l+1 on layer l's
input, the union over a prompt's rows) and layer l+2's are hinted, held until layer l's own
demand misses are in, and read while layer l computes; layers 0-1 of the next token from this
token's choice. `+lookahead_mtp`: the same, but after each sampled token the MTP head drafts
the token after it and the next token's layer 0 is hinted from that draft's embedding
through layer 0's router (approximate; see predict.LookaheadMTP); a row with a predictor
also scores the next token's layer-0 hints by source (this token's choice, the draft):
precision, recall, the drafts' token accuracy and the head's time. `+NAME:F` sets the prefetch budget to F x top-k (default 1.0 for lookahead,
1.5 otherwise). `--rounds N` repeats the rows interleaved (row A, row B, A, B...).

`--ram-budget` takes a comma-separated list (`12GiB,auto`): every row runs at each budget. A
row may end in `;spec=N` and/or `;workers=N` (`direct+lookahead;spec=4;workers=8`): that row's
`--spec-inflight` (prefetch reads kept in flight while a layer reads its demand misses) and
`--disk-workers`.

Steady state (issue 37): the decode is recorded token by token (`per_token` in the JSON: time,
requests, hits, the cache's own hits, expert reads, bytes, stall, hidden and stalled read time,
and the disk reader's busy time and queue: preads in flight integrated over time), and the
tokens after the first `--steady-after N` are summed apart (`steady`): tok/s, hit rate, disk
MB/token and GB/s, the share of the time the disk had a read in flight, the mean number in
flight while it had, each pread's own rate, and from which token on the RAM tier was full
(`full_from`: before it the tier was still filling). The wall-clock disk GB/s is about the
per-pread rate x the reads in flight x the busy share. llama-bench runs `-n` the same decoded
tokens after its own warm-up (one token, after its load), as one average: it has no per-token
figures.

`--lock FILE` takes `flock FILE` for each run (the read-bandwidth reading, the probe, each
engine's run with its page-cache drop), released between runs, so other jobs on a shared
machine run between them but never during one.

`--routing-trace TRACE` adds a REPLAY row per budget: no model runs; the demo model's routing
trace (`moerun profile`, 8 layers x 32 experts, top-4) is mapped onto this file's layers and
experts (see `map_trace`) and drives the same store (get/release per layer, the reads real),
with each layer's compute stood in by a sleep (`--replay-compute-ms`). Its tok/s is the
store's, labelled as a replay.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GiB = 1 << 30
HERE = Path(__file__).resolve().parent


# -- helpers ------------------------------------------------------------------------------------

def proc_status(pid="self") -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def proc_io(pid="self") -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k] = int(v)
    except OSError:
        pass
    return out


def mem_available() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def drop_page_cache(path: Path) -> str:
    """Drop the page cache: all of it when permitted, else the file's pages."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped (echo 3 > /proc/sys/vm/drop_caches)"
    except OSError as e:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return f"drop_caches not permitted ({e.strerror}); the file's pages dropped with POSIX_FADV_DONTNEED"


def cpu_line() -> str:
    model = platform.processor() or "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def watchdog(limit: int, what: str, interval: float = 0.05):
    """Exit the process at once if its RSS passes `limit` (the machine is shared)."""
    def run():
        while True:
            rss = proc_status().get("VmRSS", 0)
            if rss > limit:
                print(json.dumps({"error": f"{what}: RSS {rss / GiB:.2f} GiB passed the limit of {limit / GiB:.2f} GiB; "
                                           "killed"}), flush=True)
                os._exit(3)
            time.sleep(interval)
    threading.Thread(target=run, daemon=True).start()


# -- one moerun run (a child process) -----------------------------------------------------------

def child(a) -> dict:
    import torch

    from moerun.layers.cache import Cache
    from moerun.engine.generate import run_plans
    from moerun.experts.attach import load as load_store
    from moerun.experts.store import StoreOptions

    watchdog(a.rss_limit, "moerun")
    row, *sets = a.row.split(";")  # `ROW;spec=N;workers=N`: this row's spec_inflight / disk workers
    for kv in sets:
        k, _, v = kv.partition("=")
        if k not in ("spec", "workers") or not v.isdigit():
            raise SystemExit(f"bigger_than_ram: error: row {a.row!r}: unknown setting {kv!r} (spec=N, workers=N)")
        setattr(a, {"spec": "spec_inflight", "workers": "disk_workers"}[k], int(v))
    if row.startswith("replay"):
        return replay_child(a)
    io_mode, _, predictor = row.partition("+")
    predictor, _, factor = predictor.partition(":")
    factor = float(factor) if factor else (1.0 if predictor.startswith("lookahead") else 1.5)
    opts = StoreOptions(ram_budget=a.ram_budget, direct_io=io_mode == "direct", cache_policy=a.cache_policy,
                        disk_workers=a.disk_workers, io_threads=a.io_threads or None, spec_inflight=a.spec_inflight)
    t0 = time.perf_counter()
    io0 = proc_io()
    llm = load_store(a.model, threads=a.threads, options=opts)
    load_s = time.perf_counter() - t0
    io_load = proc_io()["read_bytes"] - io0["read_bytes"]
    store = llm.store
    driver = None
    if predictor:
        from moerun.experts.predict import attach_predictor

        llm.predictor = driver = attach_predictor(llm.net, store, predictor, factor=factor)
    draft = driver.mtp_draft if driver is not None and driver.uses_draft else None
    net = llm.net
    vocab = net.args.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, a.prompt_tokens), generator=g)
    out = {"row": a.row, "ram_budget": a.ram_budget, "spec_inflight": a.spec_inflight, "disk_workers": a.disk_workers,
           "load_s": load_s, "load_read_bytes": io_load,
           "non_expert_bytes": store.non_expert_bytes, "experts_bytes": store.total_bytes,
           "budget_bytes": store.tiers["host"].budget, "ram_budget_auto": store.ram_auto,
           "prefault_s": store.prefault_s,
           "rss_after_load": proc_status()["VmRSS"]}

    def phase(name, fn, tokens):
        out[name] = measure(store, fn, tokens)

    with torch.inference_mode():
        cache = Cache(net.cache_spec(), 1, a.prompt_tokens + a.gen_tokens + 8, llm.dtype, llm.kv_dtype)
        plans = run_plans(net)

        def step(ids):
            if draft is None:
                return net(ids, cache, last_only=True, **plans)[:, -1].argmax(-1, keepdim=True)
            logits, hidden = net(ids, cache, last_only=True, return_hidden=True, **plans)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            draft(hidden[:, -1:], tok)  # lookahead_mtp: the MTP head drafts the token after `tok`
            return tok

        tok = step(prompt[:, :1])  # warm-up: plans, native stack, first allocations
        for _ in range(2):
            tok = step(tok)
        cache.reset(0)
        box = {}
        phase("prefill", lambda: box.update(tok=step(prompt)), a.prompt_tokens)
        tok = box["tok"]

        series = []

        def decode():
            t = tok
            prev = token_mark(store)
            for _ in range(a.gen_tokens):
                t = step(t)
                now = token_mark(store)
                series.append(token_delta(prev, now))
                prev = now
        if driver is not None:
            driver.reset_layer0_stats()
        phase("decode", decode, a.gen_tokens)
        out["decode"]["per_token"] = series
        out["decode"]["steady"] = steady(series, a.steady_after)
        if driver is not None:  # the next token's layer-0 hints: this token's choice, and the MTP draft's
            out["decode"]["layer0"] = driver.layer0_stats()
    out["peak_rss"] = proc_status()["VmHWM"]
    out["io"] = store.io
    store.close()
    return out


def token_mark(store) -> dict:
    """The store's counters, this process's disk reads and the clock, at a token's boundary."""
    return {**store.snapshot(), "io_read_bytes": proc_io()["read_bytes"], "t": time.perf_counter()}


def token_delta(a: dict, b: dict) -> dict:
    """One decoded token's figures: the difference of the marks around it."""
    d = lambda k: b[k] - a[k]  # noqa: E731
    hits = d("hits_host") + d("hits_device")
    return {"s": d("t"), "requests": d("requests"), "hits": hits, "hits_cached": d("hits_cached"), "reads": d("reads_disk"),
            "expert_bytes": d("bytes_disk"), "disk_bytes": d("io_read_bytes"), "stall_s": d("stall_s"),
            "read_stalled_s": d("read_stalled_s"), "read_hidden_s": d("read_hidden_s"),
            "disk_busy_s": d("busy_s"), "queue_depth_s": d("depth_s"), "preads": d("preads"),
            "pread_s": d("pread_s"), "pread_bytes": d("bytes_preads"), "prefetch_reads": d("prefetch_reads"),
            "prefetch_reads_used": d("prefetch_reads_used"),
            "full_at_start": bool(a["full"]), "used_bytes": b["used_bytes"]}


def steady(series: list, after: int) -> dict | None:
    """The decode figures over the tokens after the first `after` (the cache filling): tok/s,
    hit rate, disk MB a token and GB/s, the disk's busy share and mean queue depth (preads in
    flight while busy), stall share; and whether the RAM tier was already full when the
    window began (else the window still includes filling)."""
    w = series[after:]
    if not w:
        return None
    S = lambda k: sum(t[k] for t in w)  # noqa: E731
    secs = S("s")
    return {"after": after, "tokens": len(w), "tok_s": len(w) / secs, "hit_rate": S("hits") / max(S("requests"), 1),
            "cache_hit_rate": S("hits_cached") / max(S("requests"), 1),
            "disk_bytes_per_token": S("disk_bytes") / len(w), "expert_reads_per_token": S("reads") / len(w),
            "disk_GB_s": S("disk_bytes") / secs / 1e9, "stall_share": S("stall_s") / secs,
            "expert_wait_hidden_fraction": S("read_hidden_s") / max(S("read_hidden_s") + S("read_stalled_s"), 1e-12),
            "disk_busy_share": S("disk_busy_s") / secs,
            "queue_depth": S("queue_depth_s") / max(S("disk_busy_s"), 1e-12),
            # each pread's own rate (bytes over its time); the reads' rate is about this x depth x busy share
            "pread_MB_s": S("pread_bytes") / max(S("pread_s"), 1e-12) / 1e6,
            "full_from": next((i for i, t in enumerate(series) if t["full_at_start"]), None)}


def measure(store, fn, tokens) -> dict:
    """Run fn() with the store's stats reset; the phase's figures."""
    store.reset_stats()
    io = proc_io()["read_bytes"]
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    st = store.stats()
    read = proc_io()["read_bytes"] - io
    return {
        "tokens": tokens, "seconds": dt, "tok_s": tokens / dt, "rss_after": proc_status()["VmRSS"],
        "host_used_bytes": st["tiers"]["host"]["used_bytes"],
        "disk_bytes_per_token": read / tokens, "disk_GB_s": read / dt / 1e9,
        "expert_bytes_per_token": st["tiers"]["disk"]["bytes_read"] / tokens,
        "expert_reads_per_token": st["tiers"]["disk"]["reads"] / tokens,
        "hit_rate": st["expert_hit_rate"], "stall_s": st["stall_s"], "stall_share": st["stall_s"] / dt,
        "read_stalled_s": st["read_stalled_s"], "read_hidden_s": st["read_hidden_s"],
        "expert_wait_hidden_fraction": st["expert_wait_hidden_fraction"],
        "requests": st["requests"], "demand_misses": st["demand_misses"], "transient_loads": st["transient_loads"],
        "prefetch_issued": st["prefetch_issued"], "prefetch_used": st["prefetch_used"],
        "prefetch_late": st["prefetch_late"], "prefetch_wasted": st["prefetch_wasted"],
        "prefetch_dropped": st["prefetch_dropped"], "prefetch_cancelled": st["prefetch_cancelled"],
        "prefetch_no_room": st["prefetch_no_room"], "prefetch_reads": st["prefetch_reads"],
        "prefetch_reads_used": st["prefetch_reads_used"],
        "prefetch_precision": st["prefetch_precision"], "prefetch_read_precision": st["prefetch_read_precision"],
        "prefetch_recall": st["prefetch_recall"],
        "disk_tier": st["tiers"]["disk"],
    }


# -- the routing-trace replay ---------------------------------------------------------------------

def map_trace(ids, layers: int, experts: int, top_k: int):
    """A trace's expert ids [N, Ld, Kd] (Ed experts) -> [N, layers, top_k] ids of `experts`.

    Layer l takes the trace's layer a = l % Ld and a partner b (a + 1 + l // Ld, mod Ld, never
    a): expert ids are g * Ed + e for e in a's experts (its route) and g = f % (experts // Ed)
    for f in b's, pairs taken in rank order (i + j, then i) until top_k are distinct. So a
    layer's choices keep the trace's skew and its reuse from token to token (both layers'),
    spread over all `experts` instead of the first Ed."""
    import numpy as np

    ids = np.asarray(ids, dtype=np.int64)
    N, Ld, Kd = ids.shape
    Ed = int(ids.max()) + 1
    G = max(experts // Ed, 1)
    pairs = sorted(((i, j) for i in range(Kd) for j in range(Kd)), key=lambda p: (p[0] + p[1], p[0]))
    out = np.zeros((N, layers, top_k), dtype=np.int64)
    for l in range(layers):
        a = l % Ld
        b = (a + 1 + l // Ld) % Ld
        if b == a:
            b = (a + 1) % Ld
        for n in range(N):
            e, f = ids[n, a], ids[n, b]
            got: list[int] = []
            for i, j in pairs:
                x = int((f[j] % G) * Ed + e[i]) % experts
                if x not in got:
                    got.append(x)
                    if len(got) == top_k:
                        break
            t = 1
            while len(got) < top_k:  # b's experts fell into too few groups: the next groups
                for i in range(Kd):
                    x = int(((f[0] + t) % G) * Ed + e[i]) % experts
                    if x not in got and len(got) < top_k:
                        got.append(x)
                t += 1
            out[n, l] = got
    return out


def replay_child(a) -> dict:
    """A REPLAY of a routing trace through the store (no model runs): per token, per layer,
    get the mapped experts, hold them for `--replay-compute-ms` (a sleep standing in for the
    layer's compute), release them."""
    from moerun.experts.attach import load as load_store
    from moerun.experts.profile import Trace
    from moerun.experts.store import StoreOptions

    opts = StoreOptions(ram_budget=a.ram_budget, cache_policy=a.cache_policy, disk_workers=a.disk_workers,
                        io_threads=a.io_threads or None, spec_inflight=a.spec_inflight)
    llm = load_store(a.model, threads=a.threads, options=opts)
    store = llm.store
    tr = Trace.load(a.routing_trace)
    K = getattr(llm.net.args, "num_experts_per_tok", 8)
    layers = store.layers
    E = store.num_experts[layers[0]]
    warm, n = a.replay_warmup, a.replay_tokens
    if tr.num_tokens < warm + n:
        raise SystemExit(f"bigger_than_ram: error: the trace has {tr.num_tokens} tokens, the replay needs {warm + n}")
    ids = map_trace(tr.ids[: warm + n], len(layers), E, K)
    sleep = a.replay_compute_ms / 1e3

    def run(rows):
        for row in rows:
            for li, layer in enumerate(layers):
                got = [int(x) for x in row[li]]
                store.get(layer, got)
                if sleep:
                    time.sleep(sleep)
                store.release(layer, got)

    out = {"row": a.row, "ram_budget": a.ram_budget, "replay": True, "trace": str(a.routing_trace),
           "trace_tokens": int(tr.num_tokens), "trace_shape": [int(x) for x in tr.ids.shape],
           "compute_ms_per_layer": a.replay_compute_ms, "warmup_tokens": warm,
           "non_expert_bytes": store.non_expert_bytes, "budget_bytes": store.tiers["host"].budget}
    out["warmup"] = measure(store, lambda: run(ids[:warm]), warm)
    out["decode"] = measure(store, lambda: run(ids[warm:]), n)
    used = len({(l, int(e)) for row in ids for l in range(len(layers)) for e in row[l]})
    out["distinct_experts"] = used
    out["peak_rss"] = proc_status()["VmHWM"]
    store.close()
    return out


# -- llama-bench --------------------------------------------------------------------------------

def llama_bench(a, p: int, n: int, extra: list[str]) -> dict:
    sys.path.insert(0, str(HERE))
    from llamacpp import tool

    cmd = [str(tool("llama-bench")), "-m", str(a.model), "-p", str(p), "-n", str(n), "-r", "1",
           "-t", str(a.threads), "-o", "json", *extra]
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # its loading log (a pipe left unread could fill and stall it)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    peak, peak_anon, peak_file, io_last, killed, min_avail = 0, 0, 0, {}, None, mem_available()
    # a mapping's file pages (RssFile) are page cache the kernel takes back under pressure; what
    # cannot be taken back is the process's private memory (RssAnon): the limit applies to that,
    # and the run is also stopped if the machine's MemAvailable falls under `--llama-min-available`
    while proc.poll() is None:
        st = proc_status(proc.pid)
        peak = max(peak, st.get("VmRSS", 0))
        peak_anon, peak_file = max(peak_anon, st.get("RssAnon", 0)), max(peak_file, st.get("RssFile", 0))
        avail = mem_available()
        min_avail = min(min_avail, avail)
        io_last = proc_io(proc.pid) or io_last
        if st.get("RssAnon", 0) > a.rss_limit:
            killed = (f"private memory (RssAnon) {st['RssAnon'] / GiB:.2f} GiB passed the limit of "
                      f"{a.rss_limit / GiB:.2f} GiB (RSS {st.get('VmRSS', 0) / GiB:.2f} GiB)")
        elif avail < a.llama_min_available:
            killed = f"the machine's MemAvailable fell to {avail / GiB:.2f} GiB"
        elif time.perf_counter() - t0 > a.timeout:
            killed = f"no result in {a.timeout} s"
        if killed:
            proc.kill()
            proc.wait()
            break
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    res = {"cmd": " ".join(cmd), "test": (f"pp{p}" if p else f"tg{n}") + (f" {' '.join(extra)}" if extra else ""),
           "wall_s": wall, "peak_rss": peak, "peak_rss_anon": peak_anon, "peak_rss_file": peak_file,
           "min_mem_available": min_avail, "read_bytes": io_last.get("read_bytes", 0)}
    stdout, _ = proc.communicate()
    log.seek(0)
    stderr = log.read()
    log.close()
    res["stderr_tail"] = stderr.strip().splitlines()[-6:]
    if killed:
        res["error"] = f"killed: {killed} (after {wall:.0f} s)"
        return res
    try:
        rows = json.loads(stdout)
        res["tok_s"] = rows[0]["avg_ts"]
        res["test"] = (f"pp{p}" if p else f"tg{n}") + (f" {' '.join(extra)}" if extra else "")
    except (ValueError, IndexError, KeyError):
        res["error"] = f"llama-bench failed (exit {proc.returncode}): {stderr.strip().splitlines()[-1:] or ''}"
    tokens = p or n
    if res["read_bytes"]:
        res["disk_bytes_per_token_incl_load"] = res["read_bytes"] / tokens
    return res


# -- the disk alone ------------------------------------------------------------------------------

def disk_probe(path: Path, size: int = 1_118_208, reads: int = 96, threads=(1, 3, 9)) -> dict:
    """O_DIRECT reads of the disk with nothing else: 1 MiB sequential (as `dd bs=1M
    iflag=direct`), and `reads` random expert-sized ranges (a Q8_0 expert projection, 4 KiB
    aligned) with 1, 3 and 9 in flight. GB/s each."""
    import mmap
    import random
    from concurrent.futures import ThreadPoolExecutor

    fsize = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    out = {}
    try:
        def buf(n):
            return mmap.mmap(-1, n)  # page aligned
        b = buf(1 << 20)
        start = fsize // 2 // 4096 * 4096
        t = time.perf_counter()
        for i in range(512):
            os.preadv(fd, [b], start + i * (1 << 20))
        out["seq_1MiB_GB_s"] = 512 * (1 << 20) / (time.perf_counter() - t) / 1e9
        rng = random.Random(0)
        for n in threads:
            offs = [rng.randrange(0, (fsize - size) // 4096) * 4096 for _ in range(reads)]
            bufs = [buf(size) for _ in range(n)]

            def one(i):
                os.preadv(fd, [bufs[i % n]], offs[i])
            t = time.perf_counter()
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(one, range(reads)))
            out[f"random_{size}_x{n}_GB_s"] = reads * size / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)
    return out


# -- the parent ------------------------------------------------------------------------------------

def run_child(a, row: str, budget: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--row", row, "-m", str(a.model), "--ram-budget", budget,
           "--threads", str(a.threads), "--prompt-tokens", str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens),
           "--rss-limit", str(a.rss_limit), "--cache-policy", a.cache_policy,
           "--replay-compute-ms", str(a.replay_compute_ms), "--replay-tokens", str(a.replay_tokens),
           "--replay-warmup", str(a.replay_warmup), "--disk-workers", str(a.disk_workers),
           "--io-threads", str(a.io_threads), "--steady-after", str(a.steady_after),
           "--spec-inflight", str(a.spec_inflight)]
    if a.routing_trace:
        cmd += ["--routing-trace", str(a.routing_trace)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"row": row, "ram_budget": budget, "error": f"no result in {a.timeout} s (killed)"}
    last = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if not last:
        return {"row": row, "ram_budget": budget, "error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:] or ''}"}
    return {"row": row, **json.loads(last[-1])}


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"| moerun {r['row']}, {r.get('ram_budget')} | {r['error']} |"
    d = r["decode"]
    pf = r.get("prefill")
    name = f"REPLAY of {Path(r['trace']).name} (no model; {r['compute_ms_per_layer']} ms sleep a layer)" \
        if r.get("replay") else f"moerun {r['row']}"
    pre = "(replay)" if pf is None else f"{pf['tok_s']:.2f}"
    pfx = (f"{d['prefetch_read_precision']:.2f} / {d['prefetch_recall']:.2f}" if d["prefetch_reads"] else "-")
    return (f"| {name}, {r['ram_budget']} | {pre} | {d['tok_s']:.2f} | {r['peak_rss'] / GiB:.2f} | "
            f"{d['disk_bytes_per_token'] / 1e6:.0f} | {d['disk_GB_s']:.2f} | {d['hit_rate']:.2f} | "
            f"{d['stall_share']:.0%} | {d['expert_wait_hidden_fraction']:.0%} | {pfx} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, type=Path, help="GGUF file")
    ap.add_argument("--ram-budget", default="12GiB")
    ap.add_argument("--rows", default="direct,direct+layer_ahead1,buffered", help="moerun rows, comma-separated ('' for none)")
    ap.add_argument("--llama", action="store_true", help="also llama-bench on the same file (mmap)")
    ap.add_argument("--llama-runs", default="tg:,tg:--repack 0,pp:--repack 0",
                    help="llama-bench runs, comma-separated: tg (decode) or pp (prefill), ':', its extra flags")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    ap.add_argument("--rss-limit", type=float, default=14 * GiB,
                    help="bytes; a moerun run past this RSS is killed, a llama-bench run past this private memory (RssAnon)")
    ap.add_argument("--llama-min-available", type=float, default=2 * GiB,
                    help="bytes; a llama-bench run is killed if the machine's MemAvailable falls under it")
    ap.add_argument("--cache-policy", default="lru")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--probe", action="store_true", help="first measure the disk alone (O_DIRECT, sequential and random)")
    ap.add_argument("--disk-workers", type=int, default=6, help="the store's disk workers (StoreOptions.disk_workers)")
    ap.add_argument("--io-threads", type=int, default=0, help="the store's pread threads (0: the store's default, "
                    "3 x (disk workers + 1))")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the rows (and the llama-bench runs) this many times, interleaved")
    ap.add_argument("--routing-trace", type=Path, default=None,
                    help="a routing trace (moerun profile .npz): add a REPLAY row driving the store with it")
    ap.add_argument("--replay-compute-ms", type=float, default=5.0, help="replay: sleep per layer standing in for compute")
    ap.add_argument("--replay-tokens", type=int, default=48, help="replay: tokens timed")
    ap.add_argument("--replay-warmup", type=int, default=32, help="replay: tokens replayed first, not timed")
    ap.add_argument("--spec-inflight", type=int, default=0,
                    help="prefetch reads kept in flight while a layer reads its demand misses (StoreOptions.spec_inflight)")
    ap.add_argument("--steady-after", type=int, default=8,
                    help="decode: also report the tokens after the first N (the RAM tier filling) apart")
    ap.add_argument("--lock", default=None, help="flock this file for each run (and the probe), released between "
                    "runs so other jobs on a shared machine run between them but never during one")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--row", default="direct", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.rss_limit = int(a.rss_limit)
    a.llama_min_available = int(a.llama_min_available)
    if not a.model.is_file():
        print(f"bigger_than_ram: error: {a.model} is not a file", file=sys.stderr)
        return 1
    if a.routing_trace is not None and not a.routing_trace.is_file():
        print(f"bigger_than_ram: error: routing trace {a.routing_trace} is not a file", file=sys.stderr)
        return 1
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return 0
    sys.path.insert(0, str(HERE))
    from vs_llamacpp import Lock, read_bandwidth

    lock = Lock(a.lock)
    budgets = [b for b in a.ram_budget.split(",") if b]
    size = a.model.stat().st_size
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with lock("read bandwidth"):
        bw = read_bandwidth(a.threads) / 1e9
    head = {"read_bandwidth_GB_s": bw, "model": str(a.model), "file_bytes": size, "ram_bytes": mem, "cpu": cpu_line(),
            "threads": a.threads,
            "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens, "disk_workers": a.disk_workers,
            "io_threads": a.io_threads or 3 * (a.disk_workers + 1), "rounds": a.rounds}
    print(f"# {a.model.name}: {size / 1e9:.1f} GB file, {mem / GiB:.1f} GiB RAM; {head['cpu']}; "
          f"torch.sum read bandwidth {head['read_bandwidth_GB_s']:.1f} GB/s; {a.threads} threads; "
          f"prompt {a.prompt_tokens}, decode {a.gen_tokens} tokens; store: {head['disk_workers']} disk workers, "
          f"{head['io_threads']} pread threads", flush=True)
    if a.probe:
        with lock("the disk probe"):
            drop_page_cache(a.model)
            head["disk"] = disk_probe(a.model)
        print("# disk alone (O_DIRECT): " + ", ".join(f"{k} {v:.2f}" for k, v in head["disk"].items()), flush=True)
    results, llama = [], []
    rows = [r for r in a.rows.split(",") if r] + (["replay"] if a.routing_trace else [])
    for rnd in range(a.rounds):  # each round: every moerun row at every budget, then every llama-bench run
        for budget in budgets:
            for row in rows:
                with lock(f"moerun {row} {budget}"):
                    how = drop_page_cache(a.model)
                    r = run_child(a, row, budget)
                r["page_cache"], r["round"] = how, rnd + 1
                results.append(r)
                print(f"page cache: {how}", flush=True)
                print(json.dumps(r), flush=True)
        for spec in (a.llama_runs.split(",") if a.llama else []):
            kind, _, extra = spec.partition(":")
            p, n = (0, a.gen_tokens) if kind == "tg" else (a.prompt_tokens, 0)
            with lock(f"llama-bench {spec}"):
                how = drop_page_cache(a.model)
                r = llama_bench(a, p, n, extra.split())
            r["page_cache"], r["round"] = how, rnd + 1
            llama.append(r)
            print(f"page cache: {how}", flush=True)
            print(json.dumps(r), flush=True)
    print("\n| engine, row | prefill tok/s | decode tok/s | peak RSS GiB | disk MB/token (decode) | disk GB/s (decode) "
          "| hit rate | stall share | expert wait hidden | prefetch read precision / recall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(fmt_row(r))
    ok = [r for r in results if "error" not in r and r["decode"].get("steady")]
    if ok:
        print(f"\nSteady state: the decoded tokens after the first {a.steady_after} (per-token series in --json)")
        print("\n| engine, row (round) | budget GiB (share of the experts) | RAM tier full from token "
              "| decode tok/s, steady / whole | hit rate, steady / whole | of it, cached (no prefetch) | disk MB/token | disk GB/s | disk busy | preads in flight (busy) "
              "| MB/s per pread | stall share | expert wait hidden |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in ok:
            st, d = r["decode"]["steady"], r["decode"]
            print(f"| moerun {r['row']}, {r['ram_budget']} ({r['round']}) | {r['budget_bytes'] / GiB:.2f} "
                  f"({r['budget_bytes'] / r['experts_bytes']:.2f}) | "
                  f"{st['full_from'] if st['full_from'] is not None else 'never'} | {st['tok_s']:.2f} / {d['tok_s']:.2f} | "
                  f"{st['hit_rate']:.2f} / {d['hit_rate']:.2f} | {st['cache_hit_rate']:.2f} | "
                  f"{st['disk_bytes_per_token'] / 1e6:.0f} | "
                  f"{st['disk_GB_s']:.2f} | {st['disk_busy_share']:.0%} | {st['queue_depth']:.1f} | "
                  f"{st['pread_MB_s']:.0f} | {st['stall_share']:.0%} | {st['expert_wait_hidden_fraction']:.0%} |")
    l0 = [r for r in results if "error" not in r and r.get("decode", {}).get("layer0")]
    if l0:
        print("\n| row | decode passes | layer 0 from this token's choice: precision / recall "
              "| from the MTP draft: precision / recall | draft token accuracy | MTP draft ms/token |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in l0:
            c = r["decode"]["layer0"]

            def pr(src):
                return "-" if c[f"{src}_precision"] is None else f"{c[f'{src}_precision']:.2f} / {c[f'{src}_recall']:.2f}"
            acc = "-" if c["draft_accuracy"] is None else f"{c['draft_accuracy']:.2f} ({c['drafts_scored']})"
            ms = "-" if c["draft_ms"] is None else f"{c['draft_ms']:.0f}"
            print(f"| {r['row']} | {c['passes']} | {pr('last')} | {pr('draft')} | {acc} | {ms} |")
    for r in llama:
        test = r.get("test", "")
        mem = (f"peak RSS {r['peak_rss'] / GiB:.2f} GiB (private {r['peak_rss_anon'] / GiB:.2f}, file pages "
               f"{r['peak_rss_file'] / GiB:.2f})")
        if "error" in r:
            print(f"| llama-bench {test} | {r['error']} ({mem}, {r['read_bytes'] / 1e9:.1f} GB read) |")
        else:
            tok = r["tok_s"]
            print(f"| llama-bench {test} | {f'{tok:.2f}' if test.startswith('pp') else ''} | "
                  f"{f'{tok:.2f}' if test.startswith('tg') else ''} | {mem} | "
                  f"{r['read_bytes'] / 1e6 / (a.prompt_tokens if test.startswith('pp') else a.gen_tokens):.0f} (with load) "
                  f"| {r['read_bytes'] / r['wall_s'] / 1e9:.2f} (with load) | | | |")
    if a.json:
        a.json.write_text(json.dumps({**head, "moerun": results, "llama": llama}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
