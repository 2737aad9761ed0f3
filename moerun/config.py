"""Model configuration: one frozen dataclass per architecture, built from config.json.

Field names are Hugging Face's. Unknown keys are dropped; aliases (older or newer names
for the same field) are folded in before the dataclass sees them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

from .errors import MoerunError


@dataclasses.dataclass(frozen=True)
class BaseModelArgs:
    aliases: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BaseModelArgs":
        d = dict(d)
        for old, new in cls.aliases.items():
            if old in d and new not in d:
                d[new] = d.pop(old)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for k, v in d.items():
            if k in fields:
                if isinstance(v, list):
                    v = tuple(v)
                kwargs[k] = v
        missing = [
            f.name
            for f in fields.values()
            if f.name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise MoerunError(f"config.json lacks required field(s): {', '.join(missing)}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise MoerunError(f"config.json is not valid for {d.get('model_type')}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise MoerunError(f"{model_dir} has no config.json (is it a Hugging Face model directory?)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoerunError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise MoerunError(f"{path} has no model_type")
    return cfg


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rope settings in the transformers-5 shape, from either the new or the old keys."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        rp = dict(rp)
    else:
        rp = dict(cfg.get("rope_scaling") or {})
        rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "type" in rp and "rope_type" not in rp:
        rp["rope_type"] = rp.pop("type")
    rp.setdefault("rope_type", "default")
    if "partial_rotary_factor" in cfg:
        rp.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    return rp
