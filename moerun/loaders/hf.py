"""Build a model from a Hugging Face directory: config -> architecture -> weights.

Checkpoint names are mapped to ours in one declarative place per model
(`Model.checkpoint_renames`: regex, replacement; `Model.checkpoint_parts`: a parameter that is
some rows of a fused checkpoint tensor, e.g. Qwen3-Next's `in_proj_qkvz`); experts stored one tensor per expert
(`...experts.{e}.gate_proj.weight`) or fused (`...experts.gate_up_proj`) are stacked into
our `[E, out, in]` parameters here, the same way for every architecture.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import read_config
from ..errors import MoerunError, one_line
from ..models import build_on_meta, module_for
from .safetensors import DTYPE_NAMES as FILE_DTYPES, Checkpoint, TensorRef
from .quantized import make_quantized_modules

DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
PROGRESS_BYTES = 1 << 30
SCAN_ELEMENTS = 1 << 24  # --check-weights reads a tensor in pieces of this many values
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class PartRef(TensorRef):
    """Rows `rows` of checkpoint tensor `name` (a fused tensor that our model holds as several
    parameters); its bytes, offset and size are the whole tensor's."""

    rows: torch.Tensor = field(default=None, compare=False)


def named_dtype(dtype) -> torch.dtype | None:
    """A dtype given by the caller (a torch dtype or its name), None for "auto"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPE_NAMES:
            raise MoerunError(f"unsupported dtype {dtype!r}; use auto, float32 or bfloat16")
        return DTYPE_NAMES[dtype]
    return None


def resolve_dtype(dtype, cfg: dict, ckpt: Checkpoint) -> torch.dtype:
    if named_dtype(dtype) is not None:
        return named_dtype(dtype)
    declared = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("dtype")
    if declared is None:
        declared = next((str(r.dtype).removeprefix("torch.") for r in ckpt.tensors.values() if r.dtype.is_floating_point), "float32")
    # half precision checkpoints run in bf16 on the CPU (fp16 matmuls are slow there)
    return torch.float32 if declared in ("float32", "float64") else torch.bfloat16


def build(model_dir, dtype="auto", prepare=None, check_weights: bool = False):
    """Returns (architecture module, args, net with weights loaded, dtype).

    prepare(net), when given, runs on the meta-device net before any weight is read (the
    expert store uses it to take the routed experts out of what gets loaded).
    check_weights: scan every float tensor for NaN and Inf first (`check_finite`).
    (`moerun.loaders.build` takes a `.gguf` file to loaders/gguf.py.)"""
    module, args, net, ckpt, dtype, renames = open_model(model_dir, dtype, check_weights)
    if prepare is not None:
        prepare(net)
    state = load_state(net, ckpt, dtype, renames)
    net.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if left:  # a module made a buffer without an explicit device: a bug of ours, not the user's
        raise RuntimeError(f"tensors left unmaterialized after loading: {left[:5]}")
    net.requires_grad_(False).eval()
    ckpt.close()
    return module, args, net, dtype


def open_model(model_dir, dtype="auto", check_weights: bool = False):
    """Everything before reading weights: (architecture module, args, meta-device net,
    checkpoint, dtype, name renames). A checkpoint written by `moerun quantize` (a
    `quantization` entry in config.json) gets its quantized modules here, and its tensors
    already carry our names. check_weights: `check_finite` on the checkpoint."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise MoerunError(f"model path {model_dir} does not exist")
    if not model_dir.is_dir():
        raise MoerunError(f"model path {model_dir} is not a directory")
    cfg = read_config(model_dir)
    module = module_for(cfg["model_type"])
    args = module.ModelArgs.from_dict(module.text_config(cfg) if hasattr(module, "text_config") else cfg)
    ckpt = Checkpoint(model_dir)
    dtype = resolve_dtype(dtype, cfg, ckpt)
    try:
        net = build_on_meta(module, args)
    except (ValueError, TypeError, KeyError, IndexError, ArithmeticError) as e:  # a setting no check above caught
        raise MoerunError(f"config.json is not valid for {cfg['model_type']}: {one_line(e)}") from None
    if check_weights:
        check_finite(ckpt)
    renames = getattr(net, "checkpoint_renames", ())
    if "quantization" in cfg:

        make_quantized_modules(net, cfg["quantization"])
        renames = ()
    return module, args, net, ckpt, dtype, renames


def load_state(net: torch.nn.Module, ckpt: Checkpoint, dtype: torch.dtype, renames) -> dict[str, torch.Tensor]:
    plan = plan_state(net, ckpt, renames)
    total = sum(r.nbytes for _, _, srcs in plan for r in srcs if isinstance(r, TensorRef))
    state: dict[str, torch.Tensor] = {}
    tied = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", file=sys.stderr,
              disable=total < PROGRESS_BYTES, leave=False) as bar:
        for name, p, srcs in plan:
            if isinstance(srcs, str):  # tied to another parameter
                tied[name] = srcs
                continue
            state[name] = materialize(ckpt, srcs, tuple(p.shape), target_dtype(net, name, p, dtype), name)
            bar.update(sum(r.nbytes for r in srcs))
    for name, other in tied.items():
        state[name] = state[other]
    return state


def plan_state(net: torch.nn.Module, ckpt: Checkpoint, renames) -> list[tuple[str, torch.Tensor, list[TensorRef] | str]]:
    """(name, meta tensor, checkpoint sources or the name it is tied to) for every tensor of
    `net`'s state dict, in order; drops optional submodules the checkpoint does not have."""
    names = _renamed(ckpt, renames)
    expected = net.state_dict(keep_vars=True)
    for opt in getattr(net, "optional_submodules", ()):
        # e.g. an MTP head: a checkpoint with none of its tensors loads without it (a
        # checkpoint with some of them is broken and fails below, naming what is missing)
        prefix = opt + "."
        wanted = [n for n in expected if n.startswith(prefix)]
        if wanted and not any(_resolvable(n, expected[n], names, net) for n in wanted):
            setattr(net, opt, None)
            expected = {n: p for n, p in expected.items() if not n.startswith(prefix)}
    return [(name, p, _sources(name, p, names, net)) for name, p in expected.items()]


def target_dtype(net: torch.nn.Module, name: str, p: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` (meta tensor `p`) is loaded in."""
    if not p.dtype.is_floating_point:
        return p.dtype
    owner = net.get_submodule(name.rpartition(".")[0])
    if getattr(owner, "keeps_dtype", False):  # quantized modules: fp16 scales, fp32 bias
        return p.dtype
    if any(re.search(pat, name) for pat in getattr(net, "fp32_parameters", ())):
        return torch.float32  # e.g. routers, as the reference keeps them
    return dtype


def _renamed(ckpt: Checkpoint, renames) -> dict[str, TensorRef]:
    rules = [(re.compile(p), r) for p, r in renames]
    out = {}
    for name, ref in ckpt.tensors.items():
        for pat, rep in rules:
            name = pat.sub(rep, name)
        out[name] = ref
    return out


def _resolvable(name, p, names, net) -> bool:
    try:
        _sources(name, p, names, net)
        return True
    except MoerunError:
        return False


def _sources(name: str, p: torch.Tensor, names: dict[str, TensorRef], net) -> list[TensorRef] | str:
    """The checkpoint tensors that make up parameter `name` (or the name it is tied to)."""
    if name in names:
        return [names[name]]
    if name.endswith(".weight") and name[: -len(".weight")] in names:
        return [names[name[: -len(".weight")]]]
    prefix, _, proj = name.rpartition(".")
    if prefix.endswith(".experts") and proj in EXPERT_PROJS and p.dim() == 3:
        per_expert = [f"{prefix}.{e}.{proj}.weight" for e in range(p.shape[0])]
        if all(n in names for n in per_expert):
            return [names[n] for n in per_expert]
        fused = f"{prefix}.gate_up_proj"
        if proj != "down_proj" and fused in names:
            return [names[fused]]
        missing = next(n for n in per_expert if n not in names)
        raise MoerunError(f"checkpoint is missing tensor {missing!r} (needed for {name})")
    for pat, rep, rows in getattr(net, "checkpoint_parts", ()):
        m = re.match(pat, name)
        if m and m.expand(rep) in names:
            ref = names[m.expand(rep)]
            return [PartRef(**{f: getattr(ref, f) for f in ref.__dataclass_fields__}, rows=rows(net.args, m))]
    tie = getattr(net, "tied_parameters", {}).get(name)
    if tie is not None and getattr(net.args, "tie_word_embeddings", False):
        return tie
    raise MoerunError(f"checkpoint is missing tensor {name!r}")


def check_finite(ckpt: Checkpoint) -> None:
    """`--check-weights`: every float tensor of the checkpoint holds only finite values; the
    first with a NaN or an Inf is refused by name. Reads every byte (a progress bar on
    stderr for a large model), in pieces, so memory holds one piece's flags at a time."""
    refs = sorted((r for r in ckpt.tensors.values() if r.dtype.is_floating_point and r.nbytes),
                  key=lambda r: (str(r.path), r.offset))
    total = sum(r.nbytes for r in refs)
    with tqdm(total=total, unit="B", unit_scale=True, desc="checking weights", file=sys.stderr,
              disable=total < PROGRESS_BYTES, leave=False) as bar:
        for ref in refs:
            flat = ckpt.view(ref).reshape(-1)
            for i in range(0, flat.numel(), SCAN_ELEMENTS):
                piece = flat[i : i + SCAN_ELEMENTS]
                if piece.dtype.itemsize == 1:  # float8: no isfinite kernel of its own
                    piece = piece.float()
                if not bool(torch.isfinite(piece).all()):
                    raise MoerunError(f"tensor {ref.name!r} in {ref.path.name} holds NaN or infinite values")
            ckpt.drop_pages(ref)
            bar.update(ref.nbytes)


def check_dtype(ref: TensorRef, want: torch.dtype, name: str) -> None:
    """A float weight may be read from any float dtype (it is cast); an integer tensor where
    a float weight belongs, or a float or another integer type where a quantized buffer's
    packed integers belong, is refused by name."""
    ok = ref.dtype.is_floating_point if want.is_floating_point else ref.dtype == want
    if ok:
        return
    needs = "a floating-point dtype" if want.is_floating_point else FILE_DTYPES[want]
    raise MoerunError(f"tensor {ref.name!r} has dtype {FILE_DTYPES[ref.dtype]}, but {name} needs {needs}")


def materialize(ckpt: Checkpoint, srcs: list[TensorRef], shape, dtype, name) -> torch.Tensor:
    for ref in srcs:
        check_dtype(ref, dtype, name)
    if len(srcs) == 1 and isinstance(srcs[0], PartRef):
        ref = srcs[0]
        if len(ref.shape) != len(shape) or ref.shape[1:] != shape[1:] or int(ref.rows.max()) >= ref.shape[0] \
                or len(ref.rows) != shape[0]:
            raise MoerunError(f"tensor {ref.name!r} has shape {list(ref.shape)}; the config expects {shape[0]} of "
                              f"its rows to be {name}, of shape {list(shape)}")
        out = ckpt.view(ref)[ref.rows].to(dtype)
        ckpt.drop_pages(ref)
        return out
    if len(srcs) == 1 and not (srcs[0].name.endswith("gate_up_proj") and not name.endswith("gate_up_proj")):
        ref = srcs[0]
        if ref.shape != shape:
            raise MoerunError(f"tensor {ref.name!r} has shape {list(ref.shape)} but the config expects {list(shape)}")
        view = ckpt.view(ref)
        if ref.dtype == dtype:
            return view
        out = view.to(dtype)
        ckpt.drop_pages(ref)
        return out
    if len(srcs) == 1:  # fused gate_up [E, 2I, H]: gate is the first half, up the second
        ref = srcs[0]
        E, I2, H = ref.shape
        if (E, I2 // 2, H) != shape:
            raise MoerunError(f"tensor {ref.name!r} has shape {list(ref.shape)}, expected [{shape[0]}, {2 * shape[1]}, {shape[2]}]")
        half = slice(0, I2 // 2) if name.endswith("gate_proj") else slice(I2 // 2, I2)
        return ckpt.view(ref)[:, half].to(dtype, copy=True)
    out = torch.empty(shape, dtype=dtype)
    for e, ref in enumerate(srcs):
        if ref.shape != shape[1:]:
            raise MoerunError(f"tensor {ref.name!r} has shape {list(ref.shape)} but the config expects {list(shape[1:])}")
        ckpt.copy_into(ref, out[e])
    return out
