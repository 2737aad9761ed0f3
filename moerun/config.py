"""Model configuration: one frozen dataclass per architecture, built from config.json.

Field names are Hugging Face's. Unknown keys are dropped; aliases (older or newer names
for the same field) are folded in before the dataclass sees them. Every known field is
checked against its annotation before the dataclass sees it (integers in range, finite
numbers, lists of the right kind), so a malformed config.json is one sentence, never a
Python exception from deep inside the model's construction.

Also here: reading a model directory's files safely (`regular_file`, `open_regular`,
`read_json`), which the loaders use for every file they open.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from .errors import MoerunError, one_line, short

MAX_JSON_BYTES = 100 << 20  # as a safetensors header: a large model's index or tokenizer is a few MB
INT_LIMIT = 2**31 - 1  # sizes and counts: what the kernels' int32 indices hold
# fields that are a claim about positions, not a size anything is allocated by (caches are
# sized by what a run asks, `layers.cache`): a context length may be far larger
WIDE_INTS = {"max_position_embeddings": 2**62}
POSITIVE = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "decoder_sparse_step", "max_position_embeddings"}


def regular_file(path: Path) -> bool:
    """Whether `path` exists (following links) as a regular file; an existing path that is
    anything else (a FIFO, a device, a directory) is an error, never opened."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise MoerunError(f"{path} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise MoerunError(f"{path} is not a regular file")
    return True


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, refused unless it is a regular file. Opened non-blocking
    and checked on the open descriptor, so a FIFO (or one put in its place) cannot hang us."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise MoerunError(f"{path} does not exist") from None
    except OSError as e:
        raise MoerunError(f"{path} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MoerunError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_json(path: Path) -> Any:
    """The JSON value in file `path` (at most MAX_JSON_BYTES); any problem reading or
    parsing it is one MoerunError."""
    try:
        with open_regular(path) as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise MoerunError(f"{path} is over {MAX_JSON_BYTES >> 20} MiB, too large for a model's JSON file")
        return json.loads(raw.decode("utf-8"))
    except OSError as e:
        raise MoerunError(f"{path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise MoerunError(f"{path} is not valid JSON: it is not UTF-8 text") from None
    except RecursionError:
        raise MoerunError(f"{path} is not valid JSON for a model: it is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and integers of more than 4300 digits
        if "integer string conversion" in str(e):
            raise MoerunError(f"{path} is not valid JSON for a model: it holds a number of thousands of digits") from None
        raise MoerunError(f"{path} is not valid JSON: {one_line(e)}") from None


def check_int(what: str, v: Any, lo: int = 0, hi: int = INT_LIMIT) -> int:
    """v as an int in lo..hi (an integral float such as 1e12 is taken as that int)."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise MoerunError(f"{what} must be an integer, not {short(v)}")
    if not lo <= v <= hi:
        raise MoerunError(f"{what} is {short(v)}; it must be in {lo}..{hi}")
    return v


def check_number(what: str, v: Any) -> float:
    """v as a finite float (an int is taken as one)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise MoerunError(f"{what} must be a number, not {short(v)}")
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise MoerunError(f"{what} must be a finite number, not {short(v)}")
    return x


def _check_field(name: str, v: Any, annotation: str) -> Any:
    """A config.json value for dataclass field `name` (annotated `annotation`, a string such
    as "int | None" or "tuple[int, ...]"), checked and normalised."""
    kinds = [k.strip() for k in annotation.split("|")]
    if v is None and "None" in kinds:
        return None
    what = f"config.json's {name}"
    kind = kinds[0]
    if kind == "int":
        return check_int(what, v, 1 if name in POSITIVE else 0, WIDE_INTS.get(name, INT_LIMIT))
    if kind == "float":
        return check_number(what, v)
    if kind == "bool":
        if not isinstance(v, bool):
            raise MoerunError(f"{what} must be true or false, not {short(v)}")
        return v
    if kind == "str":
        if not isinstance(v, str):
            raise MoerunError(f"{what} must be a string, not {short(v)}")
        return v
    if kind.startswith("tuple["):
        if not isinstance(v, (list, tuple)):
            raise MoerunError(f"{what} must be a list, not {short(v)}")
        item = kind[len("tuple["):].split(",")[0].strip()
        return tuple(_check_field(f"{name}[{i}]", x, item) for i, x in enumerate(v))
    if kind.startswith("dict"):
        if not isinstance(v, dict):
            raise MoerunError(f"{what} must be an object, not {short(v)}")
        return v
    return v  # Any, or a kind no field uses yet


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
                f = fields[k]
                has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                if v is None and has_default and "None" not in str(f.type):
                    continue  # null: the field's default, as transformers reads it
                kwargs[k] = _check_field(k, v, str(f.type))
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
        except (TypeError, ValueError, ArithmeticError) as e:
            raise MoerunError(f"config.json is not valid for {d.get('model_type')}: {one_line(e)}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not regular_file(path):
        raise MoerunError(f"{model_dir} has no config.json (is it a Hugging Face model directory?)")
    cfg = read_json(path)
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise MoerunError(f"{path} has no model_type")
    if not isinstance(cfg["model_type"], str):
        raise MoerunError(f"{path}'s model_type must be a string, not {short(cfg['model_type'])}")
    return cfg


ROPE_TYPES = ("default", "linear", "yarn")  # what layers.rope computes
ROPE_NUMBERS = ("rope_theta", "factor", "partial_rotary_factor", "attention_factor", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor")


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rope settings in the transformers-5 shape, from either the new or the old keys;
    its numbers checked (finite, positive where they divide)."""
    rp = cfg.get("rope_parameters")
    if rp is not None and not isinstance(rp, dict):
        raise MoerunError(f"config.json's rope_parameters must be an object, not {short(rp)}")
    if rp:
        rp = dict(rp)
    else:
        old = cfg.get("rope_scaling") or {}
        if not isinstance(old, dict):
            raise MoerunError(f"config.json's rope_scaling must be an object, not {short(old)}")
        rp = dict(old)
        rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "type" in rp and "rope_type" not in rp:
        rp["rope_type"] = rp.pop("type")
    rp.setdefault("rope_type", "default")
    if "partial_rotary_factor" in cfg:
        rp.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if rp["rope_type"] not in ROPE_TYPES:
        raise MoerunError(f"config.json's rope_type is {short(rp['rope_type'])}; moerun supports {', '.join(ROPE_TYPES)}")
    if rp["rope_type"] == "linear" and rp.get("factor") is None:
        raise MoerunError("config.json's rope_type linear needs a factor")
    for k in ROPE_NUMBERS:
        if rp.get(k) is not None:
            x = check_number(f"config.json's {k}", rp[k])
            if x <= 0 and k in ("rope_theta", "factor", "partial_rotary_factor"):
                raise MoerunError(f"config.json's {k} must be positive, not {short(rp[k])}")
            if x > 1 and k == "partial_rotary_factor":
                raise MoerunError(f"config.json's partial_rotary_factor must be at most 1, not {short(rp[k])}")
    if rp.get("original_max_position_embeddings") is not None:
        check_int("config.json's original_max_position_embeddings", rp["original_max_position_embeddings"], 1,
                  WIDE_INTS["max_position_embeddings"])
    return rp


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    """generation_config.json's settings ({} without one), with the fields the engine reads
    checked: eos_token_id an id or a list of ids, sampling settings numbers."""
    path = model_dir / "generation_config.json"
    if not regular_file(path):
        return {}
    gen = read_json(path)
    if not isinstance(gen, dict):
        raise MoerunError(f"{path} must hold a JSON object, not {short(gen)}")
    what = f"{path.name}'s"
    eos = gen.get("eos_token_id")
    for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
        check_int(f"{what} eos_token_id", i)
    if gen.get("do_sample") is not None and not isinstance(gen["do_sample"], bool):
        raise MoerunError(f"{what} do_sample must be true or false, not {short(gen['do_sample'])}")
    for k in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if gen.get(k) is not None:
            check_number(f"{what} {k}", gen[k])
    if gen.get("top_k") is not None:
        check_int(f"{what} top_k", gen["top_k"])
    return gen
