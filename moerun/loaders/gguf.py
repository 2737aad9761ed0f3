"""Reading GGUF files (llama.cpp's format): `-m FILE.gguf`, split files included.

The header (metadata and tensor table) is read by a bounded parser of our own: every count
and length it takes from the file is checked against the bytes left before anything is
allocated or read (gguf's GGUFReader builds numpy arrays straight from those counts). The
`gguf` package gives the type constants and block sizes, and `gguf.quants` the reference
dequantization of the few small tensors moerun keeps in float. Tensor data is memory-mapped
and used in place: F32/BF16 weights as views, Q8_0/Q4_0 repacked losslessly into moerun's
int8/int4 layout (the same blocks, scales moved out and groups interleaved), the raw formats
(Q4_K, Q5_K, Q6_K, Q5_0) as views of their bytes (docs/design/gguf.md).

Names and metadata are mapped in one declarative table per architecture (`ARCHS`): GGUF
metadata keys -> config.json fields, GGUF tensor names <-> moerun parameter names, and the
few transforms llama.cpp's converter applies (norm weights stored +1, -exp(A_log), rope
permutations, the Gated DeltaNet value-head order). The writer (gguf_write.py) uses the
same tables in the other direction.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import struct
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm import tqdm

from ..errors import MoerunError, one_line, short
from ..config import open_regular
from ..kernels.formats import _interleave
from ..layers.moe import Experts
from ..layers.quantized import QuantizedExperts, QuantizedLinear
from ..models import build_on_meta, module_for
from ..models.qwen3_next import fused_rows
from ..quant import KEEP_FLOAT, replace_module
from ..tokenizer import Tokenizer
from .gguf_tokenizer import spm_tokenizer
from .hf import PROGRESS_BYTES, named_dtype, target_dtype

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_STRING = 1 << 28  # a chat template or a token is far below this; a corrupt length is not
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
PAGE = mmap.PAGESIZE

# metadata value types (GGUF spec): id -> (struct format, size, kind)
SCALARS = {0: ("<B", 1, "int"), 1: ("<b", 1, "int"), 2: ("<H", 2, "int"), 3: ("<h", 2, "int"),
           4: ("<I", 4, "int"), 5: ("<i", 4, "int"), 6: ("<f", 4, "float"), 7: ("<?", 1, "bool"),
           10: ("<Q", 8, "int"), 11: ("<q", 8, "int"), 12: ("<d", 8, "float")}
STRING, ARRAY = 8, 9


def _ggml():
    import gguf

    return gguf


# GGUF tensor type name -> how moerun holds it: "float" (F32/BF16 as stored, F16 widened),
# a moerun quantized format (int8/int4: repacked; q4_k...: raw rows)
TYPE_FORMATS = {"F32": "float", "F16": "float", "BF16": "float", "Q8_0": "int8", "Q4_0": "int4",
                "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "Q5_0": "q5_0"}
RAW_FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0")  # rows kept byte for byte (moerun.kernels.ggml)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    path: Path
    type: str  # GGML type name: F32, Q8_0, ...
    shape: tuple[int, ...]  # torch order (GGUF's dims reversed)
    offset: int  # absolute, in `path`
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // max(1, _prod(self.shape[:-1]))


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


class _Bounded:
    """Reads little-endian values from a mapping, refusing to read past its end."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise MoerunError(f"{self.path} is truncated or corrupt: {what} needs {n} bytes at offset {self.pos}, "
                              f"the file has {self.size}")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.unpack("<Q", 8, what)
        if n > MAX_STRING:
            raise MoerunError(f"{self.path} is corrupt: {what} claims a string of {n} bytes")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in SCALARS:
            fmt, size, _ = SCALARS[vtype]
            return self.unpack(fmt, size, what)
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY and depth == 0:
            sub = self.unpack("<I", 4, what)
            n = self.unpack("<Q", 8, what)
            if sub not in SCALARS and sub != STRING and sub != ARRAY:
                raise MoerunError(f"{self.path} is corrupt: {what} is an array of unknown type {sub}")
            least = SCALARS[sub][1] if sub in SCALARS else 8 if sub == STRING else 12
            self.need(n * least, f"{what} ({n} values)")  # before any list is made
            if sub in SCALARS:
                fmt, size, _ = SCALARS[sub]
                vals = list(struct.unpack_from(f"<{n}{fmt[1]}", self.buf, self.pos))
                self.pos += n * size
                return _Array(sub, vals)
            return _Array(sub, [self.value(sub, what, depth + 1) for _ in range(n)])
        raise MoerunError(f"{self.path} is corrupt: {what} has unknown value type {vtype}")


class _Array(list):
    """A metadata array with its element type."""

    def __init__(self, sub: int, vals):
        super().__init__(vals)
        self.sub = sub


def _parse(path: Path) -> tuple[dict[str, tuple[int, Any]], list[GGUFTensor]]:
    """One GGUF file's metadata {key: (type, value)} and tensors, every size checked."""

    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise MoerunError(f"{path} is truncated or not a GGUF file (only {size} bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        r = _Bounded(buf, path)
        if buf[:4] != MAGIC:
            raise MoerunError(f"{path} is not a GGUF file (it starts with {short(bytes(buf[:4]))}, not b'GGUF')")
        r.pos = 4
        version = r.unpack("<I", 4, "the version")
        if version not in VERSIONS:
            raise MoerunError(f"{path} is GGUF version {version}; moerun reads versions {', '.join(map(str, VERSIONS))}")
        n_tensors = r.unpack("<Q", 8, "the tensor count")
        n_kv = r.unpack("<Q", 8, "the metadata count")
        # each metadata entry takes at least 13 bytes, each tensor entry at least 28
        if n_kv * 13 + n_tensors * 28 > size - r.pos:
            raise MoerunError(f"{path} is truncated or corrupt: it claims {n_kv} metadata entries and {n_tensors} "
                              f"tensors in a {size}-byte file")
        meta: dict[str, tuple[int, Any]] = {}
        for _ in range(n_kv):
            key = r.string("a metadata key")
            vtype = r.unpack("<I", 4, f"metadata {key!r}")
            meta[key] = (vtype, r.value(vtype, f"metadata {key!r}"))
        infos = []
        for _ in range(n_tensors):
            name = r.string("a tensor name")
            n_dims = r.unpack("<I", 4, f"tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise MoerunError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions")
            dims = [r.unpack("<Q", 8, f"tensor {name!r}") for _ in range(n_dims)]
            ttype = r.unpack("<I", 4, f"tensor {name!r}")
            offset = r.unpack("<Q", 8, f"tensor {name!r}")
            infos.append((name, dims, ttype, offset))
        align = meta.get("general.alignment", (4, DEFAULT_ALIGNMENT))[1]
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise MoerunError(f"{path} is corrupt: general.alignment is {short(align)}")
        data = -(-r.pos // align) * align
    finally:
        buf.close()
    return meta, [_tensor(path, size, data, *info) for info in infos]


def _tensor(path: Path, size: int, data: int, name: str, dims: list[int], ttype: int, offset: int) -> GGUFTensor:
    g = _ggml()
    try:
        qt = g.GGMLQuantizationType(ttype)
    except ValueError:
        raise MoerunError(f"{path}: tensor {name!r} has unknown tensor type {ttype}") from None
    block, type_size = g.GGML_QUANT_SIZES[qt]
    if dims[0] % block:
        raise MoerunError(f"{path} is corrupt: tensor {name!r} has rows of {dims[0]} values, not whole {qt.name} blocks")
    nbytes = _prod(dims[1:]) * (dims[0] // block) * type_size
    end = data + offset + nbytes
    if end > size:
        raise MoerunError(f"{path} is truncated: tensor {name!r} ends at byte {end} but the file has {size} bytes")
    return GGUFTensor(name, path, qt.name, tuple(reversed(dims)), data + offset, nbytes)


def split_paths(path: Path) -> list[Path]:
    """`X-00001-of-0000N.gguf` and its N-1 siblings (each must exist); [path] otherwise."""
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    if n < 1:
        raise MoerunError(f"{path}: a split file's count must be at least 1")
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    for p in paths:
        if not p.is_file():
            raise MoerunError(f"{path} is part {m['i']} of {n} split files, but {p.name} is missing")
    return paths


class GGUFFile:
    """The metadata and tensors of a GGUF model (one file, or all parts of a split one)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.exists():
            raise MoerunError(f"model path {self.path} does not exist")
        self.meta: dict[str, tuple[int, Any]] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        for i, p in enumerate(split_paths(self.path)):
            meta, tensors = _parse(p)
            if i == 0:
                self.meta = meta
            for t in tensors:
                if t.name in self.tensors:
                    raise MoerunError(f"{p} is corrupt: tensor {t.name!r} appears twice")
                self.tensors[t.name] = t
        self._maps: dict[Path, mmap.mmap] = {}

    # -- metadata ------------------------------------------------------------
    def get(self, key: str, kind: str, default: Any = ...):
        """Metadata `key` as `kind` ("int", "float", "bool", "str", "list[int]", "list[str]",
        "list[float]"); a missing key is `default` (an error without one), a value of another
        type an error naming the key."""
        if key not in self.meta:
            if default is ...:
                raise MoerunError(f"{self.path} lacks metadata {key!r}")
            return default
        vtype, v = self.meta[key]
        if not _is_kind(vtype, v, kind):
            raise MoerunError(f"{self.path}: metadata {key!r} is {_kind_name(vtype, v)}, expected {kind}")
        if kind == "float":  # a float32 value as the shortest decimal it came from (1e-06, not 9.99999997e-07)
            return _shortest_f32(v) if vtype == 6 else float(v)
        return list(v) if kind.startswith("list") else v

    # -- tensor data ---------------------------------------------------------
    def _map(self, path: Path) -> mmap.mmap:
        mm = self._maps.get(path)
        if mm is None:

            with open_regular(path) as f:
                try:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable views, file untouched
                except OSError as e:
                    if e.errno != errno.ENOMEM:
                        raise
                    # a file bigger than the kernel commits to one private mapping (a model bigger
                    # than RAM, under heuristic overcommit): shared and read-only; its views are
                    # only read (quantized tensors are repacked, experts go to an expert store)
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[path] = mm
        return mm

    def raw(self, t: GGUFTensor) -> torch.Tensor:
        """The tensor's bytes, uint8 [*rows, row_bytes], a view of the memory map."""
        if t.nbytes == 0:
            return torch.empty(*t.shape[:-1], 0, dtype=torch.uint8)
        with warnings.catch_warnings():  # a read-only map (above): torch warns that its views are not writable
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(self._map(t.path), dtype=torch.uint8, count=t.nbytes, offset=t.offset)
        return flat.view(*t.shape[:-1], t.row_bytes)

    def floats(self, t: GGUFTensor) -> torch.Tensor:
        """A float tensor in its own dtype (F32, F16, BF16: a view), any other type dequantized
        (gguf.quants; only for the small tensors moerun keeps in float)."""
        dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        raw = self.raw(t)
        if t.type in dtypes:
            return raw.view(dtypes[t.type]).view(t.shape)
        g = _ggml()
        try:
            out = g.quants.dequantize(raw.numpy(), g.GGMLQuantizationType[t.type])
        except NotImplementedError:
            raise MoerunError(f"{self.path}: tensor {t.name!r} has type {t.type}, which moerun does not read") from None
        return torch.from_numpy(out.copy()).view(t.shape)

    def drop_pages(self, t: GGUFTensor) -> None:
        mm = self._maps.get(t.path)
        if mm is None:
            return
        start = -(-t.offset // PAGE) * PAGE
        end = (t.offset + t.nbytes) // PAGE * PAGE
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self._maps.clear()  # mappings referenced by views stay valid until those are freed


def _shortest_f32(v: float) -> float:
    for digits in range(1, 10):
        c = float(f"{v:.{digits}g}")
        if struct.unpack("<f", struct.pack("<f", c))[0] == v:
            return c
    return v


def _is_kind(vtype: int, v, kind: str) -> bool:
    if kind.startswith("list["):
        sub = kind[5:-1]
        return vtype == ARRAY and (not v or _is_kind(v.sub, v[0], sub))
    if kind == "str":
        return vtype == STRING
    if kind == "bool":
        return vtype == 7
    if kind == "int":
        return vtype in SCALARS and SCALARS[vtype][2] == "int"
    if kind == "float":
        return vtype in SCALARS and SCALARS[vtype][2] in ("int", "float")
    return False


def _kind_name(vtype: int, v) -> str:
    if vtype == ARRAY:
        return "an array"
    if vtype == STRING:
        return f"a string ({short(v)})"
    return f"a {SCALARS[vtype][2]} ({short(v)})" if vtype in SCALARS else "of unknown type"


# -- architectures -----------------------------------------------------------------------

@dataclass(frozen=True)
class Key:
    """config field <-> metadata key `{arch}.{key}`, read as `kind` (int, float, bool)."""

    field: str
    key: str
    kind: str  # int, float, bool
    required: bool = True


# per-layer tensors shared by the architectures: moerun name after `model.layers.N.` -> GGUF
# name after `blk.N.`
ATTENTION = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{w}": f"attn_{g}.{w}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
       for w in ("weight", "bias")},
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
MOE = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",  # dense layers
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
COMMON_KEYS = (
    Key("hidden_size", "embedding_length", "int"),
    Key("num_hidden_layers", "block_count", "int"),
    Key("num_attention_heads", "attention.head_count", "int"),
    Key("rms_norm_eps", "attention.layer_norm_rms_epsilon", "float"),
    Key("max_position_embeddings", "context_length", "int"),
)
MOE_KEYS = (Key("num_experts", "expert_count", "int"), Key("num_experts_per_tok", "expert_used_count", "int"))


@dataclass(frozen=True)
class Transform:
    """How llama.cpp's converter changed a tensor, for the reader to undo (and the writer to
    redo). `rows`/`cols`: a permutation p with gguf = hf[p] along that axis (rows also apply to
    quantized rows as they are); `value`: (to_gguf, from_gguf) on float values."""

    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    value: tuple[Callable, Callable] | None = None
    # moerun rows = gguf rows[gather]: rows repeated (reader only), or one of the parameters a
    # fused GGUF tensor holds (qwen3next's ssm_ba), which the writer joins again
    gather: torch.Tensor | None = None


@dataclass(frozen=True)
class Arch:
    name: str  # GGUF general.architecture
    model_type: str  # moerun's
    keys: tuple[Key, ...]
    layer: dict[str, str]  # moerun name after `model.layers.N.` -> GGUF after `blk.N.`
    derive: Callable[["GGUFFile", dict], None]  # config fields from what the keys do not say
    write_keys: Callable[[Any], dict[str, Any]]  # writer: the metadata `derive` reads back
    transforms: dict[str, Callable[[Any], Transform]] = field(default_factory=dict)  # by moerun layer name
    mtp: Callable[[Any], dict[str, str]] | None = None  # moerun name -> GGUF name of the MTP tensors


def _heads_perm(n_heads: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's rope permutation of Q/K rows (LlamaModel.permute): each head's halves
    interleaved, for rope on adjacent pairs."""
    return torch.arange(n_heads * head_dim).view(n_heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)


def _tiled(n_k: int, n_v: int, dim: int) -> torch.Tensor:
    """Gated DeltaNet value heads grouped by key head -> tiled, as llama.cpp stores them."""
    return torch.arange(n_v * dim).view(n_k, n_v // n_k, dim).transpose(0, 1).reshape(-1)


def _has(f: "GGUFFile", name: str) -> bool:
    return name in f.tensors


def _dense_layers(f: "GGUFFile", n: int) -> list[int]:
    return [i for i in range(n) if _has(f, f"blk.{i}.ffn_gate.weight") and not _has(f, f"blk.{i}.ffn_gate_exps.weight")]


def _rope(f: "GGUFFile", a: str, cfg: dict) -> None:
    rope: dict[str, Any] = {"rope_theta": f.get(f"{a}.rope.freq_base", "float", 10000.0), "rope_type": "default"}
    kind = f.get(f"{a}.rope.scaling.type", "str", "none")
    if kind == "linear":
        rope.update(rope_type="linear", factor=f.get(f"{a}.rope.scaling.factor", "float"))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=f.get(f"{a}.rope.scaling.factor", "float"),
                    original_max_position_embeddings=f.get(f"{a}.rope.scaling.original_context_length", "int"))
        for fld, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            v = f.get(f"{a}.rope.scaling.{key}", "float", None)
            if v is not None:
                rope[fld] = v
        mult = f.get(f"{a}.rope.scaling.yarn_log_multiplier", "float", 0.0)
        if mult:
            rope["mscale_all_dim"] = mult / 0.1
            rope["mscale"] = mult / 0.1
    elif kind != "none":
        raise MoerunError(f"{f.path}: rope scaling {kind!r} is not supported (none, linear, yarn)")
    cfg["rope_parameters"] = rope


def _rope_keys(args) -> dict[str, Any]:
    rp = args.rope or {}
    out: dict[str, Any] = {"rope.freq_base": float(rp.get("rope_theta", 10000.0))}
    if rp.get("rope_type") == "linear":
        out.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(rp["factor"])})
    elif rp.get("rope_type") == "yarn":
        out.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(rp["factor"]),
                    "rope.scaling.original_context_length": int(rp["original_max_position_embeddings"])})
        for fld, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rp.get(fld) is not None:
                out[f"rope.scaling.{key}"] = float(rp[fld])
        if rp.get("mscale_all_dim"):
            out["rope.scaling.yarn_log_multiplier"] = 0.1 * float(rp["mscale_all_dim"])
    return out


def _kv_heads(f: "GGUFFile", a: str, cfg: dict) -> None:
    key = f"{a}.attention.head_count_kv"
    if key in f.meta and f.meta[key][0] == ARRAY:  # per layer (0 for linear-attention layers)
        cfg["num_key_value_heads"] = max(f.get(key, "list[int]"), default=cfg["num_attention_heads"])
    else:
        cfg["num_key_value_heads"] = f.get(key, "int", cfg["num_attention_heads"])


def _qwen3moe(f, cfg):
    a = "qwen3moe"
    _kv_heads(f, a, cfg)
    _rope(f, a, cfg)
    cfg["head_dim"] = f.get(f"{a}.attention.key_length", "int", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["norm_topk_prob"] = f.get(f"{a}.expert_weights_norm", "bool", True)  # llama.cpp always renormalises
    cfg["mlp_only_layers"] = _dense_layers(f, cfg["num_hidden_layers"])
    cfg["attention_bias"] = _has(f, "blk.0.attn_q.bias")
    cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])


def _qwen3moe_keys(args):
    return {**_rope_keys(args), "attention.head_count_kv": args.num_key_value_heads, "attention.key_length": args.head_dim,
            "attention.value_length": args.head_dim, "expert_weights_norm": args.norm_topk_prob}


def _qwen2moe(f, cfg):
    a = "qwen2moe"
    _kv_heads(f, a, cfg)
    _rope(f, a, cfg)
    cfg["norm_topk_prob"] = f.get(f"{a}.expert_weights_norm", "bool", False)
    cfg["mlp_only_layers"] = _dense_layers(f, cfg["num_hidden_layers"])
    cfg["qkv_bias"] = _has(f, "blk.0.attn_q.bias")
    cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])


def _norm_topk_keys(args):
    """qwen2moe's and olmoe's own metadata: the kv heads and whether top-k weights are renormalised."""
    return {**_rope_keys(args), "attention.head_count_kv": args.num_key_value_heads,
            "expert_weights_norm": args.norm_topk_prob}


def _llama(f, cfg):
    a = "llama"
    _kv_heads(f, a, cfg)
    _rope(f, a, cfg)
    if "num_local_experts" not in cfg:
        raise MoerunError(f"{f.path} is a dense llama model; moerun runs llama files with experts (Mixtral)")


def _llama_keys(args):
    return {**_rope_keys(args), "attention.head_count_kv": args.num_key_value_heads,
            "rope.dimension_count": args.head_dim, "vocab_size": args.vocab_size}


def _olmoe(f, cfg):
    a = "olmoe"
    _kv_heads(f, a, cfg)
    _rope(f, a, cfg)
    cfg["norm_topk_prob"] = f.get(f"{a}.expert_weights_norm", "bool", False)
    cfg["attention_bias"] = _has(f, "blk.0.attn_q.bias")


def _qwen35moe(f, cfg, a="qwen35moe"):
    _kv_heads(f, a, cfg)
    _rope(f, a, cfg)
    cfg["head_dim"] = f.get(f"{a}.attention.key_length", "int", 256)
    n_v = f.get(f"{a}.ssm.time_step_rank", "int")
    cfg["linear_num_value_heads"] = n_v
    cfg["linear_value_head_dim"] = f.get(f"{a}.ssm.inner_size", "int") // max(1, n_v)
    mtp = f.get(f"{a}.nextn_predict_layers", "int", 0)
    cfg["num_hidden_layers"] -= mtp
    cfg["mtp_num_hidden_layers"] = mtp
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = ["linear_attention" if _has(f, f"blk.{i}.ssm_a") else "full_attention" for i in range(n)]
    rot = f.get(f"{a}.rope.dimension_count", "int", cfg["head_dim"] // 4)
    cfg["rope_parameters"]["partial_rotary_factor"] = rot / cfg["head_dim"]


def _qwen3next(f, cfg):
    """Qwen3.5's keys and layer types, plus Qwen3-Next's routing and dense layers."""
    a = "qwen3next"
    _qwen35moe(f, cfg, a)
    cfg["norm_topk_prob"] = f.get(f"{a}.expert_weights_norm", "bool", True)  # llama.cpp always renormalises
    cfg["mlp_only_layers"] = _dense_layers(f, cfg["num_hidden_layers"])


def _qwen35moe_keys(args):
    return {**_qwen35_keys(args),
            "rope.dimension_sections": [*(args.rope or {}).get("mrope_section", [11, 11, 10]), 0][:4]}


def _qwen3next_keys(args):
    return {**_qwen35_keys(args), "expert_weights_norm": args.norm_topk_prob}


def _qwen35_keys(args):
    interval = next((i + 1 for i, t in enumerate(args.layer_types) if t == "full_attention"), 4)
    return {**_rope_keys(args), "attention.head_count_kv": args.num_key_value_heads, "attention.key_length": args.head_dim,
            "attention.value_length": args.head_dim, "rope.dimension_count": args.rotary_dim,
            "ssm.conv_kernel": args.linear_conv_kernel_dim,
            "ssm.state_size": args.linear_key_head_dim, "ssm.group_count": args.linear_num_key_heads,
            "ssm.time_step_rank": args.linear_num_value_heads,
            "ssm.inner_size": args.linear_value_head_dim * args.linear_num_value_heads,
            "full_attention_interval": interval, "nextn_predict_layers": args.mtp_num_hidden_layers,
            "block_count": args.num_hidden_layers + args.mtp_num_hidden_layers}


def _deepseek2(f, cfg):
    a = "deepseek2"
    _rope(f, a, cfg)
    rope_dim = f.get(f"{a}.rope.dimension_count", "int")
    cfg["qk_rope_head_dim"] = rope_dim
    cfg["kv_lora_rank"] = f.get(f"{a}.attention.kv_lora_rank", "int")
    q_rank = f.get(f"{a}.attention.q_lora_rank", "int", 0)
    cfg["q_lora_rank"] = q_rank or None
    k_mla = f.get(f"{a}.attention.key_length_mla", "int", None)
    if k_mla is None:
        k_mla = f.get(f"{a}.attention.key_length", "int")
    cfg["qk_nope_head_dim"] = k_mla - rope_dim
    cfg["v_head_dim"] = f.get(f"{a}.attention.value_length_mla", "int", None) or f.get(f"{a}.attention.value_length", "int")
    cfg["n_shared_experts"] = f.get(f"{a}.expert_shared_count", "int", 0) or None
    cfg["routed_scaling_factor"] = f.get(f"{a}.expert_weights_scale", "float", 1.0)
    cfg["first_k_dense_replace"] = f.get(f"{a}.leading_dense_block_count", "int", 0)
    cfg["norm_topk_prob"] = f.get(f"{a}.expert_weights_norm", "bool", False)
    cfg["n_group"] = f.get(f"{a}.expert_group_count", "int", 1)
    cfg["topk_group"] = f.get(f"{a}.expert_group_used_count", "int", 1)
    gating = f.get(f"{a}.expert_gating_func", "int", 2)
    if gating != 2:
        raise MoerunError(f"{f.path}: deepseek2 with expert_gating_func {gating} (softmax, DeepSeek-V2) is not "
                          "supported; moerun runs DeepSeek-V3's sigmoid routing")
    mtp = f.get(f"{a}.nextn_predict_layers", "int", 0)
    cfg["num_hidden_layers"] -= mtp
    cfg["num_nextn_predict_layers"] = mtp
    cfg["rope_interleave"] = True  # llama.cpp ropes adjacent pairs; the converter does not permute


def _deepseek2_keys(args):
    return {**_rope_keys(args), "attention.head_count_kv": 1, "rope.dimension_count": args.qk_rope_head_dim,
            "attention.kv_lora_rank": args.kv_lora_rank, "attention.q_lora_rank": args.q_lora_rank or 0,
            "attention.key_length": args.kv_lora_rank + args.qk_rope_head_dim, "attention.value_length": args.kv_lora_rank,
            "attention.key_length_mla": args.qk_nope_head_dim + args.qk_rope_head_dim,
            "attention.value_length_mla": args.v_head_dim, "expert_shared_count": args.n_shared_experts or 0,
            "expert_weights_scale": float(args.routed_scaling_factor), "leading_dense_block_count": args.first_k_dense_replace,
            "expert_weights_norm": args.norm_topk_prob, "expert_gating_func": 2, "expert_group_count": args.n_group or 1,
            "expert_group_used_count": args.topk_group or 1, "nextn_predict_layers": args.num_nextn_predict_layers,
            "block_count": args.num_hidden_layers + args.num_nextn_predict_layers}


def _plus_one() -> Transform:
    """Qwen3-Next/3.5 zero-centred RMSNorm weights: the converter stores w + 1."""
    return Transform(value=(lambda t: t.float() + 1, lambda t: t.float() - 1))


def _qwen35_transforms(tiled: bool = True) -> dict[str, Callable[[Any], Transform]]:
    """qwen35moe's converter transforms; `tiled` False: qwen3next's, whose value heads stay
    grouped by key head as moerun holds them."""
    def v_rows(head: Callable) -> Callable:
        def make(a):
            if a.linear_num_key_heads == a.linear_num_value_heads or not tiled:
                return None
            return head(a)
        return make

    def qkv(a):
        qk = 2 * a.linear_num_key_heads * a.linear_key_head_dim
        return torch.cat([torch.arange(qk), qk + _tiled(a.linear_num_key_heads, a.linear_num_value_heads,
                                                           a.linear_value_head_dim)])

    def per_head(a):
        return _tiled(a.linear_num_key_heads, a.linear_num_value_heads, 1)

    def v_dim(a):
        return _tiled(a.linear_num_key_heads, a.linear_num_value_heads, a.linear_value_head_dim)

    def a_log(a):
        return Transform(rows=v_rows(per_head)(a), value=(lambda t: -torch.exp(t.float()), lambda t: torch.log(-t.float())))

    def conv(a):  # moerun [C, 1, K] <-> GGUF [C, K]
        return Transform(rows=v_rows(qkv)(a), value=(lambda t: t.reshape(t.shape[0], -1), lambda t: t.unsqueeze(1)))

    norm = lambda a: _plus_one()  # noqa: E731
    return {
        "linear_attn.in_proj_qkv.weight": lambda a: Transform(rows=v_rows(qkv)(a)),
        "linear_attn.in_proj_z.weight": lambda a: Transform(rows=v_rows(v_dim)(a)),
        "linear_attn.in_proj_a.weight": lambda a: Transform(rows=v_rows(per_head)(a)),
        "linear_attn.in_proj_b.weight": lambda a: Transform(rows=v_rows(per_head)(a)),
        "linear_attn.dt_bias": lambda a: Transform(rows=v_rows(per_head)(a)),
        "linear_attn.A_log": a_log,
        "linear_attn.conv1d.weight": conv,
        "linear_attn.out_proj.weight": lambda a: Transform(cols=v_rows(v_dim)(a)),
        "input_layernorm.weight": norm,
        "post_attention_layernorm.weight": norm,
        "self_attn.q_norm.weight": norm,
        "self_attn.k_norm.weight": norm,
    }


def _qwen3next_transforms() -> dict[str, Callable[[Any], Transform]]:
    """As qwen35moe's without the value-head tiling; b and a are rows of one fused `ssm_ba`
    (per key head: its value heads' b, then their a), as in the HF checkpoint."""
    def rows_of(part: str) -> Callable[[Any], Transform]:
        def make(a):

            return Transform(gather=fused_rows(a)[part])
        return make

    return {**_qwen35_transforms(tiled=False), "linear_attn.in_proj_b.weight": rows_of("in_proj_b"),
            "linear_attn.in_proj_a.weight": rows_of("in_proj_a")}


def _qwen35_mtp(args, layer: dict | None = None) -> dict[str, str]:
    out = {}
    L = args.num_hidden_layers
    for k in range(args.mtp_num_hidden_layers):
        out.update({"mtp.fc.weight": f"blk.{L + k}.nextn.eh_proj.weight",
                    "mtp.pre_fc_norm_embedding.weight": f"blk.{L + k}.nextn.enorm.weight",
                    "mtp.pre_fc_norm_hidden.weight": f"blk.{L + k}.nextn.hnorm.weight",
                    "mtp.norm.weight": f"blk.{L + k}.nextn.shared_head_norm.weight"})
        out.update({f"mtp.layers.{k}.{m}": f"blk.{L + k}.{g}" for m, g in (layer or QWEN35_LAYER).items()})
    return out


def _deepseek_mtp(args) -> dict[str, str]:
    out = {}
    L = args.num_hidden_layers
    for k in range(args.num_nextn_predict_layers):
        out.update({f"mtp.{k}.eh_proj.weight": f"blk.{L + k}.nextn.eh_proj.weight",
                    f"mtp.{k}.enorm.weight": f"blk.{L + k}.nextn.enorm.weight",
                    f"mtp.{k}.hnorm.weight": f"blk.{L + k}.nextn.hnorm.weight",
                    f"mtp.{k}.shared_head.norm.weight": f"blk.{L + k}.nextn.shared_head_norm.weight"})
        out.update({f"mtp.{k}.block.{m}": f"blk.{L + k}.{g}" for m, g in DEEPSEEK_LAYER.items()})
    return out


QWEN35_LAYER = {
    **{k: v for k, v in ATTENTION.items()}, **MOE,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
# qwen3next keeps b and a fused (`ssm_ba`; split and joined by the gather transforms)
QWEN3NEXT_LAYER = {**QWEN35_LAYER, "linear_attn.in_proj_a.weight": "ssm_ba.weight",
                   "linear_attn.in_proj_b.weight": "ssm_ba.weight"}
DEEPSEEK_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",  # or split in attn_k_b / attn_v_b (`_kv_b`)
    "self_attn.o_proj.weight": "attn_output.weight",
    **{k: v for k, v in MOE.items() if "shared_expert" not in k},
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def _llama_transforms():
    return {"self_attn.q_proj.weight": lambda a: Transform(rows=_heads_perm(a.num_attention_heads, a.head_dim)),
            "self_attn.k_proj.weight": lambda a: Transform(rows=_heads_perm(a.num_key_value_heads, a.head_dim))}


ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("qwen35moe", "qwen3_5_moe_text",
         COMMON_KEYS + MOE_KEYS + (Key("moe_intermediate_size", "expert_feed_forward_length", "int"),
                                   Key("shared_expert_intermediate_size", "expert_shared_feed_forward_length", "int"),
                                   Key("linear_conv_kernel_dim", "ssm.conv_kernel", "int"),
                                   Key("linear_key_head_dim", "ssm.state_size", "int"),
                                   Key("linear_num_key_heads", "ssm.group_count", "int")),
         QWEN35_LAYER, _qwen35moe, _qwen35moe_keys,
         {**_qwen35_transforms()}, _qwen35_mtp),
    Arch("qwen3next", "qwen3_next",
         COMMON_KEYS + MOE_KEYS + (Key("moe_intermediate_size", "expert_feed_forward_length", "int"),
                                   Key("shared_expert_intermediate_size", "expert_shared_feed_forward_length", "int"),
                                   Key("intermediate_size", "feed_forward_length", "int", False),
                                   Key("linear_conv_kernel_dim", "ssm.conv_kernel", "int"),
                                   Key("linear_key_head_dim", "ssm.state_size", "int"),
                                   Key("linear_num_key_heads", "ssm.group_count", "int")),
         QWEN3NEXT_LAYER, _qwen3next, _qwen3next_keys, _qwen3next_transforms(),
         lambda args: _qwen35_mtp(args, QWEN3NEXT_LAYER)),
    Arch("qwen3moe", "qwen3_moe",
         COMMON_KEYS + MOE_KEYS + (Key("moe_intermediate_size", "expert_feed_forward_length", "int"),
                                   Key("intermediate_size", "feed_forward_length", "int", False)),
         {**ATTENTION, **MOE}, _qwen3moe, _qwen3moe_keys),
    Arch("qwen2moe", "qwen2_moe",
         COMMON_KEYS + MOE_KEYS + (Key("moe_intermediate_size", "expert_feed_forward_length", "int"),
                                   Key("shared_expert_intermediate_size", "expert_shared_feed_forward_length", "int"),
                                   Key("intermediate_size", "feed_forward_length", "int", False)),
         {**ATTENTION, **MOE}, _qwen2moe, _norm_topk_keys),
    Arch("llama", "mixtral",
         COMMON_KEYS + (Key("num_local_experts", "expert_count", "int", False),
                        Key("num_experts_per_tok", "expert_used_count", "int", False),
                        Key("intermediate_size", "feed_forward_length", "int")),
         {**ATTENTION, **MOE}, _llama, _llama_keys, _llama_transforms()),
    Arch("olmoe", "olmoe",
         COMMON_KEYS + MOE_KEYS + (Key("intermediate_size", "expert_feed_forward_length", "int"),),
         {**ATTENTION, **MOE}, _olmoe, _norm_topk_keys),
    Arch("deepseek2", "deepseek_v3",
         COMMON_KEYS + (Key("n_routed_experts", "expert_count", "int"), Key("num_experts_per_tok", "expert_used_count", "int"),
                        Key("moe_intermediate_size", "expert_feed_forward_length", "int"),
                        Key("intermediate_size", "feed_forward_length", "int")),
         DEEPSEEK_LAYER, _deepseek2, _deepseek2_keys, mtp=_deepseek_mtp),
)}
MODEL_TYPES = {"qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next",
               "qwen3_moe": "qwen3moe",
               "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe", "deepseek_v3": "deepseek2"}


ZERO_CENTRED = ("qwen35moe", "qwen3next")  # every RMSNorm but the gated one stored w + 1


def arch_of(f: GGUFFile) -> Arch:
    name = f.get("general.architecture", "str")
    if name not in ARCHS:
        raise MoerunError(f"{f.path} holds architecture {short(name)}, which moerun does not run; "
                          f"supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[name]


def config_of(f: GGUFFile, arch: Arch) -> dict:
    """A config.json-like dict for the architecture's ModelArgs, from the file's metadata."""
    cfg: dict[str, Any] = {"model_type": arch.model_type}
    for k in arch.keys:
        v = f.get(f"{arch.name}.{k.key}", k.kind, ... if k.required else None)
        if v is not None:
            cfg[k.field] = v
    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise MoerunError(f"{f.path} is missing tensor 'token_embd.weight'")
    cfg["vocab_size"] = emb.shape[0]
    cfg["tie_word_embeddings"] = "output.weight" not in f.tensors
    arch.derive(f, cfg)
    return cfg


def gguf_names(net: nn.Module, arch: Arch) -> dict[str, str]:
    """moerun parameter name (float model) -> GGUF tensor name, for every tensor of `net`."""
    names = {}
    mtp = arch.mtp(net.args) if arch.mtp is not None else {}
    for name in net.state_dict(keep_vars=True):
        if name in GLOBAL:
            names[name] = GLOBAL[name]
        elif name in mtp:
            names[name] = mtp[name]
        else:
            m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
            if m and m[2] in arch.layer:
                names[name] = f"blk.{m[1]}.{arch.layer[m[2]]}"
            else:
                raise RuntimeError(f"no GGUF name for {name} ({arch.name})")  # a table of ours is incomplete
    return names


def transform_of(arch: Arch, name: str, args, overrides: dict | None = None) -> Transform | None:
    """The converter's transform for moerun parameter `name` (None: stored as it is);
    `overrides`: the reader's own, by layer name (`_expanded_key_heads`)."""
    m = re.match(r"^(?:model\.layers\.\d+|mtp\.layers\.\d+|mtp\.\d+\.block)\.(.+)$", name)
    key = m[1] if m else None
    if overrides is not None and key in overrides:
        return overrides[key]
    if key is None and arch.name in ZERO_CENTRED and name.startswith("mtp.") and "norm" in name:
        return _plus_one()  # the MTP head's own norms (pre_fc_norm_* too: the converter's enorm/hnorm)
    if key is None and arch.name in ZERO_CENTRED and name == "model.norm.weight":
        return _plus_one()
    make = arch.transforms.get(key) if key else None
    return make(args) if make else None


def file_summary(path) -> dict:
    """What `moerun info` says of a GGUF file (all parts of a split one): its architecture
    name and each tensor type's bytes, largest first."""
    f = GGUFFile(path)
    try:
        types: dict[str, int] = {}
        for t in f.tensors.values():
            types[t.type] = types.get(t.type, 0) + t.nbytes
        return {"architecture": f.get("general.architecture", "str"),
                "tensor_bytes": dict(sorted(types.items(), key=lambda kv: -kv[1]))}
    finally:
        f.close()


# -- building a net from a GGUF file --------------------------------------------------------

def is_gguf(path) -> bool:
    return path is not None and str(path).endswith(".gguf") and not Path(path).is_dir()


def _resolve_dtype(dtype, f: GGUFFile) -> torch.dtype:

    if named_dtype(dtype) is not None:
        return named_dtype(dtype)
    return torch.bfloat16 if any(t.type == "BF16" for t in f.tensors.values()) else torch.float32


def build(path, dtype="auto", prepare=None, check_weights: bool = False):
    """Like `loaders.hf.build` for a GGUF file: (architecture module, args, net, dtype)."""

    f = GGUFFile(path)
    try:
        arch = arch_of(f)
        cfg = config_of(f, arch)
        overrides = _expanded_key_heads(f, cfg) if arch.name == "qwen35moe" else None
        module = module_for(cfg["model_type"])
        args = module.ModelArgs.from_dict(cfg)
        try:
            net = build_on_meta(module, args)
        except (ValueError, TypeError, KeyError, IndexError, ArithmeticError) as e:
            raise MoerunError(f"{f.path}: its metadata is not valid for {arch.name}: {one_line(e)}") from None
        names = gguf_names(net, arch)
        if arch.name == "qwen3next":
            overrides = _fused_ssm_in(f, names, args)
        _drop_missing_mtp(net, names, f)
        dtype = _resolve_dtype(dtype, f)
        if check_weights:
            _check_finite(f)
        if prepare is not None:
            prepare(net)
        _load(net, arch, f, names, dtype, overrides)
    finally:
        f.close()
    left = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left unmaterialized after loading: {left[:5]}")
    net.requires_grad_(False).eval()
    return module, args, net, dtype


EXPAND_KEY_HEADS = "auto"  # "always": tests run the expanded form on files that do not need it


def _expanded_key_heads(f: GGUFFile, cfg: dict) -> dict | None:
    """qwen35moe with fewer key than value heads stores the value heads tiled (value head j
    reads key head j % n_k; moerun's Gated DeltaNet groups them: j // r). Undoing that moves
    `ssm_out`'s columns, which a K-quant's super-blocks (256 wide, heads of 128) cannot do
    losslessly. Then the file's order is kept and every value head gets its own key head: the
    q and k rows (and conv channels) repeated r times, a copy of those rows' bytes, no
    dequantization. Returns the reader's transforms for that form (cfg changed to match), or
    None where the permutation at load is exact."""
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if n_k == n_v:
        return None
    g = _ggml()
    blocks = {g.GGML_QUANT_SIZES[g.GGMLQuantizationType[t.type]][0]
              for n, t in f.tensors.items() if n.endswith("ssm_out.weight")}
    if EXPAND_KEY_HEADS != "always" and all(dv % b == 0 for b in blocks):
        return None
    r = n_v // n_k
    qk = torch.arange(n_k * dk).repeat(r)  # tiled: key head j % n_k for value head j
    gather = torch.cat([qk, n_k * dk + qk, 2 * n_k * dk + torch.arange(n_v * dv)])
    cfg["linear_num_key_heads"] = n_v
    unsqueeze = (lambda t: t, lambda t: t.unsqueeze(1))
    a_log = (lambda t: t, lambda t: torch.log(-t.float()))
    return {"linear_attn.in_proj_qkv.weight": Transform(gather=gather),
            "linear_attn.conv1d.weight": Transform(gather=gather, value=unsqueeze),
            "linear_attn.in_proj_z.weight": None, "linear_attn.in_proj_a.weight": None,
            "linear_attn.in_proj_b.weight": None, "linear_attn.dt_bias": None,
            "linear_attn.A_log": Transform(value=a_log), "linear_attn.out_proj.weight": None}


def _fused_ssm_in(f: GGUFFile, names: dict[str, str], args) -> dict | None:
    """Files from llama.cpp's first qwen3next converter hold the checkpoint's in_proj_qkvz as
    it is (`ssm_in`), where later ones split it into attn_qkv and attn_gate: in_proj_qkv and
    in_proj_z are then its rows, the ones the HF loader takes (`names` changed to match);
    the reader's transforms for that form, or None."""

    fused = False
    for name, g in names.items():
        if g.endswith((".attn_qkv.weight", ".attn_gate.weight")) and g not in f.tensors:
            alt = g.split(".")[0] + "." + g.split(".")[1] + ".ssm_in.weight"
            if alt in f.tensors:
                names[name], fused = alt, True
    if not fused:
        return None
    rows = fused_rows(args)
    return {"linear_attn.in_proj_qkv.weight": Transform(gather=rows["in_proj_qkv"]),
            "linear_attn.in_proj_z.weight": Transform(gather=rows["in_proj_z"])}


def _drop_missing_mtp(net, names: dict[str, str], f: GGUFFile) -> None:
    if getattr(net, "mtp", None) is None or "mtp" not in getattr(net, "optional_submodules", ()):
        return
    mine = [n for n in names if n.startswith("mtp.")]
    if mine and not any(names[n] in f.tensors for n in mine):
        net.mtp = None if not isinstance(net.mtp, nn.ModuleList) else nn.ModuleList()
        for n in mine:
            del names[n]


def _check_finite(f: GGUFFile) -> None:
    for t in f.tensors.values():
        if t.type in ("F32", "F16", "BF16") and not bool(torch.isfinite(f.floats(t)).all()):
            raise MoerunError(f"tensor {t.name!r} in {t.path.name} holds NaN or infinite values")


def _load(net: nn.Module, arch: Arch, f: GGUFFile, names: dict[str, str], dtype: torch.dtype,
          overrides: dict | None = None) -> None:

    modules = dict(net.named_modules())
    expected = net.state_dict(keep_vars=True)
    done: set[str] = set()
    total = sum(t.nbytes for t in f.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", file=sys.stderr,
              disable=total < PROGRESS_BYTES, leave=False) as bar:
        for name, p in expected.items():
            if name in done:
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = modules.get(owner_name)
            t = _source(f, names, name, net)
            if t is None:  # tied to the embedding
                continue
            fmt = TYPE_FORMATS.get(t.type)
            if fmt is None and t.type not in ("F32", "F16", "BF16") and not _keeps_float(name):
                raise MoerunError(f"{f.path}: tensor {t.name!r} has type {t.type}, which moerun does not run "
                                  f"(it runs {', '.join(TYPE_FORMATS)})")
            if fmt not in (None, "float") and not _keeps_float(name):
                if isinstance(owner, nn.Linear) and leaf == "weight":
                    _quantized_linear(net, owner_name, owner, arch, f, names, t, fmt, done, overrides)
                    bar.update(t.nbytes)
                    continue
                if _is_experts(owner):
                    _quantized_experts(net, owner_name, owner, arch, f, names, done)
                    continue
                if isinstance(owner, nn.Embedding):
                    _quantized_embedding(net, owner_name, owner, f, t, dtype)
                    done.add(name)
                    continue
            w = _float(f, t, arch, name, net.args, tuple(p.shape), overrides).to(target_dtype(net, name, p, dtype))
            _assign(owner, leaf, w)
            if w.data_ptr() != f.raw(t).data_ptr():  # a copy: the file's pages are not needed
                f.drop_pages(t)
            done.add(name)
            bar.update(t.nbytes)
    _tie(net)


def _keeps_float(name: str) -> bool:

    owner = name.rpartition(".")[0]
    return owner.rpartition(".")[2] in KEEP_FLOAT or "conv1d" in name or name.endswith(("A_log", "dt_bias", "norm.weight"))


def _is_experts(m) -> bool:

    return isinstance(m, Experts)


def _source(f: GGUFFile, names: dict[str, str], name: str, net) -> GGUFTensor | None:
    g = names[name]
    t = f.tensors.get(g)
    if t is not None:
        return t
    if name == "lm_head.weight" and getattr(net.args, "tie_word_embeddings", False):
        return None
    if g.endswith("attn_kv_b.weight") and g.replace("attn_kv_b", "attn_k_b") in f.tensors:
        return f.tensors[g.replace("attn_kv_b", "attn_k_b")]  # split form; `_float` joins it
    raise MoerunError(f"{f.path} is missing tensor {g!r} (needed for {name})")


def _float(f: GGUFFile, t: GGUFTensor, arch: Arch, name: str, args, shape: tuple, overrides=None) -> torch.Tensor:
    """Parameter `name` as a float tensor of `shape`, the converter's transforms undone."""
    if t.name.endswith("attn_k_b.weight"):
        return _join_kv_b(f, t, args, shape)
    w = f.floats(t)
    if w.dtype == torch.float16:
        w = w.float()  # F16 is widened (exact)
    tr = transform_of(arch, name, args, overrides)
    if tr is not None:
        if tr.value is not None:
            w = tr.value[1](w)
        if tr.gather is not None:
            w = w[tr.gather]
        if tr.rows is not None:
            w = w[torch.argsort(tr.rows)]
        if tr.cols is not None:
            w = w[:, torch.argsort(tr.cols)]
    if tuple(w.shape) != shape and _squeezed(w.shape) == _squeezed(shape):
        w = w.reshape(shape)  # e.g. llama.cpp's 1-D ffn_gate_inp_shexp for a [1, H] weight
    if tuple(w.shape) != shape:
        raise MoerunError(f"{f.path}: tensor {t.name!r} has shape {list(w.shape)}, but the metadata implies {list(shape)}")
    return w


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _join_kv_b(f: GGUFFile, k_b: GGUFTensor, args, shape) -> torch.Tensor:
    """DeepSeek's kv_b_proj from llama.cpp's split form: attn_k_b [heads, rank, nope] (the
    nope rows transposed) and attn_v_b [heads, v, rank]."""
    v_b = f.tensors.get(k_b.name.replace("attn_k_b", "attn_v_b"))
    if v_b is None:
        raise MoerunError(f"{f.path} is missing tensor {k_b.name.replace('attn_k_b', 'attn_v_b')!r}")
    n, r = args.num_attention_heads, args.kv_lora_rank
    k = f.floats(k_b).float().reshape(n, r, args.qk_nope_head_dim).transpose(1, 2)
    v = f.floats(v_b).float().reshape(n, args.v_head_dim, r)
    return torch.cat([k, v], 1).reshape(shape)


def _assign(owner: nn.Module, leaf: str, t: torch.Tensor) -> None:
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    else:
        owner._buffers[leaf] = t


def _repack(raw: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0/Q4_0 rows [..., nb * (2 + per)] -> moerun (qweight, scales): the same
    blocks, their fp16 scales moved to their own array and groups of 8 interleaved."""

    per = 16 if fmt == "int4" else 32
    b = raw.reshape(*raw.shape[:-1], -1, 2 + per)
    scales = b[..., :2].contiguous().view(torch.float16).squeeze(-1)
    q = b[..., 2:]
    if fmt == "int8":
        q = q.view(torch.int8)
    return _interleave(q), scales.contiguous()


def _quant_rows(f: GGUFFile, t: GGUFTensor, arch: Arch, name: str, args, overrides=None) -> torch.Tensor:
    """A quantized tensor's rows (uint8 [..., rows, row_bytes]) with row/column transforms
    undone: rows move whole; a column permutation moves whole blocks where heads are whole
    blocks."""
    raw = f.raw(t)
    tr = transform_of(arch, name, args, overrides)
    if tr is None:
        return raw
    if tr.value is not None:
        raise MoerunError(f"{f.path}: tensor {t.name!r} is quantized ({t.type}); moerun reads it only in float")
    if tr.gather is not None:
        raw = raw[..., tr.gather, :]
    if tr.rows is not None:
        raw = raw[..., torch.argsort(tr.rows), :]
    if tr.cols is not None:
        g = _ggml()
        block, size = g.GGML_QUANT_SIZES[g.GGMLQuantizationType[t.type]]
        inv = torch.argsort(tr.cols)
        blocks = inv.view(-1, block)
        if not bool((blocks == blocks[:, :1] + torch.arange(block)).all()) or bool((blocks[:, 0] % block).any()):
            raise MoerunError(f"{f.path}: tensor {t.name!r} ({t.type}) has its value heads reordered across blocks; "
                              "moerun cannot undo that without dequantizing")
        order = blocks[:, 0] // block
        raw = raw.reshape(*raw.shape[:-1], -1, size)[..., order, :].reshape(raw.shape)
    return raw.contiguous()


def _quantized_linear(net, owner_name, lin: nn.Linear, arch, f, names, t, fmt, done, overrides) -> None:

    name = f"{owner_name}.weight"
    rows = _quant_rows(f, t, arch, name, net.args, overrides)
    if tuple(rows.shape[:-1]) != (lin.out_features,):
        raise MoerunError(f"{f.path}: tensor {t.name!r} has {rows.shape[0]} rows, the metadata implies {lin.out_features}")
    new = _new_module(f, t, lambda: QuantizedLinear(lin.in_features, lin.out_features, fmt, bias=lin.bias is not None))
    _fill(new, ("qweight", "scales"), rows, fmt)
    if fmt not in RAW_FORMATS:  # repacked: the file's pages are not needed (nor counted in RSS)
        f.drop_pages(t)
    if lin.bias is not None:
        bias_name = f"{owner_name}.bias"
        bt = _source(f, names, bias_name, net)
        new.bias = _float(f, bt, arch, bias_name, net.args, (lin.out_features,), overrides).float().clone()
        done.add(bias_name)
    replace_module(net, owner_name, new)
    done.add(name)


def _new_module(f: GGUFFile, t: GGUFTensor, make):
    """A quantized module on the meta device (its buffers are assigned next)."""
    try:
        with torch.device("meta"):
            return make()
    except ValueError as e:  # rows that are no whole number of the type's blocks
        raise MoerunError(f"{f.path}: tensor {t.name!r} ({t.type}): {e}") from None


def _fill(mod: nn.Module, bufs: tuple[str, str], rows: torch.Tensor, fmt: str) -> None:
    if fmt in RAW_FORMATS:
        q, s = rows, torch.empty(*rows.shape[:-1], 0, dtype=torch.float16)
    else:
        q, s = _repack(rows, fmt)
    mod._buffers[bufs[0]], mod._buffers[bufs[1]] = q, s


def _quantized_experts(net, owner_name, ex, arch, f, names, done) -> None:

    E, I, H = ex.gate_proj.shape
    ts = {p: _source(f, names, f"{owner_name}.{p}_proj", net) for p in ("gate", "up", "down")}
    fmts = {p: TYPE_FORMATS.get(t.type) for p, t in ts.items()}
    if fmts["gate"] != fmts["up"] or "float" in fmts.values() or None in fmts.values():
        raise MoerunError(f"{f.path}: the experts of {owner_name} mix types "
                          f"{', '.join(t.type for t in ts.values())}; moerun needs gate and up in one quantized type")
    kw = {} if fmts["down"] == fmts["gate"] else {"down_fmt": fmts["down"]}
    new = _new_module(f, ts["down"], lambda: QuantizedExperts(E, H, I, fmts["gate"], **kw))
    for p, t in ts.items():
        rows = _quant_rows(f, t, arch, f"{owner_name}.{p}_proj", net.args)
        _fill(new, (f"{p}_q", f"{p}_scales"), rows, fmts[p])
        if fmts[p] not in RAW_FORMATS:  # repacked: the file's pages are not needed
            f.drop_pages(t)
        done.add(f"{owner_name}.{p}_proj")
    replace_module(net, owner_name, new)


class GgmlEmbedding(nn.Module):
    """Token embeddings kept in their GGUF blocks: only the looked-up rows are dequantized
    (gguf.quants). `probe`, an empty float tensor, carries the output dtype (it becomes float32
    with the rest of a quantized net's float tensors, `quant.compute_in_float32`)."""

    def __init__(self, rows: torch.Tensor, ggml_type: str, dim: int, dtype: torch.dtype):
        super().__init__()
        self.ggml_type, self.embedding_dim = ggml_type, dim
        self.num_embeddings = rows.shape[0]
        self.register_buffer("qweight", rows)
        self.register_buffer("probe", torch.empty(0, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g = _ggml()
        rows = self.qweight[ids.reshape(-1)].numpy()
        out = g.quants.dequantize(rows, g.GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(out).to(self.probe.dtype).view(*ids.shape, self.embedding_dim)


def _quantized_embedding(net, owner_name, emb: nn.Embedding, f, t, dtype) -> None:

    replace_module(net, owner_name, GgmlEmbedding(f.raw(t), t.type, emb.embedding_dim, dtype))
    if getattr(net.args, "tie_word_embeddings", False) and isinstance(getattr(net, "lm_head", None), nn.Linear):
        fmt = TYPE_FORMATS[t.type]
        lin = net.lm_head

        new = _new_module(f, t, lambda: QuantizedLinear(lin.in_features, lin.out_features, fmt))
        _fill(new, ("qweight", "scales"), f.raw(t), fmt)
        net.lm_head = new


def _tie(net) -> None:
    """lm_head from the embedding when the file has no output.weight (float embeddings)."""
    lm = getattr(net, "lm_head", None)
    if isinstance(lm, nn.Linear) and lm.weight.is_meta and getattr(net.args, "tie_word_embeddings", False):
        emb = net.model.embed_tokens
        if isinstance(emb, nn.Embedding):
            lm.weight = emb.weight


# -- tokenizer -----------------------------------------------------------------------------

# tokenizer.ggml.pre -> the pre-tokenizer regexes (split, in order) before byte-level mapping
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK3_REGEXES = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
                     r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str, ...] | None] = {
    "gpt-2": None, "gpt2": None, "olmo": None,  # None: the byte-level pre-tokenizer's own (GPT-2) regex
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"),  # llama.cpp's fallback
    "qwen2": (QWEN2_REGEX,), "qwen35": (QWEN35_REGEX,), "llama-bpe": (LLAMA3_REGEX,), "llama3": (LLAMA3_REGEX,),
    "deepseek-v3": DEEPSEEK3_REGEXES,
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class UnsupportedTokenizer(MoerunError):
    """The file's tokenizer is of a kind moerun cannot build: the weights still run (`bench`,
    `info`, token ids), text generation says why it cannot."""


def tokenizer_from_gguf(f: GGUFFile):
    """A moerun Tokenizer (tokenizers BPE, special tokens, chat template) from the file's
    tokenizer.ggml.* keys; None when the file has no tokenizer. SentencePiece ('llama')
    vocabularies: gguf_tokenizer.py."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers


    kind = f.get("tokenizer.ggml.model", "str", None)
    if kind is None:
        return None
    if kind == "llama":

        return spm_tokenizer(f, UnsupportedTokenizer)
    if kind != "gpt2":
        raise UnsupportedTokenizer(f"{f.path}: tokenizer model {short(kind)} is not supported (moerun reads byte-level "
                                   "BPE, 'gpt2', and SentencePiece, 'llama')")
    pre = f.get("tokenizer.ggml.pre", "str", "default")
    if pre not in PRE_TOKENIZERS:
        raise MoerunError(f"{f.path}: pre-tokenizer {short(pre)} is not supported; supported: "
                          f"{', '.join(sorted(PRE_TOKENIZERS))}")
    tokens = f.get("tokenizer.ggml.tokens", "list[str]")
    merges = f.get("tokenizer.ggml.merges", "list[str]", [])
    types = f.get("tokenizer.ggml.token_type", "list[int]", [1] * len(tokens))
    if len(types) != len(tokens):
        raise MoerunError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise MoerunError(f"{f.path}: tokenizer merge {short(m)} is not two tokens")
        pairs.append((a, b))
    tok = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=pre in ("llama-bpe", "llama3")))
    regexes = PRE_TOKENIZERS[pre]
    if regexes is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        from tokenizers import Regex

        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])

    def text(key):
        i = f.get(f"tokenizer.ggml.{key}_token_id", "int", None)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    template = f.get("tokenizer.chat_template", "str", None)
    return Tokenizer.from_parts(tok, template, bos=text("bos"), eos=text("eot") or text("eos"),
                                add_bos=f.get("tokenizer.ggml.add_bos_token", "bool", False))


# control tokens that end a generation whatever the file's eos/eot ids say (llama.cpp
# treats them so too): a chat model's end-of-turn marker
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>",
               "<｜end▁of▁sentence｜>", "<|EOT|>")


def generation_config(f: GGUFFile) -> dict:
    """The end-of-text ids (eos, eot, and end-of-turn control tokens), as
    generation_config.json's eos_token_id."""
    ids = {f.get(f"tokenizer.ggml.{k}_token_id", "int", None) for k in ("eos", "eot")} - {None}
    tokens = f.get("tokenizer.ggml.tokens", "list[str]", [])
    types = f.get("tokenizer.ggml.token_type", "list[int]", [])
    ids |= {i for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL and t in END_OF_TURN}
    gen: dict[str, Any] = {"eos_token_id": sorted(ids)} if ids else {}
    for field_name, key, kind in SAMPLING:
        v = f.get(f"general.sampling.{key}", kind, None)
        if v is not None:
            gen[field_name] = v
            gen["do_sample"] = True
    return gen


# generation_config.json sampling field <-> general.sampling.* (llama.cpp's defaults)
SAMPLING = (("temperature", "temp", "float"), ("top_k", "top_k", "int"), ("top_p", "top_p", "float"),
            ("min_p", "min_p", "float"), ("repetition_penalty", "penalty_repeat", "float"))
