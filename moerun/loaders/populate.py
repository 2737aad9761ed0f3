"""Fault in, at load, the pages of the model files that a loaded net reads through memory maps.

The loaders map GGUF and safetensors files and keep the weights they run in the file's own
bytes as views of the map (raw K-quant rows, float weights in their dtype). Untouched, those
pages are faulted in by the first prompt, a few at a time, inside the kernels: on a cold page
cache that prompt reads the file by page faults, and even on a warm one it takes one minor
fault per fault-around window of every page it touches. llama.cpp maps with MAP_POPULATE (and
MADV_WILLNEED) at load for the same reason. `populate(net)` does it after the load, for the
bytes the net holds as file views only (a repacked or converted tensor's pages are not read
again), with `madvise(MADV_POPULATE_READ)` (Linux 5.14+; elsewhere a read of one byte a
page), in chunks behind a progress bar.

Opt-in (`moerun.load(populate=True)`, `--populate`): measured on the Qwen3.6 Q4_K_M file
(3 GiB, Zen 4, 2026-12-03, benchmarks/first_prompt.py) it cost 0.2 s of load on a warm page
cache and ~3.3 s on a cold one, and the first 512-token prompt was no faster either way (on a
cold cache the first prompt is slow with or without it: what it waits for is not the weights'
pages). docs/benchmarks.md has the figures.

It is not for a model bigger than RAM: it does nothing when the views' bytes exceed what the
kernel says is available (MemAvailable, less a margin), and the expert store's load
(`--ram-budget`, moerun/experts) does not call it (its experts are read by `pread`, not
through the map).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
import time

import torch

log = logging.getLogger("moerun")

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # linux/mman.h (5.14); Python 3.11's mmap module does not name it
CHUNK = 64 << 20
MARGIN = 1 << 30  # left available after populating
PROGRESS_BYTES = 256 << 20


def file_mappings(path: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of regular files (not anonymous memory, the
    heap, stacks or [vdso]); [] where /proc is not there."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or not parts[5].startswith("/") or parts[5].rstrip().endswith("(deleted)"):
                    continue
                if parts[4] == "0":  # inode 0: not a file
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    except OSError:
        return []
    return sorted(out)


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    if t is None or t.is_meta or t.device.type != "cpu" or t.numel() == 0:
        return None
    if t.is_contiguous():
        start = t.data_ptr()
        return start, start + t.numel() * t.element_size()
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def file_ranges(net: torch.nn.Module, mappings: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """Page-aligned, merged address ranges of the net's parameters and buffers that lie in a
    mapped file. Embedding tables are left out (a token reads one row of them; a tied head
    shares the table's storage and is counted under the head)."""
    from torch import nn

    maps = file_mappings() if mappings is None else mappings
    if not maps:
        return []
    skip = set()
    for m in net.modules():
        if isinstance(m, nn.Embedding) or type(m).__name__ == "GgmlEmbedding":
            skip.add(id(m))
    spans = []
    for m in net.modules():
        tensors = [*m._parameters.values(), *m._buffers.values()]
        if id(m) in skip:
            continue
        for t in tensors:
            e = _extent(t)
            if e is None:
                continue
            for lo, hi in maps:
                if lo <= e[0] < hi:
                    spans.append((e[0] // PAGE * PAGE, min(-(-e[1] // PAGE) * PAGE, hi)))
                    break
    spans.sort()
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_libc = None


def _madvise(addr: int, length: int, advice: int) -> int:
    """0, or the errno of madvise(2)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return 0 if _libc.madvise(addr, length, advice) == 0 else ctypes.get_errno()


def _touch(addr: int, length: int) -> None:
    """Read one byte of every page of [addr, addr + length) (the fallback to POPULATE_READ)."""
    buf = (ctypes.c_uint8 * length).from_address(addr)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    int(t[::PAGE].sum())


def populate(net: torch.nn.Module, progress: bool = True) -> dict:
    """Fault in the mapped file pages the net reads. Returns what it did: {"bytes", "seconds",
    "how"} with how "madvise", "touch" or why it did nothing ("no file views", "bigger than
    available memory", "not Linux")."""
    if not sys.platform.startswith("linux"):
        return {"bytes": 0, "seconds": 0.0, "how": "not Linux"}
    ranges = file_ranges(net)
    total = sum(b - a for a, b in ranges)
    if total == 0:
        return {"bytes": 0, "seconds": 0.0, "how": "no file views"}
    avail = mem_available()
    if avail is not None and total > avail - MARGIN:
        log.info("not populating %.1f GiB of weight pages: %.1f GiB available", total / 2**30, avail / 2**30)
        return {"bytes": 0, "seconds": 0.0, "how": "bigger than available memory"}
    from tqdm import tqdm

    how = "madvise"
    t0 = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc="paging in", file=sys.stderr,
              disable=not progress or total < PROGRESS_BYTES, leave=False) as bar:
        for a, b in ranges:
            for s in range(a, b, CHUNK):
                n = min(CHUNK, b - s)
                if how == "madvise":
                    err = _madvise(s, n, MADV_POPULATE_READ)
                    if err:  # EINVAL: a kernel before 5.14
                        how = "touch"
                        _madvise(s, n, mmap.MADV_WILLNEED)
                if how == "touch":
                    _touch(s, n)
                bar.update(n)
    return {"bytes": total, "seconds": time.perf_counter() - t0, "how": how}
