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
    "qwen3_next": "qwen3_next",
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


class _SkipInitOnMeta(torch.overrides.TorchFunctionMode):
    """torch.nn.init's initializers, and the in-place random fills they end in, left undone on
    meta tensors. Like every torch function mode it holds on the thread that enters it only.
    (An initializer reaches the mode as itself: the fills it calls inside run with the mode
    set aside, so it is caught whole.)"""

    FILLS = frozenset(getattr(torch.Tensor, name) for name in (
        "normal_", "uniform_", "fill_", "zero_", "bernoulli_", "cauchy_", "exponential_", "geometric_",
        "log_normal_", "random_"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS or getattr(func, "__module__", None) == "torch.nn.init":
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def build_on_meta(module, args):
    """module.Model(args) on the meta device, its modules' initializers skipped: the weights
    are loaded (or written) next, and on the meta device an initializer sets nothing anyway.
    nn.Embedding's normal_ alone would import torch._dynamo there (its meta
    kernel is Python), ~1.3 s of a demo model's 2.5 s load. Only this thread's calls on meta
    tensors are touched (a torch function mode): modules built elsewhere meanwhile, or off
    the meta device, are initialised as usual."""
    with torch.device("meta"), _SkipInitOnMeta():
        return module.Model(args)
