"""`moerun export-gguf`: a model directory (a Hugging Face float checkpoint, or one written
by `moerun quantize`) as one GGUF file that llama.cpp loads.

Names, metadata and the converter's transforms come from loaders/gguf.py's tables, read in
the other direction. Types per `--type` recipe:

- `f32`, `bf16`: float weights in that dtype; 1-D tensors (norms, biases) and the Gated
  DeltaNet's small tensors always F32, as llama.cpp's converter writes them.
- `q8_0`, `q4_0`: the weights moerun's own quantization policy would quantize (`int8`;
  for q4_0 every component int4 but the LM head int8), and the token embeddings, quantized
  with moerun's int8/int4 rule, which is llama.cpp's Q8_0/Q4_0 rule; routers and the other
  tensors moerun keeps in float stay float.
- A quantized checkpoint's int8/int4 modules are written as Q8_0/Q4_0 whatever the recipe:
  the same blocks in natural order with their fp16 scale in front, bit for bit.
- `q4_k_m`, `q5_k_m`, `q6_k`: each matrix's type is what `quant.gguf_types.tensor_type` says
  llama-quantize gives it, its blocks from `ggml_quant.quantize` (Q8_0/Q4_0 by moerun's
  rule).

The file is written beside the output as a temporary file and renamed at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..errors import MoerunError, short
from ..kernels import ggml_quant
from ..quant.gguf_types import tensor_type
from .gguf import ARCHS, MODEL_TYPES, PRE_TOKENIZERS, SAMPLING, Arch, gguf_names, transform_of
from .gguf_tokenizer import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, UNUSED, USER_DEFINED
from ..config import read_json, regular_file
from ..kernels.formats import natural_blocks, quantize
from ..layers.quantized import QuantizedExperts, QuantizedLinear
from ..models import build_on_meta, module_for
from ..quant import POLICIES, QuantPolicy, component_of

RECIPES = ("bf16", "f32", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")
K_RECIPES = ("q4_k_m", "q5_k_m", "q6_k")
FILE_TYPES = {"f32": 0, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}  # llama_ftype
GGML_OF = {"int8": "Q8_0", "int4": "Q4_0"}
PROGRESS_BYTES = 1 << 30


def _recipe_policy(recipe: str):

    if recipe == "q8_0":
        return POLICIES["int8"]
    if recipe == "q4_0":
        return QuantPolicy(experts="int4", shared_experts="int4", attention="int4", lm_head="int8")
    return None


def export(model_dir, out, recipe: str = "bf16", force: bool = False, split_bytes: int = 0) -> dict:
    """Write `model_dir` as the GGUF file `out`; returns a summary. split_bytes: cut into
    files of at most this many tensor bytes, named `NAME-00001-of-0000N.gguf` like llama.cpp's
    gguf-split (0: one file)."""
    import gguf

    from . import build

    src, out = Path(model_dir), Path(out)
    if recipe not in RECIPES:
        raise MoerunError(f"unknown --type {short(recipe)}; types: {', '.join(RECIPES)}")
    if out.exists() and not force:
        raise MoerunError(f"{out} exists (pass --force to replace it)")
    if out.exists() and out.is_dir():
        raise MoerunError(f"{out} is a directory")
    _, args, net, dtype = build(src, "float32" if recipe == "f32" else "auto")
    if getattr(args, "mtp_num_hidden_layers", 0) and getattr(net, "mtp", None) is None:
        args = replace(args, mtp_num_hidden_layers=0)  # the checkpoint had no MTP head: the file has no nextn block
    arch = ARCHS.get(MODEL_TYPES.get(args.model_type, ""))
    if arch is None:
        raise MoerunError(f"{src} is {args.model_type!r}, which moerun cannot write as GGUF")
    plan = _plan(net, args, arch, recipe, dtype)
    w = gguf.GGUFWriter(path=None, arch=arch.name, split_max_size=split_bytes)
    _metadata(w, args, arch, recipe, src)
    _tokenizer(w, src, args)
    for name, gtype, shape, _ in plan:
        _tensor_info(w, name, gtype, shape)
    out.parent.mkdir(parents=True, exist_ok=True)
    total = sum(_nbytes(g, s) for _, g, s, _ in plan)
    with _staged(out, w) as (tmp, written):
        w.write_header_to_file(tmp / out.name)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with tqdm(total=total, unit="B", unit_scale=True, desc="writing GGUF", file=sys.stderr,
                  disable=total < PROGRESS_BYTES, leave=False) as bar:
            for name, gtype, shape, make in plan:
                data = make()
                w.write_tensor_data(data)
                bar.update(data.nbytes)
    types = _type_counts(plan)
    return {"output": str(written[0]), "files": len(written), "architecture": arch.name, "type": recipe,
            "tensors": len(plan), "bytes": sum(f.stat().st_size for f in written), "types": types}


# -- tensors ---------------------------------------------------------------------------------

def _float_net(net, args):
    """The float model's parameter names (a quantized checkpoint's modules have others)."""

    meta = build_on_meta(module_for(args.model_type), args)
    if getattr(net, "mtp", None) is None or (isinstance(net.mtp, nn.ModuleList) and not len(net.mtp)):
        if getattr(meta, "mtp", None) is not None:
            meta.mtp = None if not isinstance(meta.mtp, nn.ModuleList) else nn.ModuleList()
    return meta


def _plan(net, args, arch: Arch, recipe: str, dtype) -> list[tuple[str, str, tuple, Callable]]:
    """(GGUF name, GGUF type, torch-order shape, producer of the bytes) per tensor."""

    meta = _float_net(net, args)
    names = gguf_names(meta, arch)
    modules = dict(net.named_modules())
    meta_modules = dict(meta.named_modules())
    policy = _recipe_policy(recipe)
    float_type = "F32" if recipe == "f32" or dtype == torch.float32 else "BF16"
    plan, parts = [], {}
    for name, p in meta.state_dict(keep_vars=True).items():
        gname = names[name]
        tr = transform_of(arch, name, args)
        if tr is not None and tr.gather is not None:  # one part of a fused GGUF tensor
            parts.setdefault(gname, []).append((tr.gather, len(plan)))
        if name == "lm_head.weight" and getattr(args, "tie_word_embeddings", False):
            continue  # llama.cpp ties by the absence of output.weight
        owner_name, _, leaf = name.rpartition(".")
        owner, meta_owner = modules.get(owner_name), meta_modules[owner_name]
        if isinstance(owner, QuantizedLinear) and leaf == "weight":
            plan.append((gname, GGML_OF[owner.fmt], tuple(p.shape), _stored_rows(owner, "qweight", "scales", tr)))
            continue
        if isinstance(owner, QuantizedLinear) and leaf == "bias":
            plan.append((gname, "F32", tuple(p.shape), _floats(lambda o=owner: o.bias, "F32", None)))
            continue
        if isinstance(owner, QuantizedExperts):
            plan.append((gname, GGML_OF[owner.fmt], tuple(p.shape), _stored_rows(owner, f"{leaf[:-5]}_q",
                                                                                  f"{leaf[:-5]}_scales", tr)))
            continue
        get = _getter(net, name)
        if name.endswith("kv_b_proj.weight"):
            plan.extend(_split_kv_b(gname, get, args, float_type))
            continue
        if recipe in K_RECIPES and p.dim() >= 2 and (tr is None or tr.value is None):
            gtype = _k_type(recipe, gname, tuple(p.shape), args)
            make = _floats(get, gtype, tr) if gtype in ("F32", "BF16") else _quantize_k(get, gtype, tr)
            plan.append((gname, gtype, tuple(p.shape), make))
            continue
        fmt = _quant_format(name, meta_owner, p, policy, recipe, getattr(args, "tie_word_embeddings", False))
        if fmt is not None and (tr is None or tr.value is None):
            plan.append((gname, GGML_OF[fmt], tuple(p.shape), _quantize(get, fmt, tr)))
            continue
        gtype = "F32" if p.dim() < 2 or (tr is not None and tr.value is not None) else float_type
        shape = tuple(p.shape)
        if name.endswith("conv1d.weight"):
            shape = (shape[0], shape[-1])
        if len(shape) == 2 and shape[0] == 1:  # a one-row matrix (a shared-expert gate): 1-D F32, as llama.cpp has it
            shape, gtype = shape[1:], "F32"
        plan.append((gname, gtype, shape, _floats(get, gtype, tr)))
    return _join(plan, parts)


def _join(plan: list, parts: dict[str, list[tuple[torch.Tensor, int]]]) -> list:
    """The plan with each fused GGUF tensor (qwen3next's ssm_ba: in_proj_b and in_proj_a) as
    one entry in the place of its first part: every part's rows (float or quantized, a row is
    independent of the others) put back where its `gather` reads them from."""
    joined = {}
    for gname, got in parts.items():
        entries = [plan[i] for _, i in got]
        gathers = [g for g, _ in got]
        if len({e[1] for e in entries}) != 1 or len({e[2][1:] for e in entries}) != 1:
            raise MoerunError(f"{gname}: its parts would be written as {sorted({e[1] for e in entries})} with shapes "
                              f"{[list(e[2]) for e in entries]}; they must agree")
        rows = sum(len(g) for g in gathers)
        if not torch.equal(torch.sort(torch.cat(gathers)).values, torch.arange(rows)):
            raise RuntimeError(f"the parts of {gname} do not cover its rows once")  # a table of ours is wrong

        def make(entries=entries, gathers=gathers, rows=rows):
            data = [e[3]() for e in entries]
            out = np.empty((rows, *data[0].shape[1:]), dtype=data[0].dtype)
            for g, d in zip(gathers, data):
                out[g.numpy()] = d
            return out
        joined[got[0][1]] = (gname, entries[0][1], (rows, *entries[0][2][1:]), make)
    drop = {i for got in parts.values() for _, i in got}
    return [joined[i] if i in joined else e for i, e in enumerate(plan) if i in joined or i not in drop]


def _k_type(recipe: str, gname: str, shape: tuple, args) -> str:
    """The GGUF type llama-quantize's `recipe` gives tensor `gname` (tensor_type)."""
    # the file's block_count: MTP / nextn blocks count, as llama-quantize counts them
    n_layer = args.num_hidden_layers + (getattr(args, "mtp_num_hidden_layers", 0) or 0) + \
        (getattr(args, "num_nextn_predict_layers", 0) or 0)
    gtype = str(tensor_type(recipe, gname, shape, n_layer)).upper()
    if gtype not in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0"):
        raise MoerunError(f"recipe {recipe} chose type {gtype} for {gname}, which moerun cannot write")
    return "BF16" if gtype == "F16" else gtype


def _quantize_k(get, gtype: str, tr) -> Callable[[], np.ndarray]:
    """Float -> GGUF blocks of `gtype`: Q8_0/Q4_0 by moerun's rule, the raw formats by
    ggml_quant.quantize."""
    if gtype in ("Q8_0", "Q4_0"):
        return _quantize(get, "int8" if gtype == "Q8_0" else "int4", tr)

    def make():
        return ggml_quant.quantize(gtype.lower(), _apply(get(), tr).float()).contiguous().numpy()
    return make


def _getter(net, name: str) -> Callable[[], torch.Tensor]:
    owner, _, leaf = name.rpartition(".")

    def get():
        return getattr(net.get_submodule(owner), leaf).detach()
    return get


def _quant_format(name, meta_owner, p, policy, recipe, tied: bool) -> str | None:
    """The moerun format a float tensor is quantized to under `recipe` (None: float)."""

    if policy is None or p.dim() < 2 or p.shape[-1] % 32:
        return None
    if isinstance(meta_owner, nn.Embedding):  # tied, it is the LM head too (llama-quantize's rule as well)
        return policy.lm_head if tied else "int8" if recipe == "q8_0" else "int4"
    comp = component_of(name.rpartition(".")[0], meta_owner)
    if comp is None or not name.endswith((".weight", "_proj")):
        return None
    return getattr(policy, comp)


def _apply(t: torch.Tensor, tr) -> torch.Tensor:
    if tr is None:
        return t
    if tr.value is not None:
        t = tr.value[0](t)
    if tr.rows is not None:
        t = t[tr.rows]
    if tr.cols is not None:
        t = t[:, tr.cols]
    return t


def _floats(get, gtype: str, tr) -> Callable[[], np.ndarray]:
    def make():
        t = _apply(get().float() if gtype == "F32" else get(), tr)
        t = t.to(torch.float32 if gtype == "F32" else torch.bfloat16).contiguous()
        if t.dim() == 2 and t.shape[0] == 1:
            t = t.reshape(-1)
        return t.numpy() if gtype == "F32" else t.view(torch.uint8).numpy()
    return make


def _to_ggml(q: torch.Tensor, s: torch.Tensor, fmt: str) -> np.ndarray:
    """moerun packed rows (qweight [..., N, bytes], scales [..., N, nb]) -> GGUF Q8_0/Q4_0 rows:
    each block's fp16 scale, then its bytes in natural order."""

    blocks = natural_blocks(q, fmt).view(torch.uint8)  # [..., N, nb, per]
    scales = s.contiguous().view(torch.uint8).view(*s.shape, 2)
    rows = torch.cat([scales, blocks], -1)
    return rows.reshape(*rows.shape[:-2], -1).contiguous().numpy()


def _quantize(get, fmt: str, tr) -> Callable[[], np.ndarray]:

    def make():
        t = _apply(get(), tr)
        return _to_ggml(*quantize(t, fmt), fmt)
    return make


def _stored_rows(mod, qname: str, sname: str, tr) -> Callable[[], np.ndarray]:
    """A quantized module's blocks as they are, rows (and whole-block columns) moved by the
    converter's transform."""
    def make():
        q, s = getattr(mod, qname), getattr(mod, sname)
        data = torch.from_numpy(_to_ggml(q, s, mod.fmt))
        if tr is not None and tr.value is not None:
            raise MoerunError("a quantized tensor with a value transform cannot be written")
        if tr is not None and tr.rows is not None:
            data = data[..., tr.rows, :]
        if tr is not None and tr.cols is not None:
            per = 18 if mod.fmt == "int4" else 34
            blocks = tr.cols.view(-1, 32)
            if bool((blocks[:, 0] % 32).any()) or not bool((blocks == blocks[:, :1] + torch.arange(32)).all()):
                raise MoerunError("value heads that are not whole blocks of 32 cannot be reordered in a quantized tensor")
            data = data.reshape(*data.shape[:-1], -1, per)[..., blocks[:, 0] // 32, :].reshape(data.shape)
        return data.contiguous().numpy()
    return make


def _split_kv_b(gname: str, get, args, gtype: str):
    """DeepSeek kv_b_proj as llama.cpp's attn_k_b ([heads, rank, nope], the nope rows
    transposed) and attn_v_b ([heads, v, rank])."""
    n, r, dn, dv = args.num_attention_heads, args.kv_lora_rank, args.qk_nope_head_dim, args.v_head_dim

    def part(k: bool):
        def t():
            w = get().reshape(n, dn + dv, r)
            return w[:, :dn].transpose(1, 2).contiguous() if k else w[:, dn:].contiguous()
        return t
    return [(gname.replace("attn_kv_b", "attn_k_b"), gtype, (n, r, dn), _floats(part(True), gtype, None)),
            (gname.replace("attn_kv_b", "attn_v_b"), gtype, (n, dv, r), _floats(part(False), gtype, None))]


def _nbytes(gtype: str, shape: tuple) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gtype]]
    n = 1
    for x in shape[:-1]:
        n *= x
    return n * shape[-1] // block * size


def _tensor_info(w, name: str, gtype: str, shape: tuple) -> None:
    import gguf

    qt = gguf.GGMLQuantizationType[gtype]
    nbytes = _nbytes(gtype, shape)
    if gtype == "F32":
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
    else:
        byte_shape = (*shape[:-1], nbytes // max(1, int(np.prod(shape[:-1]))))
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)


# -- metadata ----------------------------------------------------------------------------------

def _add(w, key: str, v: Any) -> None:
    import gguf

    T = gguf.GGUFValueType
    if isinstance(v, bool):
        w.add_key_value(key, v, T.BOOL)
    elif isinstance(v, int):
        w.add_key_value(key, v, T.UINT32 if 0 <= v < 2**32 else T.INT64)
    elif isinstance(v, float):
        w.add_key_value(key, v, T.FLOAT32)
    elif isinstance(v, str):
        w.add_key_value(key, v, T.STRING)
    elif isinstance(v, (list, tuple)):
        w.add_array(key, list(v))
    else:
        raise TypeError(f"metadata {key}: {type(v).__name__}")


def _metadata(w, args, arch: Arch, recipe: str, src: Path) -> None:
    values = {f.name: getattr(args, f.name) for f in fields(args)}
    w.add_string("general.name", src.name if src.name else "model")
    w.add_uint32("general.file_type", FILE_TYPES[recipe])
    w.add_uint32("general.quantization_version", 2)
    keys = {}
    for k in arch.keys:
        v = values.get(k.field)
        if v is not None:
            keys[k.key] = float(v) if k.kind == "float" else v
    keys.update(arch.write_keys(args))
    for key, v in keys.items():
        _add(w, f"{arch.name}.{key}", v)


def _tokenizer(w, src: Path, args) -> None:
    """tokenizer.ggml.* and the chat template from the directory's tokenizer.json and
    tokenizer_config.json; nothing without a tokenizer.json. A byte-level BPE is written as
    `gpt2` (its merges), a SentencePiece-style one (BPE with ▁ for spaces, or Unigram) as
    `llama` (scores and piece types, as llama.cpp's converter writes a tokenizer.model)."""

    path = src / "tokenizer.json"
    if not regular_file(path):
        return
    tj = read_json(path)
    model = tj.get("model") or {}
    cfg_path = src / "tokenizer_config.json"
    cfg = read_json(cfg_path) if regular_file(cfg_path) else {}
    if model.get("type") == "Unigram" or (model.get("type") == "BPE" and _space_symbol(tj)):
        vocab = _spm_vocab(w, tj, path, args)
        add_bos = cfg.get("add_bos_token", _template_adds(tj, cfg, "bos_token", 0))
        w.add_bool("tokenizer.ggml.add_eos_token", bool(cfg.get("add_eos_token", _template_adds(tj, cfg, "eos_token", -1))))
    elif model.get("type") == "BPE":
        vocab = _gpt2_vocab(w, tj, path, args)
        add_bos = cfg.get("add_bos_token", False)
    else:
        raise MoerunError(f"{path}: only BPE tokenizers (byte-level, or SentencePiece-style BPE and Unigram) can be "
                          f"written as GGUF (this one is {short(model.get('type'))})")

    def tok_id(v):
        v = v.get("content") if isinstance(v, dict) else v
        return vocab.get(v) if isinstance(v, str) else None

    for key, field in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("unknown", "unk_token")):
        i = tok_id(cfg.get(field))
        if i is not None:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", i)
    eos = tok_id(cfg.get("eos_token"))
    gen_path = src / "generation_config.json"
    gen = read_json(gen_path) if regular_file(gen_path) else {}
    more = gen.get("eos_token_id") if isinstance(gen, dict) else None
    eot = next((i for i in (more if isinstance(more, list) else [more]) if isinstance(i, int) and i != eos), None)
    if eot is not None:  # a second end-of-text id (a chat model's end of turn)
        w.add_uint32("tokenizer.ggml.eot_token_id", eot)
    if isinstance(gen, dict) and gen.get("do_sample"):
        for field_name, key, kind in SAMPLING:
            if gen.get(field_name) is not None:
                _add(w, f"general.sampling.{key}", float(gen[field_name]) if kind == "float" else int(gen[field_name]))
    w.add_bool("tokenizer.ggml.add_bos_token", bool(add_bos))
    template = cfg.get("chat_template")
    if template is None and regular_file(src / "chat_template.jinja"):
        template = (src / "chat_template.jinja").read_text()
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if isinstance(template, str):
        w.add_string("tokenizer.chat_template", template)


def _table(vocab: dict[str, int], added: dict[int, dict], n: int) -> tuple[list[str], list[int]]:
    """Tokens in id order, padded to n with `[PADi]` (UNUSED, as llama.cpp's converter pads),
    and their types: NORMAL, the added tokens CONTROL (special) or USER_DEFINED."""
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [UNUSED] * n
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = NORMAL
    for i, a in added.items():
        types[i] = CONTROL if a.get("special") else USER_DEFINED
    return tokens, types


def _gpt2_vocab(w, tj: dict, path: Path, args) -> dict[str, int]:
    """A byte-level BPE's tokens, types and merges as `gpt2`; -> its token ids by text."""
    model = tj["model"]
    pre = _pre_name(tj.get("pre_tokenizer"), path)
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {a["id"]: a for a in tj.get("added_tokens") or []}
    for i, a in added.items():
        vocab[a["content"]] = i
    tokens, types = _table(vocab, added, max(args.vocab_size, max(vocab.values(), default=-1) + 1))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    return vocab


def _spm_vocab(w, tj: dict, path: Path, args) -> dict[str, int]:
    """A SentencePiece-style tokenizer as `llama`: pieces, scores and types, as llama.cpp's
    converter writes a tokenizer.model (`<0xNN>` pieces BYTE, the unknown piece UNKNOWN, added
    tokens CONTROL or USER_DEFINED, score 0 for those; padding UNUSED at -1000), and whether
    a space goes in front of a text (`add_space_prefix`). A Unigram's scores are its own. A
    BPE has none: llama.cpp merges the adjacent pair whose joined piece scores highest, so
    each piece scores minus the rank of its first merge, which gives a BPE whose merges are
    every split of its pieces grouped by piece (as a tokenizer.json converted from a
    SentencePiece model lists them) its own order; any other BPE is refused
    (`_merge_scores`). -> the token ids by text."""
    model = tj["model"]
    if model["type"] == "Unigram":
        pieces = [(p[0], float(p[1])) for p in model.get("vocab") or []]
        vocab = {p: i for i, (p, _) in enumerate(pieces)}
        score = {i: s for i, (_, s) in enumerate(pieces)}
        unk_id = model.get("unk_id")
        unk = pieces[unk_id][0] if isinstance(unk_id, int) and 0 <= unk_id < len(pieces) else None
    else:
        vocab = dict(model.get("vocab") or {})
        score = _merge_scores(vocab, model.get("merges") or [], path)
        unk = model.get("unk_token")
    added = {a["id"]: a for a in tj.get("added_tokens") or []}
    for i, a in added.items():
        vocab.setdefault(a["content"], i)
    tokens, types = _table(vocab, added, max(args.vocab_size, max(vocab.values(), default=-1) + 1))
    scores = [-1000.0 if t == UNUSED else score.get(i, 0.0) for i, t in enumerate(types)]
    if model.get("byte_fallback"):
        for b in range(256):
            i = vocab.get(f"<0x{b:02X}>")
            if i is not None and i not in added:
                types[i], scores[i] = BYTE, 0.0
    if unk in vocab:
        types[vocab[unk]], scores[vocab[unk]] = UNKNOWN, 0.0
    for i in added:
        scores[i] = 0.0
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_bool("tokenizer.ggml.add_space_prefix", _space_prefix(tj))
    return vocab


def _merge_scores(vocab: dict[str, int], merges: list, path: Path) -> dict[int, float]:
    """Scores under which llama.cpp's merging (the adjacent pair whose joined piece scores
    highest, leftmost on a tie) is this BPE's (the pair of the lowest rank): the joined piece
    of merge r scores -r where r is its first merge, every other piece below them all. That
    holds when the merges are every split (a, b) of a piece into two pieces, each piece's
    splits together; anything else is refused in one line."""
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    first: dict[str, int] = {}
    last = -1
    for r, (a, b) in enumerate(pairs):
        rank = first.setdefault(a + b, r)
        if a + b not in vocab or a not in vocab or b not in vocab or rank < last:
            raise MoerunError(f"{path}: merge {a!r} {b!r} (rank {r}) is not a merge of SentencePiece pieces grouped "
                              "by piece, so llama.cpp would tokenize the GGUF file differently")
        last = rank
    listed = set(pairs)
    for t in vocab:
        for k in range(1, len(t)):
            if (t[:k], t[k:]) not in listed and t[:k] in vocab and t[k:] in vocab:
                raise MoerunError(f"{path}: piece {t!r} splits into pieces {t[:k]!r} {t[k:]!r} that no merge joins, "
                                  "so llama.cpp (which merges every such pair) would tokenize the GGUF file "
                                  "differently")
    n = len(pairs)
    return {i: -float(first.get(t, n + i)) for t, i in vocab.items()}


def _steps(part) -> list[dict]:
    """A tokenizer.json normalizer or pre-tokenizer as its list of steps."""
    if not isinstance(part, dict):
        return []
    return [s for s in part.get("normalizers") or part.get("pretokenizers") or [] if isinstance(s, dict)] \
        if part.get("type") == "Sequence" else [part]


def _space_symbol(tj: dict) -> bool:
    """Whether a tokenizer.json writes spaces as SentencePiece's ▁ (a Replace or a Metaspace)."""
    steps = _steps(tj.get("normalizer")) + _steps(tj.get("pre_tokenizer"))
    return any(s.get("type") == "Metaspace" or (s.get("type") == "Replace" and s.get("content") == SPACE)
               for s in steps)


def _space_prefix(tj: dict) -> bool:
    """Whether it puts ▁ in front of a text (llama.cpp's add_space_prefix): a Prepend of ▁, or
    a Metaspace that prepends (prepend_scheme first / always, or the older add_prefix_space)."""
    for s in _steps(tj.get("normalizer")) + _steps(tj.get("pre_tokenizer")):
        if s.get("type") == "Prepend" and s.get("prepend") == SPACE:
            return True
        if s.get("type") == "Metaspace":
            return s.get("prepend_scheme", "always" if s.get("add_prefix_space", True) else "never") != "never"
    return False


def _template_adds(tj: dict, cfg: dict, field: str, at: int) -> bool:
    """Whether the post-processor puts the tokenizer_config's `field` token first (at 0) or
    last (at -1) around a text: add_bos_token / add_eos_token where the config says neither."""
    tok = cfg.get(field)
    tok = tok.get("content") if isinstance(tok, dict) else tok
    single = [s for p in _steps(tj.get("post_processor")) if p.get("type") == "TemplateProcessing"
              for s in p.get("single") or []]
    return bool(single) and isinstance(tok, str) and single[at].get("SpecialToken", {}).get("id") == tok


def _pre_name(pre, path: Path) -> str:
    """The tokenizer.ggml.pre name of a tokenizer.json pre-tokenizer (one llama.cpp knows)."""
    if isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        splits = [p for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
        regexes = tuple((p.get("pattern") or {}).get("Regex") for p in splits)
        for name, known in PRE_TOKENIZERS.items():
            if known == regexes:
                return name
    raise MoerunError(f"{path}: its pre-tokenizer is not one GGUF names (known: {', '.join(sorted(PRE_TOKENIZERS))})")



# -- random-weight files (`moerun random-model ... --quant q8_0`) ------------------------------

RANDOM_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
CHUNK_BLOCKS = 1 << 20  # blocks generated and written at a time (34 MiB of Q8_0)
# fp16 block scales drawn uniformly in this range: N(0, 0.02) weights have a block absmax near
# 0.05, so d = absmax / 127 (Q8_0) or absmax / -8 (Q4_0, magnitude)
SCALE_RANGE = {"Q8_0": (2e-4, 6e-4), "Q4_0": (4e-3, 8e-3)}


def random_blocks(gtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` random GGUF blocks of `gtype` (uint8 [n, block bytes]): a random fp16 scale of a
    sensible magnitude, then random quants (Q8_0: int8 in [-127, 127]; Q4_0: any nibbles)."""
    per = 32 if gtype == "Q8_0" else 16
    out = np.empty((n, 2 + per), dtype=np.uint8)
    lo, hi = SCALE_RANGE[gtype]
    out[:, :2] = rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    q = out[:, 2:]
    q[:] = np.frombuffer(rng.bytes(n * per), dtype=np.uint8).reshape(n, per)
    if gtype == "Q8_0":  # -128 is not a Q8_0 level
        np.maximum(q.view(np.int8), -127, out=q.view(np.int8))
    return out


def _random_float(shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Float parameters in the Hugging Face model's space (the converter's transforms are
    applied on the way out): 1-D tensors (norms, biases, per-head scalars) ones, matrices
    N(0, 0.02), as `moerun.bench.random_model` writes them."""
    if len(shape) == 1:
        return torch.ones(shape)
    return torch.randn(shape, generator=gen) * 0.02


def write_random(out, cfg: dict, qtype: str = "q8_0", seed: int = 0, force: bool = False,
                 progress: bool = True) -> dict:
    """A random-weight GGUF file with `cfg`'s shapes (a `random_model.preset_config`), written
    tensor by tensor: the quantized tensors (every matrix `export --type qtype` quantizes:
    experts, attention, DeltaNet projections, embeddings, head) as random `qtype` blocks made
    directly in chunks of `CHUNK_BLOCKS`, the rest (norms, routers, gates, A_log, conv) F32
    random floats through the converter's transforms. Neither the model nor a float copy of a
    quantized tensor is ever held. The tokenizer is a SentencePiece-style stand-in of
    placeholder pieces (token ids only: `bench` and `info`, not text). Written into a
    temporary directory beside `out` and renamed at the end: a failure (a full disk) leaves
    nothing behind."""
    import gguf


    out = Path(out)
    gtype_q = RANDOM_TYPES.get(qtype)
    if gtype_q is None:
        raise MoerunError(f"a random GGUF file is written as {' or '.join(RANDOM_TYPES)}, not {short(qtype)}")
    if out.exists() and not force:
        raise MoerunError(f"{out} exists (pass --force to replace it)")
    if out.exists() and out.is_dir():
        raise MoerunError(f"{out} is a directory")
    module = module_for(cfg["model_type"])
    args = module.ModelArgs.from_dict(cfg)
    net = build_on_meta(module, args)
    arch = ARCHS.get(MODEL_TYPES.get(args.model_type, ""))
    if arch is None:
        raise MoerunError(f"{args.model_type!r} cannot be written as GGUF")
    plan = _plan(net, args, arch, qtype, torch.float32)  # float32: the float tensors are F32
    # the plan's float producers read the net's parameters: give those (small) ones values
    gen = torch.Generator().manual_seed(seed)
    inverse = {g: n for n, g in gguf_names(_float_net(net, args), arch).items()}
    for gname, gtype, shape, _ in plan:
        if gtype in ("F32", "BF16"):
            name = inverse[gname]
            owner, _, leaf = name.rpartition(".")
            mod = net.get_submodule(owner)
            p = getattr(mod, leaf)
            setattr(mod, leaf, nn.Parameter(_random_float(tuple(p.shape), gen), requires_grad=False))
        elif gtype not in RANDOM_TYPES.values():
            raise MoerunError(f"{gname}: the random writer makes {', '.join(RANDOM_TYPES.values())} blocks, not {gtype}")
    total = sum(_nbytes(g, s) for _, g, s, _ in plan)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total:
        raise MoerunError(f"{out.parent} has {free / 1e9:.1f} GB free; the file needs {total / 1e9:.1f} GB")
    w = gguf.GGUFWriter(path=None, arch=arch.name)
    _metadata(w, args, arch, qtype, Path(out.stem))
    _standin_tokenizer(w, args.vocab_size)
    for name, gtype, shape, _ in plan:
        _tensor_info(w, name, gtype, shape)
    rng = np.random.default_rng(seed)
    with _staged(out, w) as (tmp, _):
        w.write_header_to_file(tmp / out.name)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        with tqdm(total=total, unit="B", unit_scale=True, desc="writing random GGUF", file=sys.stderr,
                  disable=not progress) as bar:
            for _, gtype, shape, make in plan:
                nbytes = _nbytes(gtype, shape)
                w.write_padding(fout, fout.tell())
                if gtype in ("F32", "BF16"):
                    data = make()
                    assert data.nbytes == nbytes
                    _write(fout, data)
                    bar.update(nbytes)
                else:
                    n = nbytes // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gtype]][1]
                    for start in range(0, n, CHUNK_BLOCKS):
                        data = random_blocks(gtype, min(CHUNK_BLOCKS, n - start), rng)
                        _write(fout, data)
                        bar.update(data.nbytes)
                w.write_padding(fout, nbytes)
        fout.flush()
        os.fsync(fout.fileno())  # a full disk shows here at the latest, before the rename
    types = _type_counts(plan)
    return {"output": str(out), "architecture": arch.name, "type": qtype, "tensors": len(plan),
            "bytes": out.stat().st_size, "types": types}


def _write(fout, data: np.ndarray) -> None:
    """All of `data`'s bytes (a short write, e.g. on a full disk, raises)."""
    mv = memoryview(np.ascontiguousarray(data)).cast("B")
    while mv:
        n = fout.write(mv)
        if n is None or n <= 0:
            raise OSError(28, "short write")
        mv = mv[n:]


def _standin_tokenizer(w, vocab_size: int) -> None:
    """A SentencePiece-style vocabulary of placeholder pieces (llama.cpp needs one; moerun
    reads the weights and runs `bench`/`info` without building it)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [f"<t{i}>" for i in range(len(tokens), vocab_size)]
    types += [1] * (vocab_size - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:vocab_size])
    w.add_token_scores([0.0] * vocab_size)
    w.add_token_types(types[:vocab_size])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)


@contextlib.contextmanager
def _staged(out: Path, w) -> Iterator[tuple[Path, list[Path]]]:
    """(a temporary directory beside `out` for GGUF writer `w`'s files, the list their final
    paths go into): when the block ends, `w` is closed and the files move beside `out` with
    the mode a plainly written file gets (mkdtemp's are private); whatever fails, `w` is
    closed and nothing is left behind."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    moved: list[Path] = []
    try:
        yield tmp, moved
        w.close()
        umask = os.umask(0)
        os.umask(umask)
        for f in sorted(tmp.iterdir()):
            f.chmod(0o666 & ~umask)
            os.replace(f, out.parent / f.name)
            moved.append(out.parent / f.name)
    except BaseException:
        w.close()
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _type_counts(plan) -> dict[str, int]:
    """How many tensors of each GGUF type a write plan holds."""
    types: dict[str, int] = {}
    for _, g, _, _ in plan:
        types[g] = types.get(g, 0) + 1
    return types
