"""Architectures by Hugging Face `model_type`; each module exports `ModelArgs` and `Model`."""

from __future__ import annotations

import importlib

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
