"""Reading Hugging Face safetensors checkpoints through memory maps.

We read the (tiny, JSON) headers ourselves because the expert store later needs each
tensor's file and byte offset to stream experts from disk. Tensors whose dtype matches
the requested one are used in place (zero-copy views of a private file mapping); tensors
that are converted or stacked are copied and their source pages dropped at once, so the
peak resident memory stays close to the size of the loaded weights.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path, PurePosixPath

import torch

from ..config import open_regular, read_json, regular_file
from ..errors import MoerunError, one_line, short

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: file, absolute byte offset, size."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _parse_header(path: Path) -> list[TensorRef]:
    """The tensors of one safetensors file: an 8-byte little-endian header length, then a
    JSON object of name -> {dtype, shape, data_offsets}. Each tensor's byte range must match
    its shape, lie inside the file and overlap no other's; a name may appear once."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise MoerunError(f"{path} is truncated or not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise MoerunError(f"{path} is truncated or corrupt: header of {n} bytes in a {size}-byte file")
        raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise MoerunError(f"{path} is corrupt: its header names tensor {e.args[0]!r} twice") from None
    except RecursionError:
        raise MoerunError(f"{path} is corrupt: its header is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise MoerunError(f"{path} is corrupt: its header is not valid JSON ({one_line(e)})") from None
    if not isinstance(header, dict):
        raise MoerunError(f"{path} is corrupt: its header is not a JSON object")
    base = 8 + n
    refs = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
            raise MoerunError(f"{path} is corrupt: bad header entry for tensor {name!r}")
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise MoerunError(f"{path}: tensor {name!r} has dtype {short(info['dtype'])}, which moerun does not read "
                              f"(it reads {', '.join(DTYPES)})")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
            raise MoerunError(f"{path} is corrupt: bad shape or data_offsets for tensor {name!r}")
        start, end = offsets
        nbytes = prod(shape) * dtype.itemsize
        if end - start != nbytes:
            raise MoerunError(f"{path} is corrupt: tensor {name!r} has {end - start} bytes, its shape needs {nbytes}")
        if base + end > size:
            raise MoerunError(
                f"{path} is truncated: tensor {name!r} ends at byte {base + end} but the file has {size} bytes"
            )
        refs.append(TensorRef(name, path, dtype, tuple(shape), base + start, nbytes))
    last = None
    for ref in sorted((r for r in refs if r.nbytes), key=lambda r: r.offset):
        if last is not None and ref.offset < last.offset + last.nbytes:
            raise MoerunError(f"{path} is corrupt: the bytes of tensors {last.name!r} and {ref.name!r} overlap")
        last = ref
    return refs


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _ints(v) -> bool:
    """Whether v is a list of non-negative ints (JSON numbers without a fraction)."""
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def _shard_names(index: Path, data) -> list[str]:
    """The shard files an index's weight_map names, each a relative path that stays inside
    the model directory. Checked by name, not by where links lead: a Hugging Face cache's
    snapshot holds links to blobs outside it, placed there by whoever made the directory."""
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise MoerunError(f"{index} is not a valid safetensors index (it needs a weight_map of tensor -> file name)")
    names = sorted(set(weight_map.values()))
    for name in names:
        p = PurePosixPath(name)
        if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
            raise MoerunError(f"{index} names shard {short(name)}, which is outside the model directory")
    return names


class Checkpoint:
    """All tensors of a model directory's safetensors files, by name."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if regular_file(index):
            files = [self.dir / f for f in _shard_names(index, read_json(index))]
            for f in files:
                if not regular_file(f):
                    raise MoerunError(f"{index} names shard {f.name}, which is missing")
        else:
            files = [f for f in sorted(self.dir.glob("*.safetensors")) if regular_file(f)]
        if not files:
            raise MoerunError(f"{self.dir} has no *.safetensors weight files")
        self.tensors: dict[str, TensorRef] = {}
        for f in files:
            for ref in _parse_header(f):
                other = self.tensors.get(ref.name)
                if other is not None:
                    raise MoerunError(f"tensor {ref.name!r} is in both {other.path.name} and {f.name}")
                self.tensors[ref.name] = ref
        self._maps: dict[Path, mmap.mmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _map(self, path: Path) -> mmap.mmap:
        mm = self._maps.get(path)
        if mm is None:
            with open_regular(path) as f:
                # private (copy-on-write) mapping: writable views without touching the file
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[path] = mm
        return mm

    def view(self, ref: TensorRef) -> torch.Tensor:
        """A zero-copy tensor over the file's bytes (pages are read when first touched)."""
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=ref.dtype)
        mm = self._map(ref.path)
        flat = torch.frombuffer(mm, dtype=ref.dtype, count=ref.nbytes // ref.dtype.itemsize, offset=ref.offset)
        return flat.view(ref.shape)

    def drop_pages(self, ref: TensorRef) -> None:
        """Release the resident pages of a tensor that has been copied elsewhere."""
        mm = self._maps.get(ref.path)
        if mm is None:
            return
        start = -(-ref.offset // PAGE) * PAGE
        end = (ref.offset + ref.nbytes) // PAGE * PAGE
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def copy_into(self, ref: TensorRef, out: torch.Tensor) -> None:
        out.copy_(self.view(ref))
        self.drop_pages(ref)

    def close(self) -> None:
        # mappings still referenced by zero-copy tensors stay valid until those are freed
        self._maps.clear()


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` as one safetensors file; returns its size in bytes.

    Each tensor's bytes go straight from its memory to the file (the `safetensors` package
    first copies every tensor into a Python bytes object, doubling the memory of a shard).
    Tensors are laid out widest element first, so every offset stays aligned.
    """
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in order:
            t = tensors[name]
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return 8 + len(raw) + offset


def file_bytes(model_dir: Path) -> int:
    return sum(os.path.getsize(p) for p in Path(model_dir).glob("*.safetensors"))
