"""Architectures by Hugging Face `model_type`; each module exports `ModelArgs` and `Model`."""

from __future__ import annotations

import importlib

import torch

from ..errors import MoerunError

# model_type -> module in this package (imported only when used)
ARCHITECTURES = {
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "deepseek_v3": "deepseek_v3",
}


def supported() -> list[str]:
    return sorted(ARCHITECTURES)


def module_for(model_type: str):
    name = ARCHITECTURES.get(model_type)
    if name is None:
        raise MoerunError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(supported())}"
        )
    return importlib.import_module(f"{__name__}.{name}")


# torch.nn.init's in-place initializers, which modules' reset_parameters call
_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


def _leave(tensor, *args, **kwargs):
    return tensor


def build_on_meta(module, args):
    """module.Model(args) on the meta device, its modules' initializers skipped: the weights
    are loaded (or written) next, and on the meta device an initializer sets nothing anyway.
    nn.Embedding's normal_ alone would import torch._dynamo there (its meta kernel is
    Python), ~1.3 s of a demo model's 2.5 s load. The initializers are swapped out of
    `torch.nn.init` for the call: do not build models on other threads meanwhile."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALIZERS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, _leave)
        with torch.device("meta"):
            return module.Model(args)
    finally:
        for name, f in saved.items():
            setattr(torch.nn.init, name, f)
