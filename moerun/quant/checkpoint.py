"""Quantized checkpoints: `moerun quantize` writes them, the loader reads them back.

A quantized checkpoint is a Hugging Face-style directory: safetensors shard(s), config.json
with a `quantization` entry, the tokenizer and generation files. Tensor names are moerun's
module names (the model's `checkpoint_renames` applied, experts stacked `[E, out, in]`):
a quantized linear `X` is stored as `X.qweight` (packed blocks), `X.scales` (fp16, one per
block of 32) and `X.bias` (fp32, if any) where the float checkpoint had `X.weight`; routed
experts `Y` as `Y.{gate,up,down}_q` and `Y.{gate,up,down}_scales` where it had
`Y.{gate,up,down}_proj`. Every other tensor keeps the float dtype it was loaded in. The
blocks are in the layout `formats` documents and the kernels stream, so loading maps the
file and uses them in place: nothing is re-quantized and no float copy of a quantized
weight ever exists.

config.json's entry:

    "quantization": {"format_version": 1, "quant_method": "moerun", "group_size": 32,
                     "scale_dtype": "float16", "symmetric": true,
                     "components": {"experts": "int4", "shared_experts": "int8", ...},
                     "modules": {"model.layers.0.mlp.experts": "int4", ...}}

`modules` holds each module's format as written: a raw GGUF format (`q4_k`, `q6_k`, ...: the
module's `qweight` rows are its GGUF blocks and `scales` is empty) where the policy's format
fell back to another for the module's row width (`formats.fit`), the fallback, and for routed
experts whose down projection has another format than gate/up, `gate_up/down` (`q5_0/int8`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import read_config
from ..errors import MoerunError
from . import QuantPolicy, component_of, policy_name, quantize_model, replace_module, resolve_policy
from .formats import FORMATS, GROUP

# 2: whole groups of 8 blocks stored word-interleaved (formats.py); version 1 files, whose
# blocks were all natural, are refused with the advice to re-run `moerun quantize`
FORMAT_VERSION = 2
SHARD_BYTES = 2 << 30
# besides the weights and config.json, the files a model directory needs to be used
COPIED = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken",
          "chat_template*", "preprocessor_config.json", "generation_config.json", "LICENSE*", "*.md")


def stored_policy(model_dir) -> QuantPolicy | None:
    """The policy a checkpoint was written with by `moerun quantize`; None for a float one."""
    if not (Path(model_dir) / "config.json").is_file():
        return None  # not a model directory: the loader says what is wrong with it
    entry = read_config(Path(model_dir)).get("quantization")
    return None if entry is None else _check_entry(entry)


def _check_entry(entry) -> QuantPolicy:
    if not isinstance(entry, dict) or entry.get("format_version") != FORMAT_VERSION:
        version = entry.get("format_version") if isinstance(entry, dict) else None
        raise MoerunError(f"config.json's quantization entry has format_version {version!r}; "
                          f"this moerun reads version {FORMAT_VERSION} (re-run `moerun quantize`)")
    if entry.get("group_size") != GROUP:
        raise MoerunError(f"config.json's quantization entry has group_size {entry.get('group_size')!r}; moerun uses {GROUP}")
    modules = entry.get("modules")
    if not isinstance(modules, dict) or not all(isinstance(f, str) and _split(f) for f in modules.values()):
        raise MoerunError(f"config.json's quantization entry needs `modules`: module name -> one of {', '.join(FORMATS)}")
    try:
        return QuantPolicy(**entry.get("components", {}))
    except (TypeError, ValueError) as e:
        raise MoerunError(f"config.json's quantization entry has bad components: {e}") from None


def _split(f: str) -> tuple[str, str] | None:
    """A `modules` entry as (format, down projection's format); None if it names no format."""
    up, _, down = f.partition("/")
    down = down or up
    return (up, down) if up in FORMATS and down in FORMATS else None


def make_quantized_modules(net: torch.nn.Module, entry) -> None:
    """On the meta-device `net`: swap every module the entry names for an empty quantized
    one, whose packed buffers the loader then reads from the checkpoint."""
    from ..layers.moe import Experts
    from .modules import QuantizedExperts, QuantizedLinear

    _check_entry(entry)
    for name, fmt in entry["modules"].items():
        try:
            mod = net.get_submodule(name)
        except AttributeError:
            raise MoerunError(f"config.json's quantization entry names module {name!r}, which this model does not have") from None
        with torch.device("meta"):
            fmt, down_fmt = _split(fmt)
            if isinstance(mod, Experts):
                E, I, H = mod.gate_proj.shape
                new = QuantizedExperts(E, H, I, fmt, down_fmt)
            elif isinstance(mod, torch.nn.Linear) and fmt == down_fmt:
                new = QuantizedLinear(mod.in_features, mod.out_features, fmt, bias=mod.bias is not None)
            else:
                raise MoerunError(f"config.json's quantization entry names {name!r}, which is not a linear or experts module")
        replace_module(net, name, new)


def quantize_at_load(net: torch.nn.Module, model_dir, quant) -> None:
    """`quant=` / `--quant` of `moerun.load`: quantize a float checkpoint's modules; on one
    written by `moerun quantize`, the same policy is a no-op and another one an error."""
    try:
        policy = resolve_policy(None if quant == "none" else quant)
    except ValueError as e:
        raise MoerunError(str(e)) from None
    if policy is None:
        return
    stored = stored_policy(model_dir)
    if stored is None:
        quantize_model(net, policy)
    elif stored != policy:
        raise MoerunError(f"{model_dir} was written quantized with policy {policy_name(stored)}; it cannot be loaded as "
                          f"{policy_name(policy)} (drop --quant, or quantize the float checkpoint)")


def quantize_checkpoint(src, out, policy, dtype="auto", force: bool = False, shard_bytes: int = SHARD_BYTES) -> dict:
    """Write checkpoint `src` quantized by `policy` as the directory `out`; returns a summary.

    Module by module: each quantized module's float weights are read, quantized and
    dropped before the next is read, and each shard is written once it holds
    `shard_bytes`, so memory holds one module's float weights plus one shard. Everything
    goes to a temporary directory beside `out`, renamed to `out` at the end.
    """
    from ..loaders.hf import open_model, plan_state
    from ..loaders.safetensors import file_bytes

    src, out = Path(src), Path(out)
    try:
        policy = resolve_policy(policy)
    except ValueError as e:
        raise MoerunError(str(e)) from None
    if policy is None or not any(asdict(policy).values()):
        raise MoerunError("the policy quantizes nothing (every component is none)")
    _check_output(src, out, force)
    if (src / "config.json").is_file() and "quantization" in read_config(src):
        raise MoerunError(f"{src} is already a quantized checkpoint; quantize the float checkpoint instead")
    _, _, net, ckpt, dtype, renames = open_model(src, dtype)
    plan = plan_state(net, ckpt, renames)  # drops an MTP head the checkpoint lacks before targets are picked
    targets = {}
    for name, mod in net.named_modules():
        comp = component_of(name, mod)
        if comp is not None and getattr(policy, comp) is not None:
            targets[name] = getattr(policy, comp)
    if not targets:
        raise MoerunError(f"policy {policy_name(policy)} quantizes none of this model's modules")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
        shards = _Shards(tmp, ckpt, shard_bytes)
        _write_tensors(net, ckpt, plan, targets, dtype, shards)
        shards.finish()
        _write_config(src, tmp, policy, targets, dtype)
        for pattern in COPIED:
            for f in src.glob(pattern):
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ckpt.close()
    counts: dict[str, int] = {}
    for name in targets:
        comp = component_of(name, net.get_submodule(name))
        counts[comp] = counts.get(comp, 0) + 1
    return {"output": str(out), "policy": policy_name(policy), "modules": counts,
            "bytes": file_bytes(out), "source_bytes": file_bytes(src), "dtype": str(dtype).removeprefix("torch.")}


def _check_output(src: Path, out: Path, force: bool) -> None:
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents or o in s.parents:
        raise MoerunError(f"the output {out} must not be the input directory, inside it, or around it")
    if out.exists() and not out.is_dir():
        raise MoerunError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MoerunError(f"{out} exists and is not empty (pass --force to replace it)")


def _write_tensors(net, ckpt, plan, targets: dict[str, str], dtype, shards: "_Shards") -> None:
    from ..layers.moe import Experts
    from ..loaders.hf import PROGRESS_BYTES, materialize, target_dtype
    from .modules import QuantizedExperts, QuantizedLinear

    metas = {name: p for name, p, _ in plan}
    sources = {name: srcs for name, _, srcs in plan}

    def load(name):
        srcs = sources[name]
        srcs = sources[srcs] if isinstance(srcs, str) else srcs  # tied: read what it is tied to
        p = metas[name]
        return materialize(ckpt, srcs, tuple(p.shape), target_dtype(net, name, p, dtype), name), srcs

    total = sum(r.nbytes for _, _, srcs in plan if not isinstance(srcs, str) for r in srcs)
    done = set()
    with tqdm(total=total, unit="B", unit_scale=True, desc="quantizing", file=sys.stderr,
              disable=total < PROGRESS_BYTES) as bar:
        for name, _, srcs in plan:
            owner = name.rpartition(".")[0]
            if owner in targets:
                if owner in done:
                    continue
                done.add(owner)
                mod = net.get_submodule(owner)
                loaded = {k: load(f"{owner}.{k}") for k in mod.state_dict(keep_vars=True)}
                mod.load_state_dict({k: t for k, (t, _) in loaded.items()}, assign=True)
                fmt = targets[owner]
                q = (QuantizedExperts.from_experts(mod, fmt) if isinstance(mod, Experts)
                     else QuantizedLinear.from_linear(mod, fmt))
                targets[owner] = q.formats  # as written (a raw format may have fallen back)
                mod.to("meta")  # drop the float weights before the next module is read
                used = [r for _, refs in loaded.values() for r in refs]
                for r in used:
                    ckpt.drop_pages(r)
                shards.add({f"{owner}.{k}": t for k, t in q.state_dict().items()})
            elif isinstance(srcs, str):
                continue  # tied and not quantized: the loader ties it again
            else:
                used = srcs
                shards.add({name: load(name)[0]}, srcs)
            bar.update(sum(r.nbytes for r in used))


class _Shards:
    """Tensors gathered into files of up to `limit` bytes (one module may go over); the
    input's pages are dropped once what was read from them is written."""

    def __init__(self, dir: Path, ckpt, limit: int):
        self.dir, self.ckpt, self.limit = dir, ckpt, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.refs: list = []
        self.size = 0
        self.files: list[list[str]] = []

    def add(self, tensors: dict[str, torch.Tensor], refs=()) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending and self.size + nbytes > self.limit:
            self.flush()
        self.pending.update(tensors)
        self.refs.extend(refs)
        self.size += nbytes

    def flush(self) -> None:
        from ..loaders.safetensors import write_file

        if not self.pending:
            return
        write_file(self.dir / f"part-{len(self.files)}.safetensors", self.pending, {"format": "pt"})
        self.files.append(list(self.pending))
        for r in self.refs:
            self.ckpt.drop_pages(r)
        self.pending, self.refs, self.size = {}, [], 0

    def finish(self) -> None:
        """Last shard out; HF names (`model.safetensors`, or numbered shards and an index)."""
        self.flush()
        n = len(self.files)
        if n == 1:
            (self.dir / "part-0.safetensors").rename(self.dir / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.dir / f"part-{i}.safetensors").rename(self.dir / fname)
            weight_map.update(dict.fromkeys(names, fname))
        total = sum((self.dir / f).stat().st_size for f in set(weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _write_config(src: Path, dst: Path, policy: QuantPolicy, targets: dict[str, str], dtype: torch.dtype) -> None:
    cfg = read_config(src)
    # the float tensors are stored in the dtype they were loaded in: say so, so that
    # dtype="auto" loads them back the same way
    keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
    for k in keys:
        cfg[k] = str(dtype).removeprefix("torch.")
    cfg["quantization"] = {
        "format_version": FORMAT_VERSION, "quant_method": "moerun", "group_size": GROUP,
        "scale_dtype": "float16", "symmetric": True, "components": asdict(policy), "modules": targets,
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _move_into_place(tmp: Path, out: Path) -> None:
    if out.is_dir() and any(out.iterdir()):  # --force: the old one goes only once the new one is complete
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
