"""Quantized checkpoints: `moerun quantize` writes them (`loaders.quantized_write`), the loader
reads them back (here).

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

from pathlib import Path

import torch

from ..config import read_config
from ..errors import MoerunError
from ..quant import QuantPolicy, policy_name, quantize_model, replace_module, resolve_policy
from ..kernels.formats import FORMATS, GROUP
from ..layers.moe import Experts
from ..layers.quantized import QuantizedExperts, QuantizedLinear

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
