"""The read layout of a GGUF file's routed experts, measured (issue 37, item 2).

An expert's gate, up and down rows are three byte ranges of three stacked tensors
(`blk.L.ffn_{gate,up,down}_exps.weight`). This reads the same kind of experts, page cache
bypassed (O_DIRECT, 4 KiB-widened ranges into aligned buffers), as:

  three_serial   three preads one after another per expert
  three_pool     the three preads of an expert on a pool of threads at once, waited for
                 together (the store's DirectReader today)
  three_uring    the three ranges in one io_uring submission (the `liburing` binding; the row
                 is skipped when it is not installed: `pip install liburing`)
  three_pool_sub three_pool on the experts of the cache file's layers (cache_one's experts)
  cache_one      one contiguous pread per expert from an expert-major cache file, built here
                 for a subset of layers (each expert's gate|up|down bytes, padded to 4 KiB)
  src_contig     control for cache_one: one read of an expert's size at a random aligned
                 offset of the source file (tells whether the fresh cache file is served from
                 a cache below the page cache, e.g. the host's)

The three_* methods draw experts from every layer of the file (a decode's working set);
three_pool_sub and cache_one from the cache file's layers only.

each with W experts in flight (`--inflight`: W reader threads; io_uring: W experts' ranges in
flight on one ring). Each (method, W) run reads `--experts` experts drawn at random (a fresh
draw each run, so no run reads what another just read), rounds interleaved. The cache file is
built under `--cache-dir`, checked against the source bytes, and deleted at the end unless
`--keep-cache`; its size and build time are extrapolated to all layers.

    python benchmarks/read_layout.py -m /var/tmp/moerun-big/qwen36-35b-a3b-q8_0.gguf \\
        --layers 0,1 --experts 96 --inflight 1,2,6 --rounds 3 --cache-dir /var/tmp/big
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ALIGN = 4096
HERE = Path(__file__).resolve().parent


def aligned_buffer(n: int) -> mmap.mmap:
    return mmap.mmap(-1, -(-n // ALIGN) * ALIGN)  # page aligned


def aligned_bytearray(n: int) -> bytearray:
    """A bytearray whose data starts on a 4 KiB boundary (the `liburing` binding takes
    bytearrays only; O_DIRECT needs aligned memory): its front is trimmed, which CPython does
    in place by moving the start of the buffer."""
    ba = bytearray(n + ALIGN)
    view = (ctypes.c_char * len(ba)).from_buffer(ba)
    pad = (-ctypes.addressof(view)) % ALIGN
    del view
    del ba[:pad]
    del ba[n:]
    view = (ctypes.c_char * len(ba)).from_buffer(ba)
    ok = ctypes.addressof(view) % ALIGN == 0
    del view
    if not ok:
        raise RuntimeError("could not align a bytearray (this Python moves bytearrays on resize)")
    return ba


def span(offset: int, nbytes: int) -> tuple[int, int]:
    start = offset // ALIGN * ALIGN
    return start, -(-(offset + nbytes) // ALIGN) * ALIGN - start


def pread_full(fd: int, buf, start: int, length: int, need: int | None = None) -> None:
    """Read [start, start + length) into buf; a read may end short at the end of the file, past
    the `need` bytes the caller wants (default: all of them)."""
    mv = memoryview(buf)[:length]
    need = length if need is None else need
    got = 0
    while got < length:
        n = os.preadv(fd, [mv[got:]], start + got)
        if n <= 0 or got + n < length and (got + n) % ALIGN:  # the end of the file
            got += max(n, 0)
            break
        got += n
    if got < need:
        raise OSError(f"short read at {start + got}")


def read_range(fd: int, buf, offset: int, nbytes: int) -> None:
    """The 4 KiB-widened span of [offset, offset + nbytes) into buf."""
    start, length = span(offset, nbytes)
    pread_full(fd, buf, start, length, offset + nbytes - start)


def expert_ranges(path: Path, layers: list[int] | None, limit: int = 0):
    """{(layer, expert): [(offset, nbytes)] * 3} (gate, up, down) of `layers` (None: all), the
    per-expert bytes, experts per layer, and the file's MoE layers."""
    sys.path.insert(0, str(HERE.parent))
    from moerun.loaders.gguf import GGUFFile

    f = GGUFFile(path)
    out, all_layers = {}, set()
    for name in f.tensors:
        if name.startswith("blk.") and name.endswith("ffn_gate_exps.weight"):
            all_layers.add(int(name.split(".")[1]))
    for l in (sorted(all_layers) if layers is None else layers):
        ts = [f.tensors[f"blk.{l}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")]
        E = ts[0].shape[0]
        for e in range(min(E, limit) if limit else E):
            out[(l, e)] = [(t.offset + e * (t.nbytes // E), t.nbytes // E) for t in ts]
    per = sum(n for _, n in next(iter(out.values())))
    return out, per, E, sorted(all_layers)


def build_cache(src: Path, ranges: dict, per: int, out: Path) -> dict:
    """The expert-major cache file of `ranges`' experts: record i = expert keys[i]'s gate|up|down
    bytes, padded to 4 KiB. Written beside `out` and renamed when complete (a failure, a full
    disk, leaves no partial file); pages dropped as written."""
    rec = -(-per // ALIGN) * ALIGN
    keys = sorted(ranges)
    free = shutil.disk_usage(out.parent).free
    if free < len(keys) * rec + (1 << 30):
        raise SystemExit(f"read_layout: error: the cache file needs {len(keys) * rec / 1e9:.2f} GB and 1 GB spare; "
                         f"{out.parent} has {free / 1e9:.2f} GB free")
    tmp = out.with_name(out.name + ".partial")
    fd_src = os.open(src, os.O_RDONLY | os.O_DIRECT)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    longest = max(span(o, n)[1] for rs in ranges.values() for o, n in rs)
    bufs = [aligned_buffer(longest) for _ in range(3)]
    rec_buf = aligned_buffer(rec)
    t0 = time.perf_counter()
    try:
        for i, k in enumerate(keys):
            pos = 0
            for (o, n), b in zip(ranges[k], bufs):
                start, _ = span(o, n)
                read_range(fd_src, b, o, n)
                rec_buf[pos:pos + n] = b[o - start:o - start + n]
                pos += n
            rec_buf[pos:rec] = bytes(rec - pos)
            if os.pwritev(fd, [rec_buf], i * rec) != rec:
                raise OSError("short write")
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, out)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd_src)
    secs = time.perf_counter() - t0
    return {"experts": len(keys), "record_bytes": rec, "bytes": len(keys) * rec, "seconds": secs,
            "GB_s": len(keys) * rec / secs / 1e9, "index": {k: i for i, k in enumerate(keys)}}


def check_cache(src: Path, cache: Path, ranges: dict, index: dict, rec: int, n: int = 8) -> None:
    """Some records of the cache file against the source bytes (buffered reads, then dropped)."""
    rng = random.Random(1)
    with open(src, "rb") as fs, open(cache, "rb") as fc:
        for k in rng.sample(sorted(index), n):
            want = b"".join(os.pread(fs.fileno(), nb, o) for o, nb in ranges[k])
            got = os.pread(fc.fileno(), len(want), index[k] * rec)
            if got != want:
                raise SystemExit(f"read_layout: error: cache record {k} differs from the source")
        for f in (fs, fc):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


# -- the methods: each reads `jobs` with W in flight; returns seconds -------------------------------

def run_threads(W: int, jobs: list, one) -> float:
    it = iter(jobs)
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                return
            one(j)
    ts = [threading.Thread(target=worker) for _ in range(W)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def three_serial(fd, jobs, W, maxlen):
    """jobs: each expert's ranges, read one after another into the reader's own buffer."""
    local = threading.local()

    def one(rs):
        if not hasattr(local, "b"):
            local.b = aligned_buffer(maxlen)
        for o, n in rs:
            read_range(fd, local.b, o, n)
    return run_threads(W, jobs, one)


def three_pool(fd, jobs, W, maxlen):
    pool = ThreadPoolExecutor(3 * (W + 1))  # the store's default pread pool for W readers
    free = [aligned_buffer(maxlen) for _ in range(3 * W)]
    lock = threading.Lock()

    def one(rs):
        with lock:
            bs = [free.pop() for _ in rs]
        futs = [pool.submit(read_range, fd, b, o, n) for b, (o, n) in zip(bs, rs)]
        for f in futs:
            f.result()
        with lock:
            free.extend(bs)
    try:
        return run_threads(W, jobs, one)
    finally:
        pool.shutdown()


def three_uring(fd, jobs, W, maxlen):
    import liburing as L

    ring, cqe = L.Ring(), L.Cqe()
    L.io_uring_queue_init(max(8, 4 * W), ring)
    bufs = [[{} for _ in range(3)] for _ in range(W)]  # slot, range -> length -> buffer (it sets the read's size)
    free = list(range(W))
    left = {}  # slot -> reads outstanding
    nxt = 0
    t0 = time.perf_counter()
    try:
        while nxt < len(jobs) or left:
            while free and nxt < len(jobs):  # one submission per expert: its three ranges
                slot = free.pop()
                for r, ((o, n), b) in enumerate(zip(jobs[nxt], bufs[slot])):
                    start, length = span(o, n)
                    sqe = L.io_uring_get_sqe(ring)
                    if length not in b:
                        b[length] = aligned_bytearray(length)
                    L.io_uring_prep_read(sqe, fd, b[length], start)
                    sqe.user_data = slot * 4 + r
                left[slot] = 3
                L.io_uring_submit(ring)
                nxt += 1
            L.io_uring_wait_cqe(ring, cqe)
            c = cqe[0]
            ud, res = c.user_data, c.res
            L.io_uring_cqe_seen(ring, c)
            if res is None or res < 0:
                raise OSError(f"io_uring read failed: {res}")
            slot = ud // 4
            left[slot] -= 1
            if not left[slot]:
                del left[slot]
                free.append(slot)
    finally:
        L.io_uring_queue_exit(ring)
    return time.perf_counter() - t0


def one_read(fd, jobs, W, maxlen):
    """jobs: (offset, nbytes) single ranges, read in one pread each (`three_serial`'s readers)."""
    return three_serial(fd, [[r] for r in jobs], W, maxlen)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, type=Path, help="GGUF file")
    ap.add_argument("--layers", default="0,1", help="layers in the cache file (comma-separated)")
    ap.add_argument("--experts", type=int, default=96, help="experts read per run")
    ap.add_argument("--inflight", default="1,2,6", help="experts in flight (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default="three_serial,three_pool,three_uring,three_pool_sub,cache_one,src_contig")
    ap.add_argument("--cache-experts", type=int, default=0, help="only the first N experts of each layer (0: all)")
    ap.add_argument("--cache-dir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--keep-cache", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if not a.model.is_file():
        print(f"read_layout: error: {a.model} is not a file", file=sys.stderr)
        return 1
    if not a.cache_dir.is_dir():
        print(f"read_layout: error: --cache-dir {a.cache_dir} is not a directory", file=sys.stderr)
        return 1
    try:
        layers = [int(x) for x in a.layers.split(",") if x]
        inflight = [int(x) for x in a.inflight.split(",") if x]
    except ValueError:
        print("read_layout: error: --layers and --inflight take comma-separated integers", file=sys.stderr)
        return 1
    methods = [m for m in a.methods.split(",") if m]
    known = ("three_serial", "three_pool", "three_uring", "three_pool_sub", "cache_one", "src_contig")
    if any(m not in known for m in methods):
        print(f"read_layout: error: --methods takes {', '.join(known)}", file=sys.stderr)
        return 1
    if "three_uring" in methods:
        try:
            import liburing  # noqa: F401
        except ImportError:
            print("# three_uring skipped: the liburing binding is not installed (pip install liburing)")
            methods.remove("three_uring")
    try:
        ranges, per, E, all_layers = expert_ranges(a.model, layers, a.cache_experts)
        every, _, _, _ = expert_ranges(a.model, None, a.cache_experts)
    except KeyError as e:
        print(f"read_layout: error: {a.model} has no expert tensor {e}", file=sys.stderr)
        return 1
    maxlen = max(span(o, n)[1] for rs in every.values() for o, n in rs)
    cache = a.cache_dir / f"{a.model.stem}.experts-L{'-'.join(map(str, layers))}.bin"
    print(f"# {a.model.name}: {len(all_layers)} layers x {E} experts, {per} bytes an expert "
          f"({', '.join(str(n) for _, n in next(iter(ranges.values())))}); cache file of layers {layers}: {cache}",
          flush=True)
    out = {"model": str(a.model), "expert_bytes": per, "layers": layers, "experts_per_layer": E,
           "model_layers": len(all_layers), "runs": []}
    try:
        info = build_cache(a.model, ranges, per, cache)
        index, rec = info.pop("index"), info["record_bytes"]
        check_cache(a.model, cache, ranges, index, rec)
        full = len(all_layers) * E * rec
        info.update(full_bytes=full, full_seconds_at_this_rate=full / (info["GB_s"] * 1e9))
        out["cache_build"] = info
        print(f"# cache file: {info['experts']} experts, {info['bytes'] / 1e9:.2f} GB in {info['seconds']:.1f} s "
              f"({info['GB_s']:.2f} GB/s, read + write); all {len(all_layers)} layers would take "
              f"{full / 1e9:.1f} GB and ~{info['full_seconds_at_this_rate'] / 60:.1f} min", flush=True)
        fd_src = os.open(a.model, os.O_RDONLY | os.O_DIRECT)
        fd_c = os.open(cache, os.O_RDONLY | os.O_DIRECT)
        lo = min(o for rs in every.values() for o, _ in rs)
        hi = a.model.stat().st_size - per - ALIGN
        rng = random.Random(0)
        keys, all_keys = sorted(ranges), sorted(every)
        for rnd in range(a.rounds):
            for W in inflight:
                order = methods if (rnd + W) % 2 == 0 else methods[::-1]
                for m in order:
                    pick = rng.sample(keys if m in ("cache_one", "three_pool_sub") else all_keys, a.experts)
                    if m == "cache_one":
                        secs = one_read(fd_c, [(index[k] * rec, per) for k in pick], W, rec)
                    elif m == "src_contig":
                        offs = [rng.randrange(lo // ALIGN, hi // ALIGN) * ALIGN for _ in pick]
                        secs = one_read(fd_src, [(o, per) for o in offs], W, rec)
                    else:
                        fn = {"three_serial": three_serial, "three_pool": three_pool, "three_uring": three_uring,
                              "three_pool_sub": three_pool}[m]
                        secs = fn(fd_src, [every[k] for k in pick], W, maxlen)
                    r = {"round": rnd + 1, "method": m, "inflight": W, "experts": a.experts, "seconds": secs,
                         "ms_per_expert": 1e3 * secs / a.experts, "GB_s": a.experts * per / secs / 1e9}
                    out["runs"].append(r)
                    print(json.dumps(r), flush=True)
        os.close(fd_src)
        os.close(fd_c)
    finally:
        if not a.keep_cache:
            cache.unlink(missing_ok=True)
    import statistics

    print("\n| method | " + " | ".join(f"{W} in flight: GB/s (ms an expert), median of {a.rounds}" for W in inflight) + " |")
    print("|---|" + "---:|" * len(inflight))
    for m in methods:
        cells = []
        for W in inflight:
            rs = [r for r in out["runs"] if r["method"] == m and r["inflight"] == W]
            g = statistics.median(r["GB_s"] for r in rs)
            cells.append(f"{g:.2f} ({statistics.median(r['ms_per_expert'] for r in rs):.1f}; "
                         f"{min(r['GB_s'] for r in rs):.2f}-{max(r['GB_s'] for r in rs):.2f})")
        print(f"| {m} | " + " | ".join(cells) + " |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
