"""Writing quantized checkpoints (`moerun quantize`): the format is `loaders.quantized`'s."""

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
from ..kernels.formats import GROUP
from ..quant import QuantPolicy, component_of, policy_name, resolve_policy
from .hf import PROGRESS_BYTES, materialize, open_model, plan_state, target_dtype
from .quantized import COPIED, FORMAT_VERSION, SHARD_BYTES
from .safetensors import file_bytes, write_file
from ..layers.moe import Experts
from ..layers.quantized import QuantizedExperts, QuantizedLinear


def quantize_checkpoint(src, out, policy, dtype="auto", force: bool = False, shard_bytes: int = SHARD_BYTES) -> dict:
    """Write checkpoint `src` quantized by `policy` as the directory `out`; returns a summary.

    Module by module: each quantized module's float weights are read, quantized and
    dropped before the next is read, and each shard is written once it holds
    `shard_bytes`, so memory holds one module's float weights plus one shard. Everything
    goes to a temporary directory beside `out`, renamed to `out` at the end.
    """

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
