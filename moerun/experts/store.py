"""The tiered expert store: every routed expert lives on the device, in RAM (host) or on disk.

Tiers and budgets. `disk` is the checkpoint itself: an expert is read lazily with `pread`
from the byte range the safetensors header names, and the range is dropped from the page
cache at once (`POSIX_FADV_DONTNEED`) so the page cache does not quietly hold the model.
`host` holds experts in fixed-size slots carved from a budget (`--ram-budget`); slots are
reused, never returned to malloc, so resident memory tracks the budget rather than
allocator fragmentation. `device` is a GPU behind a CUDA link, or the emulated device (a
throttled zero-copy link; see emulated.py), with its own budget (`--vram-budget`).
Experts that do not fit a tier stay in the slower one. The tier that runs experts (the
*compute tier*) is the device when there is one, else the host.

A request for an expert that is not resident in the compute tier is a demand miss: the
caller fetches it at once (stall, counted), and it goes before any queued prefetch. When a
tier has no evictable room even for the experts of one layer (everything in use or
pinned), a demand miss is served from a transient buffer freed after use: budgets hold for
the cache, and the transient bytes are counted (`transient_loads`).

Quantized experts. On a checkpoint written by `moerun quantize`, an expert is its packed
gate/up/down blocks and fp16 scales (six pieces, read straight from the shards), so the
budgets count packed bytes (int4: ~0.56 bytes per weight); `attach.QuantStoreExperts`
runs them with the native kernel.

Execution where it lives (`--execute`, placement.py). With a device tier, a device miss
either waits for the link and runs on the device (`device`, the default), runs on the CPU
from RAM without waiting (`cpu`), or goes where a cost model says it finishes first
(`auto`). A miss run on the CPU is also moved to the device in the background at the
lowest priority (dropped if not done by the next step), so the device's cache keeps
following use without anyone waiting for it. `get` says where each expert runs;
`release` takes the measured expert times back for the accounting and the cost model.

Threads. One condition variable guards all state; IO and link transfers run outside it.
Entry states per tier: NONE -> LOADING -> READY. A prefetch is a `Job` on a mover's queue;
a demand miss that finds its expert's job still queued cancels it and does the work
itself; one that finds it loading waits for it (a late prefetch).
"""

from __future__ import annotations

import errno
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MoerunError
from .emulated import CudaLink, EmulatedLink, parse_link
from .placement import CPU, DEVICE, MODES, CostModel, CpuSpeed, Miss
from .policy import make_policy
from .prefetch import Job, Mover
from ..kernels.formats import packed_shape
from ..loaders.safetensors import DTYPE_NAMES
from .profile import Trace

NONE, LOADING, READY = 0, 1, 2
PAGE = os.sysconf("SC_PAGE_SIZE")
HOST = "host"
PROJS = ("gate_proj", "up_proj", "down_proj")


# -- where an expert's bytes are -------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One projection of one expert: a contiguous byte range of a checkpoint file."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LayerExperts:
    """The routed experts of one layer: E experts of shape gate/up [I, H], down [H, I]; float,
    or packed in `fmt` (int4/int8 blocks, `moerun.kernels.formats`) as six pieces per expert."""

    layer: int
    num_experts: int
    hidden: int
    inter: int
    pieces: tuple  # [E] of (gate, up, down) Pieces, or with fmt: (gate_q, gate_scales, up_q, ..., down_scales)
    fmt: str | None = None
    down_fmt: str | None = None  # down's format where it differs from gate/up's (raw GGUF formats)
    # pieces are (gate, up, down) rows of GGUF Q8_0/Q4_0 blocks (an fp16 scale in front of each
    # block): read whole and repacked into the slot's int8/int4 (qweight, scales) layout
    ggml: bool = False


def _stacked_pieces(ref, num_experts: int, shape: tuple) -> list[Piece]:
    """Expert e's slice of a tensor stacked [E, *shape]."""
    if tuple(ref.shape) != (num_experts, *shape):
        raise MoerunError(f"tensor {ref.name!r} has shape {list(ref.shape)} but the config expects {[num_experts, *shape]}")
    size = ref.nbytes // num_experts
    return [Piece(f"{ref.name}[{e}]", ref.path, ref.offset + e * size, size, ref.dtype, shape) for e in range(num_experts)]


def quantized_shapes(hidden: int, inter: int, fmt: str, down_fmt: str | None = None) -> dict[str, tuple[tuple, torch.dtype]]:
    """Shape and dtype of one expert's packed tensors, by their names in a quantized checkpoint
    (raw GGUF formats: uint8 rows of their blocks and empty [rows, 0] scales)."""

    out = {}
    for proj, rows, cols, f in (("gate", inter, hidden, fmt), ("up", inter, hidden, fmt),
                                ("down", hidden, inter, down_fmt or fmt)):
        row, nb, qdtype = packed_shape(f, cols)
        out[f"{proj}_q"] = ((rows, row), qdtype)
        out[f"{proj}_scales"] = ((rows, nb), torch.float16)
    return out


def quantized_expert_pieces(names: dict, prefix: str, num_experts: int, hidden: int, inter: int, fmt: str,
                            down_fmt: str | None = None) -> tuple:
    """Per expert (gate_q, gate_scales, up_q, up_scales, down_q, down_scales) byte ranges of a
    checkpoint written by `moerun quantize` (stacked [E, rows, ...] under our module names)."""
    cols = []
    for key, (shape, dtype) in quantized_shapes(hidden, inter, fmt, down_fmt).items():
        ref = names.get(f"{prefix}.{key}")
        if ref is None:
            raise MoerunError(f"checkpoint is missing tensor {prefix + '.' + key!r} (the {fmt} experts of layer {prefix})")
        if ref.dtype != dtype:
            raise MoerunError(f"tensor {ref.name!r} has dtype {ref.dtype} but {fmt} experts store {dtype}")
        cols.append(_stacked_pieces(ref, num_experts, shape))
    return tuple(zip(*cols))


def expert_pieces(names: dict, prefix: str, num_experts: int, hidden: int, inter: int) -> tuple:
    """Per expert (gate, up, down) byte ranges, from per-expert, stacked or fused tensors.

    `names` maps our (renamed) parameter names to `TensorRef`s; `prefix` is the Experts
    module's name (`model.layers.3.mlp.experts`).
    """
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    out = [[None] * 3 for _ in range(num_experts)]
    for j, proj in enumerate(PROJS):
        shape = shapes[proj]
        per = [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts)]
        stacked = names.get(f"{prefix}.{proj}")
        fused = names.get(f"{prefix}.gate_up_proj")
        if all(n in names for n in per):
            for e, n in enumerate(per):
                ref = names[n]
                if tuple(ref.shape) != shape:
                    raise MoerunError(f"tensor {ref.name!r} has shape {list(ref.shape)} but the config expects {list(shape)}")
                out[e][j] = Piece(ref.name, ref.path, ref.offset, ref.nbytes, ref.dtype, shape)
        elif stacked is not None:
            for e, piece in enumerate(_stacked_pieces(stacked, num_experts, shape)):
                out[e][j] = piece
        elif fused is not None and proj != "down_proj":  # [E, 2I, H]: gate rows first, then up
            if tuple(fused.shape) != (num_experts, 2 * inter, hidden):
                raise MoerunError(
                    f"tensor {fused.name!r} has shape {list(fused.shape)}, expected {[num_experts, 2 * inter, hidden]}"
                )
            size = fused.nbytes // num_experts
            half = size // 2
            for e in range(num_experts):
                out[e][j] = Piece(f"{fused.name}[{e}].{proj}", fused.path, fused.offset + e * size + j * half, half,
                                  fused.dtype, shape)
        else:
            missing = next((n for n in per if n not in names), f"{prefix}.{proj}")
            raise MoerunError(f"checkpoint is missing tensor {missing!r} (an expert of layer {prefix})")
    bad = next((p for pieces in out for p in pieces if not p.dtype.is_floating_point), None)
    if bad is not None:  # the store casts float experts; integers are no weights of a float model

        raise MoerunError(f"tensor {bad.name!r} has dtype {DTYPE_NAMES[bad.dtype]}, but the experts of {prefix} "
                          "need a floating-point dtype")
    return tuple(tuple(p) for p in out)


class DiskReader:
    """pread into caller buffers, then drop the range from the page cache."""

    def __init__(self, drop_cache: bool = True, identity: dict | None = None):
        self.drop_cache = drop_cache
        self._ident: dict[Path, tuple[int, int]] = dict(identity or {})
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self.reads = 0
        self.bytes = 0

    def _fd(self, piece: Piece) -> int:
        with self._lock:
            fd = self._fds.get(piece.path)
            if fd is None:
                try:
                    fd = os.open(piece.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    raise MoerunError(f"cannot read expert tensor {piece.name!r}: {piece.path}: {e.strerror}") from None
                if self.drop_cache and hasattr(os, "posix_fadvise"):
                    # no readahead: it would fill the page cache with the neighbours of each read
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                st = os.fstat(fd)
                self._ident.setdefault(piece.path, (st.st_size, st.st_mtime_ns))
                self._fds[piece.path] = fd
            return fd

    def read_into(self, piece: Piece, out: torch.Tensor) -> None:
        """Fill `out` (uint8, piece.nbytes) with the piece's bytes."""
        fd = self._fd(piece)
        check_identity(piece.path, fd, self._ident[piece.path])
        mv = memoryview(out.numpy()).cast("B")
        got = 0
        while got < piece.nbytes:
            try:
                n = os.preadv(fd, [mv[got:]], piece.offset + got)
            except OSError as e:
                raise MoerunError(f"cannot read expert tensor {piece.name!r} from {piece.path}: {e.strerror}") from None
            if n == 0:
                raise MoerunError(
                    f"expert tensor {piece.name!r} is cut short in {piece.path}: the file ends at byte "
                    f"{piece.offset + got}, the tensor needs bytes up to {piece.offset + piece.nbytes} (truncated or corrupt)"
                )
            got += n
        if self.drop_cache and hasattr(os, "posix_fadvise"):
            # whole pages: the kernel keeps partial ones (mapped pages, e.g. non-expert weights
            # sharing a page, are never dropped by DONTNEED)
            start = piece.offset // PAGE * PAGE
            end = -(-(piece.offset + piece.nbytes) // PAGE) * PAGE
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.reads += 1
            self.bytes += piece.nbytes

    def drop_all(self, paths) -> None:
        """Drop whole files from the page cache (before a measurement)."""
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def check_identity(path: Path, fd: int, ident: tuple[int, int]) -> None:
    """Refuse a file whose size or modification time moved since the model was loaded."""
    st = os.fstat(fd)
    size, mtime = ident
    if (st.st_size, st.st_mtime_ns) != (size, mtime):
        raise MoerunError(
            f"{path} changed on disk while the model was loaded (size {size} -> {st.st_size} bytes or its "
            "modification time moved); refusing to read experts from it: load the model again")


ALIGN = 4096  # O_DIRECT: file offsets, lengths and buffers aligned to this (a page; >= the disk's block)


def _aligned(n: int) -> torch.Tensor:
    """A uint8 tensor of n bytes whose data starts on an ALIGN boundary."""
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    shift = -raw.data_ptr() % ALIGN
    return raw[shift : shift + n]


class DirectReader:
    """Expert reads that bypass the page cache: `O_DIRECT` preads of each piece's byte range
    widened to ALIGN boundaries, into aligned bounce buffers that are reused (a free list, grown
    to the reads in flight and never shrunk), on a small pool of pread threads. `read_pieces`
    submits all of an expert's ranges (gate, up, down) at once and waits for them, so one
    expert keeps several reads in flight; the caller copies or repacks each range out of its
    bounce buffer and gives the buffers back. A file that cannot be opened with O_DIRECT (a
    tmpfs) is read through the page cache and dropped from it after each read, as DiskReader
    does.

    Each file's size and modification time are taken when it is first opened (or given by the
    store, from when the model was loaded) and checked at every read: a file changed under a
    running model is refused in one line instead of serving bytes of another model."""

    def __init__(self, threads: int = 8, identity: dict | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="moerun-pread")
        self._fds: dict[Path, tuple[int, bool]] = {}
        self._ident: dict[Path, tuple[int, int]] = dict(identity or {})
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.reads = 0
        self.bytes = 0  # bytes the disk delivered (the aligned spans)
        self.read_s = 0.0  # summed over reads (they overlap each other)
        self.buffers = 0
        self.buffer_bytes = 0
        self.direct_files = 0
        # the disk's queue as this reader kept it: preads in flight now, the time at least one
        # was (busy_s), and the integral of their number over time (depth_s; depth_s / busy_s
        # is the mean queue depth while busy)
        self.inflight = 0
        self.busy_s = 0.0
        self.depth_s = 0.0
        self._t_depth = 0.0

    def _fd(self, path: Path) -> tuple[int, bool]:
        with self._lock:
            got = self._fds.get(path)
            if got is not None:
                return got
            flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
            direct = hasattr(os, "O_DIRECT")
            try:
                try:
                    fd = os.open(path, flags | (os.O_DIRECT if direct else 0))
                except OSError as e:
                    if not direct or e.errno != errno.EINVAL:
                        raise
                    direct = False  # a file system without O_DIRECT
                    fd = os.open(path, flags)
            except OSError as e:
                raise MoerunError(f"cannot read experts from {path}: {e.strerror}") from None
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            st = os.fstat(fd)
            self._ident.setdefault(path, (st.st_size, st.st_mtime_ns))
            self._fds[path] = (fd, direct)
            self.direct_files += direct
            return fd, direct

    def check(self, path: Path, fd: int) -> None:
        check_identity(path, fd, self._ident[path])

    def _take(self, n: int) -> torch.Tensor:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.numel() >= n:
                    return self._free.pop(i)
            self.buffers += 1
            self.buffer_bytes += n
        return _aligned(n)

    def give(self, bufs) -> None:
        with self._lock:
            self._free.extend(bufs)

    def _queue(self, delta: int) -> float:
        """Count a pread starting (+1) or ending (-1) in the queue figures; returns the time."""
        with self._lock:
            t = time.perf_counter()
            if self.inflight:
                dt = t - self._t_depth
                self.busy_s += dt
                self.depth_s += self.inflight * dt
            self._t_depth = t
            self.inflight += delta
        return t

    def _pread(self, fd: int, direct: bool, buf: torch.Tensor, start: int, length: int, piece: Piece) -> float:
        t0 = self._queue(1)
        try:
            self._pread_span(fd, direct, buf, start, length, piece)
        finally:
            t1 = self._queue(-1)
        return t1 - t0

    def _pread_span(self, fd: int, direct: bool, buf: torch.Tensor, start: int, length: int, piece: Piece) -> None:
        mv = memoryview(buf.numpy()).cast("B")[:length]
        got = 0
        need = piece.offset + piece.nbytes - start  # the span past the piece may run past the file's end
        while got < need:
            try:
                n = os.preadv(fd, [mv[got:]], start + got)
            except OSError as e:
                raise MoerunError(f"cannot read expert tensor {piece.name!r} from {piece.path}: {e.strerror}") from None
            if n == 0:
                raise MoerunError(
                    f"expert tensor {piece.name!r} is cut short in {piece.path}: the file ends at byte "
                    f"{start + got}, the tensor needs bytes up to {piece.offset + piece.nbytes} (truncated or corrupt)")
            got += n
            if direct and got % ALIGN:  # a direct read ends short only at the end of the file
                break
        if got < need:
            raise MoerunError(f"expert tensor {piece.name!r} is cut short in {piece.path} (truncated or corrupt)")
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)

    def read_pieces(self, pieces) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each piece's bytes (uint8 views into bounce buffers), read concurrently; returns
        (views, buffers): give the buffers back (`give`) once the views are consumed."""
        jobs, views, bufs = [], [], []
        try:
            for p in pieces:
                fd, direct = self._fd(p.path)
                self.check(p.path, fd)
                start = p.offset // ALIGN * ALIGN
                length = -(-(p.offset + p.nbytes) // ALIGN) * ALIGN - start
                buf = self._take(length)
                bufs.append(buf)
                views.append(buf[p.offset - start : p.offset - start + p.nbytes])
                jobs.append((fd, direct, buf, start, length, p))
            if len(jobs) == 1:
                secs = [self._pread(*jobs[0])]
            else:
                futs = [self._pool.submit(self._pread, *j) for j in jobs]
                secs = [f.result() for f in futs]  # the first failure raises (after all finished)
        except BaseException:
            self.give(bufs)
            raise
        with self._lock:
            self.reads += len(jobs)
            self.bytes += sum(j[4] for j in jobs)
            self.read_s += sum(secs)
        return views, bufs

    def drop_all(self, paths) -> None:
        DiskReader.drop_all(self, paths)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._free.clear()


_scratch = threading.local()


def _scratch_int16(n: int) -> torch.Tensor:
    """A reused per-thread int16 buffer of at least n elements (no page faults per call)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _scratch.buf = torch.empty(n, dtype=torch.int16)
    return buf[:n]


def repack_ggml(raw: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, fmt: str) -> None:
    """GGUF Q8_0/Q4_0 rows (uint8, rows * nb * (2 + per) bytes) -> moerun's packed `q` [rows,
    nb * per] and fp16 `scales` [rows, nb] in place (loaders.gguf._repack's layout: the same
    blocks, scales apart, each group of 8 blocks with its 4-byte words interleaved).

    A block is a whole number of 2-byte halves with its quants from the second on, so the
    quants are gathered as int16 into a scratch buffer (4-byte aligned), then the groups'
    words are interleaved as int32: two copies with wide elements, ~4x faster than one copy
    of single bytes (~3.6 GB/s on one Zen 4 core against ~0.8)."""
    rows, nb = scales.shape
    per = 32 if fmt == "int8" else 16
    head = nb // 8 * 8
    qb = q.view(torch.uint8)
    if raw.data_ptr() % 2 == 0 and qb.data_ptr() % 4 == 0 and (nb * per) % 4 == 0:
        b16 = raw.view(torch.int16).view(rows, nb, (2 + per) // 2)
        scales.view(torch.int16).copy_(b16[..., 0])
        if head:
            t = _scratch_int16(rows * head * per // 2).view(rows, head, per // 2)
            t.copy_(b16[:, :head, 1:])
            dst = qb[:, : head * per].view(torch.int32).view(rows, head // 8, per // 4, 8)
            dst.copy_(t.view(torch.int32).view(rows, head // 8, 8, per // 4).transpose(2, 3))
        if nb > head:
            qb[:, head * per :].view(rows, nb - head, per).copy_(raw.view(rows, nb, 2 + per)[:, head:, 2:])
        return
    b = raw.view(rows, nb, 2 + per)  # odd addresses (tiny shapes): byte by byte
    scales.view(torch.uint8).view(rows, nb, 2).copy_(b[..., :2])
    if head:
        # word k of block j of a group goes to word k * 8 + j
        dst = qb[:, : head * per].view(rows, head // 8, per // 4, 8, 4)
        dst.copy_(b[:, :head, 2:].reshape(rows, head // 8, 8, per // 4, 4).transpose(2, 3))
    if nb > head:
        qb[:, head * per :].view(rows, nb - head, per).copy_(b[:, head:, 2:])


class SlotPool:
    """Host memory for experts, in reusable slots: allocated once up to the budget."""

    def __init__(self, pin: bool = False):
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}
        self.allocated = 0
        self._blocks: list = []  # the mappings `reserve` carved its slots from

    def reserve(self, n: int, count: int) -> float:
        """Allocate `count` slots of n bytes now, in one anonymous mapping (transparent huge
        pages asked for) with every page touched, so that filling the tier later costs no
        page faults and no allocation under the store's lock. Returns the seconds it took."""
        import mmap

        if count <= 0 or self.pin:
            return 0.0
        t0 = time.perf_counter()
        stride = -(-n // PAGE) * PAGE
        m = mmap.mmap(-1, stride * count)
        if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        block = torch.frombuffer(m, dtype=torch.uint8)
        block.fill_(0)  # first touch here, not in the decode
        self._blocks.append(m)
        self.free.setdefault(n, []).extend(block[i * stride : i * stride + n] for i in range(count))
        self.allocated += n * count
        return time.perf_counter() - t0

    def take(self, n: int, budget: int) -> torch.Tensor:
        lst = self.free.get(n)
        if lst:
            return lst.pop()
        if self.allocated + n > budget:  # mixed sizes: give back free slots of other sizes
            for size, slots in self.free.items():
                while slots and self.allocated + n > budget:
                    slots.pop()
                    self.allocated -= size
        self.allocated += n
        return torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, slot: torch.Tensor) -> None:
        self.free.setdefault(slot.numel(), []).append(slot)


def slot_layout(L: LayerExperts, dtype: torch.dtype) -> tuple[tuple, int]:
    """Where an expert's pieces go in its slot: ((byte offset, shape, dtype) per piece), bytes.
    Float experts are held in the compute `dtype`, packed ones as stored."""
    if L.fmt is None:
        specs = [((L.inter, L.hidden), dtype), ((L.inter, L.hidden), dtype), ((L.hidden, L.inter), dtype)]
    else:
        specs = list(quantized_shapes(L.hidden, L.inter, L.fmt, L.down_fmt).values())
    layout, off = [], 0
    for shape, dt in specs:
        off = -(-off // dt.itemsize) * dt.itemsize  # aligned for the view
        layout.append((off, shape, dt))
        off += math.prod(shape) * dt.itemsize
    return tuple(layout), off


# -- options ----------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(value, total: int, what: str = "budget") -> int | None:
    """`None` (no limit), bytes as an int, `4GiB`/`4G` (binary), `4GB` (decimal), or `30%`
    of `total` (the routed experts' bytes in the compute dtype, or packed)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not value >= 0 or value == math.inf:  # NaN fails the first test
            raise MoerunError(f"{what} must be a finite number of bytes, not {value!r}")
        return int(value)
    t = str(value).strip().lower().replace(" ", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)(%|[a-z]*)", t)
    if not m or (m.group(2) not in _UNITS and m.group(2) != "%"):
        raise MoerunError(f"cannot read {what} {value!r}; use bytes like 4GiB, 512MB, or a share like 30%")
    x = float(m.group(1))
    if not math.isfinite(x * _UNITS.get(m.group(2), 1)):
        raise MoerunError(f"{what} {value!r} is too large")
    if m.group(2) == "%":
        if x > 100:
            raise MoerunError(f"{what} {value!r} is over 100%")
        return int(total * x / 100)
    return int(x * _UNITS[m.group(2)])


def is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def mem_available() -> int:
    """MemAvailable of /proc/meminfo (bytes): what can be allocated without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise MoerunError("--ram-budget auto needs /proc/meminfo (Linux); give the budget in bytes, e.g. 12GiB")


def auto_budget(non_expert_bytes: int, margin: int, available: int | None = None) -> tuple[int, dict]:
    """`--ram-budget auto`: the RAM free when the model began loading, less the non-expert
    weights it keeps resident and a margin; refused in one line when that leaves nothing."""
    avail = mem_available() if available is None else available
    budget = avail - margin - non_expert_bytes
    if budget <= 0:
        raise MoerunError(
            f"--ram-budget auto: the non-expert weights need {_fmt(non_expert_bytes)} resident plus a "
            f"{_fmt(margin)} margin, {_fmt(non_expert_bytes + margin)} in all, and {_fmt(avail)} is available "
            f"({_fmt(-budget)} short); free memory or lower the margin")
    return budget, {"available_bytes": avail, "margin_bytes": margin, "non_expert_bytes": non_expert_bytes,
                    "budget_bytes": budget}


@dataclass
class StoreOptions:
    """What the CLI flags set. Budgets cover routed experts only (in the compute dtype, or
    their packed bytes when the checkpoint is quantized);
    attention, shared experts, router and embeddings are always resident."""

    ram_budget: object = None  # --ram-budget: None = every expert in RAM
    vram_budget: object = None  # --vram-budget: None/0 = no device tier
    cache_policy: str = "lru"  # --cache-policy: lru | lfu | prediction | prediction-lfu
    pin_hot: int = 0  # --pin-hot N: the N most used experts per layer are never evicted
    pin_hot_fraction: float = 0.0  # --pin-hot-fraction F: the same, as a share of each layer's experts
    profile: object = None  # routing profile (path to JSON or dict) for the pinned set; None = the prompt's routing
    pin_after_tokens: int = 1  # without a profile: pin after this many tokens have been routed
    emulate_link: str | None = None  # --emulate-link pcie4 | 'GB/s,µs': the device tier is emulated
    execute: str = "device"  # --execute: a device miss waits for the link (device), runs on the CPU (cpu), or the cost model picks (auto)
    # experts read at once (a layer's demand misses, prefetches): each read is followed by CPU
    # work (the repack, the copy) that the other workers' reads overlap; 2 -> 4 -> 6 took the
    # full Qwen3.6 shape's decode from 0.29 to 0.38 to 0.44 tok/s (docs/benchmarks.md), where
    # the budget holds thousands of experts. Kept at 2: prefetches in flight hold their room,
    # and under a budget of a few experts more of them leave a demand no room (a transient load)
    disk_workers: int = 2
    drop_page_cache: bool = True
    # reads bypass the page cache (O_DIRECT into aligned bounce buffers, an expert's ranges read
    # at once on `io_threads` pread threads); False: buffered preads, pages dropped after each
    direct_io: bool = True
    # None: 3 x (disk_workers + 1), so every reader's gate, up and down ranges are in flight at
    # once (a smaller FIFO pool queued a demand's ranges behind prefetches')
    io_threads: int | None = None
    auto_margin: object = "2GiB"  # --ram-budget auto: left free (beside the non-expert weights)
    # prefetch reads that may be in flight while a get reads its demand misses: 0, none start
    # then (demand first: a demand waits at most for reads already in flight); N > 0 keeps up to
    # N of them going, so the disk's queue stays deep across a layer's tail of demand reads
    # (demand jobs still go first to every free disk worker)
    spec_inflight: int = 0
    # a RAM tier smaller than the experts: allocate its slots at load, pages touched (huge
    # pages where the kernel gives them), instead of one allocation and ~800 page faults per
    # expert while the first tokens decode
    prefault: bool = True

    def __post_init__(self):
        # the budgets' spelling is checked here, before any weight loads (a share is resolved
        # against the experts' bytes once they are known; `auto` against free RAM)
        if not is_auto(self.ram_budget):
            parse_budget(self.ram_budget, 0, "--ram-budget")
        parse_budget(self.auto_margin, 0, "auto_margin")
        if self.io_threads is not None and self.io_threads < 1:
            raise MoerunError("io_threads must be at least 1")
        parse_budget(self.vram_budget, 0, "--vram-budget")
        if self.emulate_link:
            parse_link(self.emulate_link)
        if self.pin_hot < 0 or not 0.0 <= self.pin_hot_fraction <= 1.0:
            raise MoerunError("--pin-hot must be >= 0 and --pin-hot-fraction in [0, 1]")
        if self.disk_workers < 1:
            raise MoerunError("disk_workers must be at least 1")
        if self.spec_inflight < 0:
            raise MoerunError("spec_inflight must be >= 0")
        if self.execute not in MODES:
            raise MoerunError(f"--execute must be one of {', '.join(MODES)}, not {self.execute!r}")


# -- the store --------------------------------------------------------------------------------


class ExpertWeights(tuple):
    """One expert's weight views in a tier's buffer (gate, up, down; or the packed pieces with
    their scales), and whatever a reader keeps of them for as long as they live there (the
    native ops' numpy views: `attach.StoreSource`)."""


class Entry:
    __slots__ = ("key", "pieces", "nbytes", "layout", "host", "host_slot", "host_state", "dev", "dev_state",
                 "job", "in_use", "pf", "ggml", "read_s", "t_read", "t_ask", "spec_read")

    def __init__(self, key, pieces, layout, nbytes, ggml=None):
        self.key = key
        self.pieces = pieces
        self.layout = layout  # [(byte offset, shape, dtype)] of each piece in a slot
        self.nbytes = nbytes
        self.host = self.dev = self.host_slot = self.job = None
        self.host_state = self.dev_state = NONE
        self.in_use = 0
        self.pf = False  # a prefetch is responsible for this expert and it has not been used yet
        self.ggml = ggml  # (gate, up, down) formats of GGUF Q8_0/Q4_0 rows repacked at read, or None
        self.read_s = 0.0  # a prefetch's read time, counted hidden once it is used in time
        self.t_read = 0.0  # when the read in flight began (perf_counter)
        self.t_ask = 0.0  # when a demand first asked for it while a prefetch was reading it (0: nobody)
        self.spec_read = False  # the read in flight (or that made it resident) was a prefetch's


@dataclass
class Tier:
    name: str
    budget: int
    policy: object
    used: int = 0
    peak: int = 0
    resident: int = 0
    evictions: int = 0


COUNTERS = ("requests", "hits_device", "hits_host", "demand_misses", "prefetch_issued", "prefetch_used",
            "prefetch_late", "prefetch_wasted", "prefetch_dropped", "prefetch_errors", "bytes_disk", "bytes_link",
            "reads_disk", "transfers_link", "stall_s", "tokens", "steps", "transient_loads",
            # expert read time: waited for (a demand miss, or a late prefetch) or hidden (a prefetch in time)
            "read_stalled_s", "read_hidden_s",
            # prefetch reads started, those of them a get then used (in time or late), queued
            # hints withdrawn before their read by a newer prediction of the same layer, and
            # prefetches refused room (they would have evicted what the token still needs)
            "prefetch_reads", "prefetch_reads_used", "prefetch_cancelled", "prefetch_no_room",
            # prefetched experts whose step passed unused, moved to the front of the eviction order;
            # hits on experts resident before any prefetch of this use (the cache's own hits)
            "prefetch_demoted", "hits_cached",
            # device misses by where they ran; measured expert compute; the device's is modelled
            "link_waits", "cpu_executed", "link_bytes_avoided", "background_moves", "cpu_exec_s", "device_exec_s",
            "device_exec_modelled_s")


def _zeros() -> dict:
    return {k: 0.0 if k.endswith("_s") else 0 for k in COUNTERS}


class ExpertStore:
    def __init__(self, layers: list[LayerExperts], dtype: torch.dtype, options: StoreOptions | None = None,
                 top_k: int = 8, _defer_preload: bool = False, non_expert_bytes: int = 0,
                 available: int | None = None, identity: dict | None = None):
        """non_expert_bytes: the weights kept resident outside the store (for `auto` and the
        stats); available: free RAM when the model began loading (`auto`; default: now);
        identity: {path: (size, mtime_ns)} of the files when the model was loaded."""
        o = options or StoreOptions()
        self.options = o
        self.dtype = dtype
        self.top_k = top_k
        self.entries: dict[tuple, Entry] = {}
        for L in layers:
            layout, nbytes = slot_layout(L, dtype)
            ggml = (L.fmt, L.fmt, L.down_fmt or L.fmt) if L.ggml else None
            for e in range(L.num_experts):
                self.entries[(L.layer, e)] = Entry((L.layer, e), L.pieces[e], layout, nbytes, ggml)
        self.fmt = next((L.fmt for L in layers), None)
        if any(L.fmt != self.fmt for L in layers):
            raise MoerunError("an expert store holds experts of one format; this checkpoint mixes float and quantized ones")
        self.num_experts = {L.layer: L.num_experts for L in layers}
        self.layers = sorted(self.num_experts)
        self.first_layer = self.layers[0] if self.layers else None
        self.total_bytes = sum(e.nbytes for e in self.entries.values())
        self.largest_expert = max((e.nbytes for e in self.entries.values()), default=0)
        # bytes per weight (0.5625 for int4): the cost model's device FLOPs per byte
        weights = sum(3 * L.hidden * L.inter * L.num_experts for L in layers)
        isz = self.total_bytes / weights if weights else torch.empty((), dtype=dtype).element_size()
        self.paths = sorted({p.path for e in self.entries.values() for p in e.pieces})

        self._cv = threading.Condition(threading.Lock())
        self.wanted: dict[tuple, int] = {}  # key -> the last step a prefetch hint wants it for
        self.pinned: set[tuple] = set()
        self.routing = {l: [0] * n for l, n in self.num_experts.items()}
        self.step = 0
        self._demanding = 0  # gets reading demand misses now: speculative reads wait (the disk mover's gate)
        self._spec_reading = 0  # prefetch reads in flight (beside demands: up to options.spec_inflight)
        self._parked: list[Job] = []  # prefetches held until the next get has its demand misses in
        self.c = _zeros()
        self.last_error: str | None = None
        self._closed = False

        # the link first: the compute tier depends on it
        vram = parse_budget(o.vram_budget, self.total_bytes, "--vram-budget")
        self.link = None
        if vram:
            if o.emulate_link:
                self.link = EmulatedLink(parse_link(o.emulate_link))
            elif torch.cuda.is_available():
                self.link = CudaLink()
            else:
                raise MoerunError("--vram-budget needs a CUDA GPU; without one, add --emulate-link pcie4 to emulate it")
        elif o.emulate_link:
            raise MoerunError("--emulate-link needs a device tier: give --vram-budget too")
        self.non_expert_bytes = non_expert_bytes
        self.ram_auto = None  # how `--ram-budget auto` was sized
        if is_auto(o.ram_budget):
            ram, self.ram_auto = auto_budget(non_expert_bytes, parse_budget(o.auto_margin, 0), available)
            ram = min(ram, self.total_bytes)
        else:
            ram = parse_budget(o.ram_budget, self.total_bytes, "--ram-budget")
        ram = self.total_bytes if ram is None else ram
        self.compute = DEVICE if self.link is not None else HOST
        self.cost = None  # the wait-or-run-on-CPU cost model, when there is a device to wait for
        if self.link is not None:
            shape = next(((L.hidden, L.inter) for L in layers), (1, 1))
            down_fmt = next((L.down_fmt for L in layers), None)
            cpu = (CpuSpeed.calibrate(*shape, dtype, self.fmt, down_fmt=down_fmt) if o.execute == "auto"
                   else CpuSpeed(0.0, 0.0))
            self.cost = CostModel(self.link.spec, cpu, isz)
        elif o.execute != "device":
            raise MoerunError(f"--execute {o.execute} places device misses, so it needs a device tier "
                              "(--vram-budget, with --emulate-link pcie4 without a GPU)")
        if self.link is not None and self.link.inclusive and ram < vram:
            raise MoerunError(
                "the emulated device lives in RAM: --ram-budget must be at least --vram-budget "
                f"({_fmt(ram)} < {_fmt(vram)})"
            )
        self.tiers = {HOST: Tier(HOST, ram, make_policy("lru" if self.compute == DEVICE else o.cache_policy, self.wanted))}
        if self.link is not None:
            self.tiers[DEVICE] = Tier(DEVICE, vram, make_policy(o.cache_policy, self.wanted))
        self.pool = SlotPool(pin=isinstance(self.link, CudaLink))
        self.prefault_s = 0.0
        sizes = {e.nbytes for e in self.entries.values()}
        if o.prefault and len(sizes) == 1 and 0 < ram < self.total_bytes:
            # a tier smaller than the experts fills up within the first tokens: its slots are
            # made (and their pages touched) at load rather than one by one in the decode
            n = sizes.pop()
            self.prefault_s = self.pool.reserve(n, ram // n)
        self.io = "direct" if o.direct_io and o.drop_page_cache else "buffered"
        io_threads = o.io_threads or 3 * (o.disk_workers + 1)
        self.reader = DirectReader(io_threads, identity) if self.io == "direct" else DiskReader(o.drop_page_cache, identity)
        self.disk_mover = Mover("disk", self._on_job, o.disk_workers, gate=self._spec_may_start)
        self.link_mover = Mover("link", self._on_job, 1) if self.link is not None else None
        self._pin_pending = bool(o.pin_hot or o.pin_hot_fraction)
        if not _defer_preload:
            self.preload()
        if o.drop_page_cache:
            # reading headers read ahead into the experts; pages mapped by resident weights stay
            self.reader.drop_all(self.paths)

    # -- public ---------------------------------------------------------------------------

    @property
    def emulated(self) -> bool:
        return bool(self.link is not None and self.link.emulated)

    def preload(self) -> None:
        """Fill each tier whose budget holds every expert; pin the hot set if a profile is given.
        Preloading is not counted in the stats."""
        with self._cv:
            for tier in (HOST, DEVICE):
                if tier in self.tiers and self.tiers[tier].budget >= self.total_bytes:
                    for ent in self.entries.values():
                        ent.in_use += 1
                        try:
                            (self._ensure_host if tier == HOST else self._ensure_device)(ent, True, False)
                        finally:
                            ent.in_use -= 1
            if self._pin_pending and self.options.profile is not None:
                self._pin_locked(load_profile(self.options.profile), quiet=True)
            self._reset_locked()

    def get(self, layer: int, ids, n_tokens: int = 1, counts=None, where: dict | None = None) -> dict[int, tuple]:
        """Weights (gate [I,H], up [I,H], down [H,I]) of each expert in `ids`, held until
        `release(layer, ids)`: resident in the compute tier (or transient), or, for a device
        miss that `--execute` sends to the CPU, in RAM. `counts[e]`: expert e's tokens
        (default `n_tokens`), for the cost model; `where`, if given, gets `e -> "device" | "cpu"`."""
        t0 = time.perf_counter()
        out, misses, moves = {}, [], []
        with self._cv:
            if self._closed:
                raise MoerunError("the expert store is closed")
            if layer == self.first_layer:
                self._advance(n_tokens)
            routing = self.routing[layer]
            policy = self.tiers[self.compute].policy
            c = self.c
            for e in ids:
                e = int(e)
                ent = self.entries[(layer, e)]
                ent.in_use += 1
                c["requests"] += 1
                routing[e] += 1
                self.wanted.pop(ent.key, None)
                w = ent.dev if self.compute == DEVICE else ent.host
                ready = (ent.dev_state if self.compute == DEVICE else ent.host_state) == READY
                c["hits_cached"] += ready and not ent.pf
                if ent.pf:
                    ent.pf = False
                    c["prefetch_used"] += 1
                    if ent.spec_read:  # its read was started by the prefetch (not taken over)
                        c["prefetch_reads_used"] += 1
                    if not ready:
                        c["prefetch_late"] += 1
                        if ent.host_state == LOADING and ent.spec_read and not ent.t_ask:
                            # the read goes on; from now on it is waited for (`_ensure_host` splits it)
                            ent.t_ask = t0
                    elif ent.read_s:
                        c["read_hidden_s"] += ent.read_s
                    ent.read_s = 0.0
                    ent.spec_read = False
                elif not ready:
                    c["demand_misses"] += 1
                if ready:
                    c["hits_" + self.compute] += 1
                    policy.accessed(ent.key)
                    out[e] = w
                else:
                    misses.append(ent)
            if where is not None:
                where.update(dict.fromkeys(out, DEVICE if self.compute == DEVICE else CPU))
            if not misses:
                self._unpark()
                return out
            self._demanding += 1  # speculative reads wait until this layer's misses are in
            try:
                # queue the disk reads so idle disk workers read in parallel with us; a prefetch
                # still queued becomes a demand job (else the gate would keep the workers off it
                # and we would read every late prefetch of the layer one after another)
                for ent in misses:
                    job = ent.job
                    if ent.host_state == NONE and job is not None and not job.demand and job.stage == HOST:
                        job.cancelled = True
                        ent.job = job = None
                    if ent.host_state == NONE and job is None:
                        ent.job = Job(ent, math.inf, self.step, HOST, demand=True)
                        self.disk_mover.submit(ent.job)
                if self.options.spec_inflight:
                    # held hints queue now, behind the demand jobs (every free worker takes those
                    # first), and the gate keeps at most spec_inflight of them reading beside them
                    self._unpark()
                places = self._place(misses, n_tokens, counts)
                for ent, place in zip(misses, places):
                    if self.compute == DEVICE:
                        if ent.host_state == READY:
                            c["hits_host"] += 1
                        if place == CPU:
                            w, _ = self._ensure_host(ent, True, True)
                            self._ran_on_cpu(ent, moves)
                        else:
                            w, _ = self._ensure_device(ent, True, True)
                            c["link_waits"] += 1
                    else:
                        w, _ = self._ensure_host(ent, True, True)
                    out[ent.key[1]] = w
                    if where is not None:
                        where[ent.key[1]] = place
            except BaseException:
                for e in ids:
                    self.entries[(layer, int(e))].in_use -= 1
                for job in moves:
                    job.entry.job = None
                raise
            finally:
                c["stall_s"] += time.perf_counter() - t0
                self._demanding -= 1
                if not self._demanding:
                    self.disk_mover.kick()
                self._unpark()
        if moves:  # queued once the lock is free, so the link's worker does not wake into it
            self.link_mover.submit(*moves)
        return out

    def release(self, layer: int, ids, ran=()) -> None:
        """Let go of `get`'s experts; `ran`: (expert, where, tokens, seconds measured) per
        expert run, for the accounting and the cost model's CPU speed."""
        with self._cv:
            for e in ids:
                self.entries[(layer, int(e))].in_use -= 1
            c = self.c
            for e, place, n, sec in ran:
                nbytes = self.entries[(layer, int(e))].nbytes
                if place == CPU:
                    c["cpu_exec_s"] += sec
                else:
                    c["device_exec_s"] += sec
                    c["device_exec_modelled_s"] += self.cost.device_s(n, nbytes)
                if self.cost is not None and (place == CPU or self.emulated):  # emulated: the CPU ran it
                    self.cost.cpu.observe(n, nbytes, sec)

    def prefetch(self, layer: int, ids, priority: float = 0.0, for_step: int | None = None, hold: bool = False,
                 replace: bool = False) -> None:
        """Ask for experts to be moved to the compute tier ahead of use; returns at once.
        Higher `priority` goes first (`ids` best first: each later one a little lower). The
        hint is dropped once the store's step (one per forward pass) moves past `for_step`
        (default: the current step). Reads of prefetches start only while no get is reading
        its demand misses (demand goes first), and a prefetch never evicts an expert that is
        wanted by a pending hint or prefetched and not yet used: without room it is dropped.
        hold: queue the reads only once the next get has its demand misses in (a route
        observer hinting the next layers just before this layer's get); replace: withdraw
        this layer's queued prefetches (for the same step) that `ids` no longer names."""
        with self._cv:
            if self._closed:
                return
            fs = self.step if for_step is None else for_step
            ids = [int(e) for e in ids]
            if replace:
                keep = set(ids)
                for job in [*self._parked, *self.disk_mover.queued()]:
                    ent = job.entry
                    if (ent.key[0] == layer and ent.key[1] not in keep and ent.job is job and not job.demand
                            and job.for_step == fs and ent.pf):
                        job.cancelled = True
                        ent.job = None
                        ent.pf = False
                        self.c["prefetch_cancelled"] += 1
                        if self.wanted.get(ent.key) == fs:
                            del self.wanted[ent.key]
            jobs = []
            for rank, e in enumerate(ids):
                ent = self.entries[(layer, e)]
                if self.wanted.get(ent.key, -1) < fs:
                    self.wanted[ent.key] = fs
                state = ent.dev_state if self.compute == DEVICE else ent.host_state
                if state != NONE or ent.pf:
                    continue
                ent.pf = True
                self.c["prefetch_issued"] += 1
                stage = DEVICE if self.compute == DEVICE and ent.host_state == READY else HOST
                ent.job = Job(ent, priority - rank * 1e-6, fs, stage)
                jobs.append(ent.job)
            if hold:
                self._parked.extend(jobs)
            else:
                for job in jobs:
                    (self.link_mover if job.stage == DEVICE else self.disk_mover).submit(job)

    def advance(self, n_tokens: int = 1) -> None:
        """Start a new step (the store also does this itself at each pass's first layer)."""
        with self._cv:
            self._advance(n_tokens)

    def pin_hot(self, profile=None, n: int | None = None, fraction: float | None = None) -> int:
        """Pin the most used experts of each layer in the compute tier; returns how many."""
        with self._cv:
            return self._pin_locked(load_profile(profile) if profile is not None else self.routing, n, fraction)

    def routing_profile(self) -> dict[int, list[int]]:
        with self._cv:
            return {l: list(c) for l, c in self.routing.items()}

    def evict_all(self) -> int:
        """Empty the tiers of every expert not pinned, in use or on its way (so that runs
        compared side by side each start from the same cold store, not from what the one
        before left); returns how many were evicted. Evictions here are not counted."""
        with self._cv:
            n = 0
            for tier in (DEVICE, HOST):  # the device first: an inclusive link keeps its experts on the host
                if tier not in self.tiers:
                    continue
                ok = self._evictable(tier)
                keep = self.tiers[tier].evictions
                for key, ent in self.entries.items():
                    if key not in self.pinned and ent.job is None and ok(key):
                        self._evict(tier, ent)
                        n += 1
                self.tiers[tier].evictions = keep
            return n

    def reset_stats(self) -> None:
        with self._cv:
            self._reset_locked()

    def snapshot(self) -> dict:
        """The raw counters now, the compute tier's bytes used and budget, and the disk reader's
        queue figures (cheap: for a per-token series; differences of two snapshots are a token's)."""
        with self._cv:
            t = self.tiers[self.compute]
            # full: no room for one more expert without an eviction
            out = {**self.c, "used_bytes": t.used, "budget_bytes": t.budget,
                   "full": t.used + self.largest_expert > t.budget}
        r = self.reader
        out.update(busy_s=getattr(r, "busy_s", 0.0), depth_s=getattr(r, "depth_s", 0.0),
                   preads=r.reads, bytes_preads=r.bytes, pread_s=getattr(r, "read_s", 0.0))
        return out

    def stats(self) -> dict:
        with self._cv:
            c = dict(self.c)
            tiers = {n: (t.budget, t.used, t.peak, t.resident, t.evictions, t.policy.describe()) for n, t in self.tiers.items()}
            pending = sum(1 for e in self.entries.values() if e.pf)
        req = max(c["requests"], 1)
        tok = max(c["tokens"], 1)
        out = {
            "emulated": self.emulated,
            "link": self.link.describe() if self.link is not None else None,
            "compute_tier": self.compute,
            "policy": tiers[self.compute][5],
            "pinned_experts": len(self.pinned),
            "tokens": c["tokens"],
            "steps": c["steps"],
            "requests": c["requests"],
            "expert_hit_rate": c["hits_" + self.compute] / req,
            "prefetch_precision": c["prefetch_used"] / c["prefetch_issued"] if c["prefetch_issued"] else 0.0,
            # of the reads prefetches started, the share a get used (bytes not wasted)
            "prefetch_read_precision": c["prefetch_reads_used"] / c["prefetch_reads"] if c["prefetch_reads"] else 0.0,
            "prefetch_reads": c["prefetch_reads"],
            "prefetch_reads_used": c["prefetch_reads_used"],
            "prefetch_cancelled": c["prefetch_cancelled"],
            "prefetch_no_room": c["prefetch_no_room"],
            "prefetch_demoted": c["prefetch_demoted"],
            # hits on experts the tier held without a prefetch for this use (its own hit rate)
            "cache_hit_rate": c["hits_cached"] / req,
            "prefetch_recall": c["prefetch_used"] / max(c["prefetch_used"] + c["demand_misses"], 1),
            "bytes_moved_per_token": (c["bytes_disk"] + c["bytes_link"]) / tok,
            "stall_s_per_token": c["stall_s"] / tok,
            "stall_s": c["stall_s"],
            "demand_misses": c["demand_misses"],
            "prefetch_issued": c["prefetch_issued"],
            "prefetch_used": c["prefetch_used"],
            "prefetch_late": c["prefetch_late"],
            "prefetch_wasted": c["prefetch_wasted"],
            "prefetch_dropped": c["prefetch_dropped"],
            "prefetch_pending": pending,
            "prefetch_errors": c["prefetch_errors"],
            "transient_loads": c["transient_loads"],
            "experts_bytes": self.total_bytes,
            "non_expert_bytes": self.non_expert_bytes,
            "ram_budget_auto": self.ram_auto,
            "io": self.io,
            "read_stalled_s": c["read_stalled_s"],
            "read_hidden_s": c["read_hidden_s"],
            # the share of expert read time that overlapped compute (prefetches used in time)
            "expert_wait_hidden_fraction": c["read_hidden_s"] / max(c["read_hidden_s"] + c["read_stalled_s"], 1e-12),
            # where device misses ran (--execute); expert compute measured per side; under the
            # emulated device the "device" experts ran on the CPU: their device time is MODELLED
            "execute": self.options.execute,
            "link_waits": c["link_waits"],
            "cpu_executed": c["cpu_executed"],
            "link_bytes_avoided": c["link_bytes_avoided"],
            "background_moves": c["background_moves"],
            "cpu_exec_s": c["cpu_exec_s"],
            "device_exec_s": c["device_exec_s"],
            "device_exec_modelled_s": c["device_exec_modelled_s"],
            "tiers": {},
        }
        for name, (budget, used, peak, resident, ev, _) in tiers.items():
            hits = c["hits_" + name]
            reaching = c["requests"] if name == self.compute else c["requests"] - c["hits_device"]
            out["tiers"][name] = {
                "budget_bytes": budget, "used_bytes": used, "peak_bytes": peak, "resident_experts": resident,
                "hits": hits, "hit_rate": hits / max(reaching, 1), "evictions": ev,
            }
        if self.link is not None:
            out["tiers"][DEVICE].update(
                emulated=self.emulated, transfers=c["transfers_link"], bytes=c["bytes_link"],
                bytes_per_token=c["bytes_link"] / tok,
                # since the store was made: the link model's time, and the time the link was held
                link_modeled_s=self.link.modeled_s, link_busy_s=self.link.busy_s,
            )
        out["tiers"]["disk"] = {"reads": c["reads_disk"], "bytes_read": c["bytes_disk"],
                                "bytes_per_token": c["bytes_disk"] / tok, "io": self.io}
        if isinstance(self.reader, DirectReader):  # since the store was made
            out["tiers"]["disk"].update(preads=self.reader.reads, bytes_preads=self.reader.bytes,
                                        pread_s=self.reader.read_s, bounce_buffers=self.reader.buffers,
                                        bounce_bytes=self.reader.buffer_bytes, disk_busy_s=self.reader.busy_s,
                                        queue_depth_s=self.reader.depth_s)
        return out

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self.disk_mover.close()
        if self.link_mover is not None:
            self.link_mover.close()
        self.reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def threads_alive(self) -> bool:
        return self.disk_mover.alive or bool(self.link_mover and self.link_mover.alive)

    # -- internals (the lock is held unless said otherwise) -------------------------------------

    def _reset_locked(self):
        self.c = _zeros()
        for t in self.tiers.values():
            t.peak = t.used
            t.evictions = 0

    def _spec_may_start(self) -> bool:
        """The disk mover's gate: a prefetch read may start (no get is reading demand misses,
        or fewer than `spec_inflight` prefetch reads are in flight beside them)."""
        return self._demanding == 0 or self._spec_reading < self.options.spec_inflight

    def _unpark(self):
        """Queue the held prefetches (a get has its demand misses in)."""
        if self._parked:
            jobs, self._parked = self._parked, []
            disk = [j for j in jobs if j.stage == HOST and not j.cancelled]
            link = [j for j in jobs if j.stage == DEVICE and not j.cancelled]
            if disk:
                self.disk_mover.submit(*disk)
            if link:
                self.link_mover.submit(*link)

    def _advance(self, n_tokens):
        self.step += 1
        self.c["steps"] += 1
        self.c["tokens"] += n_tokens
        if self.wanted:
            policy = self.tiers[self.compute].policy
            for k in [k for k, s in self.wanted.items() if s < self.step]:
                del self.wanted[k]
                ent = self.entries[k]
                # prefetched for a step that has passed without using it: first to go (LRU),
                # so a wrong prediction does not push out an expert that was used
                if ent.pf and (ent.dev_state if self.compute == DEVICE else ent.host_state) == READY:
                    policy.demoted(k)
                    self.c["prefetch_demoted"] += 1
        if self._pin_pending and self.options.profile is None and self.c["tokens"] >= self.options.pin_after_tokens:
            if self.step > 1:  # the routing of the pass that just ended is complete
                self._pin_locked(self.routing)

    def _pin_locked(self, profile, n=None, fraction=None, quiet=False) -> int:
        o = self.options
        n = o.pin_hot if n is None and fraction is None else (n or 0)
        fraction = o.pin_hot_fraction if fraction is None else fraction
        self._pin_pending = False
        tier = self.tiers[self.compute]
        chosen = []
        for layer, counts in profile.items():
            layer = int(layer)
            if layer not in self.num_experts:
                continue
            k = max(n, int(round(fraction * self.num_experts[layer])))
            order = sorted(range(len(counts)), key=lambda e: -counts[e])
            chosen += [(-counts[e], r, (layer, e)) for r, e in enumerate(order[:k]) if counts[e] > 0]
        # across layers, keep the most used; leave room for two layers' worth of other experts
        chosen.sort()
        room = tier.budget - 2 * self.top_k * max((e.nbytes for e in self.entries.values()), default=0)
        pinned, size = set(), 0
        for _, _, key in chosen:
            nb = self.entries[key].nbytes
            if size + nb > room:
                break
            pinned.add(key)
            size += nb
        saved = dict(self.c)
        self.pinned = pinned
        tier.policy.pinned = pinned
        for key in sorted(pinned):
            ent = self.entries[key]
            ent.in_use += 1
            try:
                (self._ensure_host if self.compute == HOST else self._ensure_device)(ent, True, False)
            finally:
                ent.in_use -= 1
        if quiet:
            self.c = saved
        return len(pinned)

    def _evictable(self, tier: str):
        inclusive = self.link is not None and self.link.inclusive
        if tier == HOST:
            return lambda k: ((e := self.entries[k]).in_use == 0 and e.host_state == READY
                              and not (inclusive and e.dev_state != NONE))
        return lambda k: (e := self.entries[k]).in_use == 0 and e.dev_state == READY

    def _reserve(self, tier_name: str, ent: Entry, spec: bool = False):
        """Room for `ent` in a tier, evicting per policy; a slot (host), True (device) or None.
        spec (a prefetch's room): never at the cost of an expert a pending hint wants for
        this step or a later one, or one prefetched and not used yet."""
        t = self.tiers[tier_name]
        n = ent.nbytes
        ok = self._evictable(tier_name)
        if spec:
            base, wanted, step = ok, self.wanted, self.step
            ok = lambda k: base(k) and not self.entries[k].pf and wanted.get(k, -1) < step  # noqa: E731
        while t.used + n > t.budget:
            k = max(1, -(-(t.used + n - t.budget) // n))
            victims = t.policy.victims(k, ok)
            if not victims:
                return None
            for key in victims:
                self._evict(tier_name, self.entries[key])
        t.used += n
        t.peak = max(t.peak, t.used)
        t.resident += 1
        return self.pool.take(n, t.budget) if tier_name == HOST else True

    def _unreserve(self, tier_name, ent, slot=None):
        t = self.tiers[tier_name]
        t.used -= ent.nbytes
        t.resident -= 1
        if slot is not None:
            self.pool.give(slot)

    def _evict(self, tier_name: str, ent: Entry):
        t = self.tiers[tier_name]
        if tier_name == HOST:
            slot = ent.host_slot
            ent.host = ent.host_slot = None
            ent.host_state = NONE
            self._unreserve(HOST, ent, slot)
        else:
            ent.dev = None
            ent.dev_state = NONE
            self._unreserve(DEVICE, ent)
        t.policy.removed(ent.key)
        t.evictions += 1
        if tier_name == HOST:
            ent.spec_read = False
        if tier_name == self.compute and ent.pf:
            ent.pf = False
            self.c["prefetch_wasted"] += 1

    def _views(self, ent: Entry, buf: torch.Tensor) -> "ExpertWeights":
        out = []
        for off, shape, dtype in ent.layout:
            n = math.prod(shape) * dtype.itemsize
            out.append(buf[off : off + n].view(dtype).view(shape))
        return ExpertWeights(out)

    def _read(self, ent: Entry, buf: torch.Tensor) -> tuple:
        """Read an expert from disk into `buf` (lock NOT held). Returns its weight views."""
        with torch.no_grad():
            views = self._views(ent, buf)
            if isinstance(self.reader, DirectReader):
                raws, bufs = self.reader.read_pieces(ent.pieces)
                try:
                    if ent.ggml is not None:
                        for j, (raw, fmt) in enumerate(zip(raws, ent.ggml)):
                            repack_ggml(raw, views[2 * j], views[2 * j + 1], fmt)
                    else:
                        for piece, raw, view, (off, _, dtype) in zip(ent.pieces, raws, views, ent.layout):
                            if piece.dtype == dtype:
                                buf[off : off + piece.nbytes].copy_(raw)
                            else:
                                view.copy_(raw.view(piece.dtype).view(piece.shape))
                finally:
                    self.reader.give(bufs)
                return views
            if ent.ggml is not None:
                for j, (piece, fmt) in enumerate(zip(ent.pieces, ent.ggml)):
                    raw = torch.empty(piece.nbytes, dtype=torch.uint8)
                    self.reader.read_into(piece, raw)
                    repack_ggml(raw, views[2 * j], views[2 * j + 1], fmt)
                return views
            for piece, view, (off, _, dtype) in zip(ent.pieces, views, ent.layout):
                if piece.dtype == dtype:
                    self.reader.read_into(piece, buf[off : off + piece.nbytes])
                else:  # convert (e.g. an fp16 checkpoint run in bf16) through a scratch buffer
                    scratch = torch.empty(piece.nbytes, dtype=torch.uint8)
                    self.reader.read_into(piece, scratch)
                    view.copy_(scratch.view(piece.dtype).view(piece.shape))
        return views

    def _wait(self):
        self._cv.wait(0.1)
        if self._closed:
            raise MoerunError("the expert store was closed while waiting for an expert")

    def _ensure_host(self, ent: Entry, take_over: bool, transient_ok: bool, spec: bool = False):
        """Make `ent` READY in RAM. Returns (weights or None when there is no room, moved).
        spec: a prefetch's read (its room is found as `_reserve` says; its time is hidden if
        it is used in time, else split at the moment a get asked for it)."""
        while True:
            if ent.host_state == READY:
                return ent.host, False
            if ent.host_state == LOADING:
                self._wait()
                continue
            job = ent.job
            if take_over and job is not None and job.stage == HOST:
                job.cancelled = True  # a queued prefetch: the demand does its work now
                ent.job = None
            break
        slot = self._reserve(HOST, ent, spec)
        if slot is None and not transient_ok:
            if spec:
                self.c["prefetch_no_room"] += 1
            return None, False
        buf = slot if slot is not None else torch.empty(ent.nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        spec = spec and ent.pf and slot is not None
        if slot is not None:
            ent.host_state = LOADING
            ent.t_read, ent.t_ask, ent.spec_read = t0, 0.0, spec
            if spec:
                self.c["prefetch_reads"] += 1
        self._spec_reading += spec
        self._cv.release()
        try:
            views = self._read(ent, buf)
        except BaseException:
            self._cv.acquire()
            self._spec_done(spec)
            if slot is not None:
                ent.host_state = NONE
                self._unreserve(HOST, ent, slot)
                self._cv.notify_all()
            raise
        t1 = time.perf_counter()
        dt = t1 - t0
        self._cv.acquire()
        self._spec_done(spec)
        if spec and ent.pf:  # a prefetch's, nobody asked yet: hidden if it is used in time (`get`)
            ent.read_s = dt
        elif spec and ent.t_ask:  # a get asked while it was reading: hidden until then, waited for after
            asked = min(max(ent.t_ask, t0), t1)
            self.c["read_hidden_s"] += asked - t0
            self.c["read_stalled_s"] += t1 - asked
            ent.t_ask = 0.0
        elif not spec:  # a demand's read
            self.c["read_stalled_s"] += dt
        self.c["bytes_disk"] += ent.nbytes
        self.c["reads_disk"] += 1
        if slot is None:
            self.c["transient_loads"] += 1
            return views, True
        ent.host, ent.host_slot, ent.host_state = views, slot, READY
        self.tiers[HOST].policy.inserted(ent.key)
        self._cv.notify_all()
        return views, True

    def _spec_done(self, spec: bool) -> None:
        if spec:
            self._spec_reading -= 1
            if self._demanding and self.options.spec_inflight:
                self.disk_mover.kick()  # a gated prefetch may start now

    def _ensure_device(self, ent: Entry, take_over: bool, transient_ok: bool):
        """Make `ent` READY on the device (through RAM). Returns (weights or None, moved)."""
        while True:
            while True:
                if ent.dev_state == READY:
                    return ent.dev, False
                if ent.dev_state == LOADING:
                    self._wait()
                    continue
                job = ent.job
                if take_over and job is not None and job.stage == DEVICE:
                    job.cancelled = True
                    ent.job = None
                break
            hw, _ = self._ensure_host(ent, take_over, transient_ok)
            if hw is None:
                return None, False
            if ent.dev_state == NONE:  # the lock was released while reading: look again
                break
        host_cached = ent.host_state == READY and ent.host is hw
        ok = self._reserve(DEVICE, ent) if host_cached or not self.link.inclusive else None
        if ok is None and not transient_ok:
            return None, False
        if ok:
            ent.dev_state = LOADING
        self._cv.release()
        try:
            w = self.link.fetch(hw, ent.nbytes, take_over, ent.key)
        except BaseException:
            self._cv.acquire()
            if ok:
                ent.dev_state = NONE
                self._unreserve(DEVICE, ent)
                self._cv.notify_all()
            raise
        self._cv.acquire()
        self.c["bytes_link"] += ent.nbytes
        self.c["transfers_link"] += 1
        if not ok:
            self.c["transient_loads"] += 1
            return w, True
        ent.dev, ent.dev_state = w, READY
        self.tiers[DEVICE].policy.inserted(ent.key)
        self._cv.notify_all()
        return w, True

    def _place(self, misses: list, n_tokens: int, counts) -> list[str]:
        """Where each miss runs: the compute tier, or (`--execute cpu|auto`) the CPU."""
        if self.compute == HOST:
            return [CPU] * len(misses)
        if self.options.execute != "auto":
            return [self.options.execute] * len(misses)
        link = self.link
        items = [Miss(ent.nbytes, counts[ent.key[1]] if counts is not None else n_tokens,
                      ent.dev_state == LOADING and link.current == ent.key) for ent in misses]
        return self.cost.plan(items, max(link.busy_until - time.perf_counter(), 0.0))

    def _ran_on_cpu(self, ent: Entry, moves: list):
        """Count a device miss run on the CPU, and add its move to the device in the background
        to `moves` (lowest priority, for the next token), so the device's cache still follows use."""
        self.c["cpu_executed"] += 1
        self.c["link_bytes_avoided"] += ent.nbytes
        if ent.host_state == READY and ent.dev_state == NONE and ent.job is None:
            ent.job = Job(ent, -math.inf, self.step + 1, DEVICE)
            moves.append(ent.job)
            self.c["background_moves"] += 1

    def _drop(self, ent: Entry):
        if ent.pf:
            ent.pf = False
            self.c["prefetch_dropped"] += 1

    def _on_job(self, job: Job) -> None:
        """A mover's worker runs one job (lock NOT held on entry)."""
        ent = job.entry
        with self._cv:
            if self._closed or job.cancelled or ent.job is not job:
                return
            if not job.demand and job.stage == HOST and not self._spec_may_start():
                self.disk_mover.submit(job)  # a get began reading its misses since: back in the queue
                return
            ent.job = None
            demand = job.demand
            if not demand and self.step > job.for_step:
                self._drop(ent)  # stale: the token moved on
                return
            ent.in_use += 1
            try:
                if job.stage == HOST:
                    w, _ = self._ensure_host(ent, False, False, spec=not demand)
                    if w is None:
                        if not demand:
                            self._drop(ent)
                    elif self.compute == DEVICE and not demand and ent.dev_state == NONE:
                        if self.step > job.for_step:
                            self._drop(ent)
                        else:
                            ent.job = Job(ent, job.priority, job.for_step, DEVICE)
                            self.link_mover.submit(ent.job)
                else:
                    w, _ = self._ensure_device(ent, False, False)
                    if w is None:
                        self._drop(ent)
            except MoerunError as e:
                self.c["prefetch_errors"] += 1
                self.last_error = str(e)
                self._drop(ent)
            finally:
                ent.in_use -= 1
                self._cv.notify_all()


def format_stats(st: dict) -> str:
    """`moerun generate --stats`: the store's figures in a few lines (emulated ones say so)."""
    emu = " (EMULATED device)" if st["emulated"] else ""
    lines = [
        f"experts{emu}: hit rate {st['expert_hit_rate']:.1%} ({st['requests']} requests, {st['demand_misses']} demand misses), "
        f"policy {st['policy']}",
        f"  moved {st['bytes_moved_per_token'] / 1e6:.1f} MB/token, stall {st['stall_s_per_token'] * 1e3:.1f} ms/token "
        f"({st['stall_s']:.2f} s over {st['tokens']} tokens), transient loads {st['transient_loads']}",
        f"  prefetch: issued {st['prefetch_issued']}, used {st['prefetch_used']} (late {st['prefetch_late']}), "
        f"wasted {st['prefetch_wasted']}, dropped {st['prefetch_dropped']}; precision {st['prefetch_precision']:.1%}, "
        f"recall {st['prefetch_recall']:.1%}",
    ]
    if st["compute_tier"] == DEVICE:
        modelled = "MODELLED" if st["emulated"] else "modelled"
        lines.append(
            f"  execute {st['execute']}: {st['link_waits']} misses waited for the link, {st['cpu_executed']} ran on the CPU "
            f"({st['cpu_exec_s']:.3f} s, {st['link_bytes_avoided'] / 1e6:.1f} MB of demand transfers avoided, "
            f"{st['background_moves']} moved in the background); experts on the device: {st['device_exec_s']:.3f} s measured"
            f"{' on the CPU' if st['emulated'] else ''}, {st['device_exec_modelled_s']:.3f} s {modelled} device compute")
    for name, t in st["tiers"].items():
        if "budget_bytes" in t:
            tag = " EMULATED, " + st["link"] if name == DEVICE and st["emulated"] else ""
            lines.append(f"  {name}{tag}: {_fmt(t['used_bytes'])} of {_fmt(t['budget_bytes'])} "
                         f"({t['resident_experts']} experts), hit rate {t['hit_rate']:.1%}, {t['evictions']} evictions")
        else:
            lines.append(f"  {name}: {t['reads']} reads, {_fmt(t['bytes_read'])}")
    return "\n".join(lines)


def load_profile(profile) -> dict[int, list[int]]:
    """A routing profile: {layer: [count per expert]}, from a dict, a JSON file
    (`{"layers": {"0": [...], ...}}` or the bare mapping), or a routing trace (`moerun
    profile`'s .npz, or a `Trace`)."""
    import json

    if hasattr(profile, "counts") or str(profile).endswith(".npz"):  # a routing trace (profile.py)

        trace = profile if hasattr(profile, "counts") else Trace.load(profile)
        layers = trace.meta.get("moe_layers") or list(range(trace.num_layers))
        return {int(layer): [int(c) for c in row] for layer, row in zip(layers, trace.counts())}
    if isinstance(profile, dict):
        d = profile
    else:
        try:
            d = json.loads(Path(profile).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise MoerunError(f"cannot read routing profile {profile}: {e}") from None
    d = d.get("layers", d)
    return {int(k): list(v) for k, v in d.items()}


def save_profile(store: ExpertStore, path) -> None:
    import json

    Path(path).write_text(json.dumps({"layers": {str(k): v for k, v in store.routing_profile().items()}}))


def _fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
