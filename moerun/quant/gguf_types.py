"""Which ggml type llama-quantize gives each tensor of a GGUF file.

`tensor_type(recipe, name, shape, n_layer, arch)` mirrors `llama_tensor_get_type` (llama.cpp
src/llama-quant.cpp) for the recipes moerun writes (`moerun export-gguf --type`); see its
docstring. The blocks themselves are made by `moerun.kernels.ggml_quant.quantize`.
"""

from __future__ import annotations

import re

from ..kernels.ggml_quant import BLOCKS

# recipe (llama-quantize's ftype name, lower case) -> its default tensor type
RECIPES: dict[str, str] = {
    "q4_k_m": "q4_k",
    "q5_k_m": "q5_k",
    "q6_k": "q6_k",
    "q8_0": "q8_0",
    "q4_0": "q4_0",
    "bf16": "bf16",
    "f32": "f32",
}

_QUANTIZED = {"q4_k", "q5_k", "q6_k", "q5_0", "q4_0", "q8_0"}

# 2-D+ tensors that llama-quantize copies as they are and convert_hf_to_gguf writes in F32
_KEEP_F32 = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp_shexp.weight",
    "ffn_gate_tid2eid.weight",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "position_embd",
    "token_types",
    "attn_rel_b.weight",
)

_LAYER = re.compile(r"^blk\.(\d+)\.")


def _n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last one (ggml order) that is not 1; torch order here."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    return len(dims)


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _category(name: str) -> str:
    """tensor_get_category, by the same substring tests in the same order."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (
        ("attn_qkv.weight", "attn_v"),  # the attn_v rules take QKV and KV_B as well
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if key in name:
            return cat
    return "other"


def _layer_of(name: str, n_layer: int) -> int:
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"cannot tell the layer of tensor {name!r} (expected blk.N.)")
    i = int(m.group(1))
    if i >= n_layer:
        raise ValueError(f"tensor {name!r}: layer {i} is past n_layer = {n_layer}")
    return i


def tensor_type(
    recipe: str,
    name: str,
    shape: tuple[int, ...],
    n_layer: int,
    arch: str | None = None,
    *,
    n_expert: int = 0,
    tied_embeddings: bool = False,
) -> str:
    """The ggml type llama-quantize gives GGUF tensor `name` under `recipe`.

    Returns one of `q4_k`, `q5_k`, `q6_k`, `q5_0`, `q8_0`, `q4_0`, `bf16`, `f32`, `f16`.

    - `recipe`: `q4_k_m`, `q5_k_m`, `q6_k`, `q8_0`, `q4_0` (llama-quantize's ftypes), `bf16`, `f32`
      (convert_hf_to_gguf's `--outtype`).
    - `shape`: torch order, the row width (GGUF ne[0]) last; leading 1s count as absent, as in
      ggml_n_dims (a `[1, H]` shared-expert gate is 1-D).
    - `n_layer`: the number of blocks in the file (`{arch}.block_count`, MTP/nextn blocks
      included): llama.cpp's `n_layer_all`.
    - `n_expert`: `{arch}.expert_count`. Only 8 matters (Mixtral): attn_k/attn_v -> Q8_0 and,
      under Q4_K_M, attn_output -> Q5_K.
    - `tied_embeddings`: the file has no `output.weight`, so `token_embd.weight` is also the
      output head and gets its type.

    The rules of llama_tensor_get_type (llama.cpp src/llama-quant.cpp) for these ftypes:

    - Not quantized, kept F32 as convert_hf_to_gguf writes them: 1-D tensors, anything not
      ending in `weight`, `*_norm.weight`, routers (`ffn_gate_inp`, `ffn_gate_inp_shexp`),
      `ssm_conv1d`.
    - `output.weight` (and a tied `token_embd.weight`): Q6_K, unless the recipe is Q8_0 (stays
      Q8_0) or the row width is not a multiple of the default type's block (Q8_0).
    - attn_v-like tensors (`attn_v`, `attn_qkv`, `attn_kv_b`): Q6_K under Q4_K_M / Q5_K_M in the
      layers where use_more_bits(i, n) (the first n/8, the last n/8, and every third between);
      Q8_0 under any quantized recipe when n_expert == 8.
    - `ffn_down*` (dense, `_exps`, `_shexp`): Q6_K under Q4_K_M / Q5_K_M where
      use_more_bits(layer, n_layer).
    - Everything else 2-D and up gets the recipe's type.
    - Fallback when the row width is not a multiple of the block: Q4_K -> Q5_0, Q6_K -> Q8_0,
      Q5_K -> Q5_1 in llama.cpp, and then F16 when the width isn't a multiple of 32 either.
      Q8_0/Q4_0 rows that aren't a multiple of 32: llama-quantize fails, so does this.

    Deviations:

    - Q5_K's fallback is Q8_0 here, not Q5_1: moerun builds no Q5_1 (more bits, never fewer).
    - llama.cpp counts attn_v-like tensors in the order it reads them (by layer) and compares
      the count with the number of such tensors; here the index is the layer number and the
      count is n_layer, which agree when every block has one attn_v-like tensor (qwen3moe:
      attn_v; qwen35moe: attn_qkv in linear-attention blocks, attn_v in full-attention ones;
      deepseek2 with attn_kv_b; mixtral, olmoe, qwen2moe).
    - Falcon's rules, the 70B-model attn_v bump, the IQ*/Q2_K/Q3_K/Q4_K_S/Q5_K_S ftypes and
      user overrides (`--tensor-type`, `--output-tensor-type`, `--pure`, imatrix) are not modelled.
    """
    recipe = recipe.lower()
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    default = RECIPES[recipe]
    shape = tuple(int(s) for s in shape)
    if (
        _n_dims(shape) < 2
        or not name.endswith("weight")
        or any(key in name for key in _KEEP_F32)
    ):
        return "f32"
    if default not in _QUANTIZED:
        return default
    ncols = shape[-1]
    category = _category(name)
    if tied_embeddings and category == "token_embd":
        category = "output"
    new = default
    if category == "output":
        if ncols % BLOCKS[default][0]:
            new = "q8_0"
        elif default != "q8_0":
            new = "q6_k"
    elif category == "attn_v":
        if recipe in ("q4_k_m", "q5_k_m") and _use_more_bits(_layer_of(name, n_layer), n_layer):
            new = "q6_k"
        if n_expert == 8:
            new = "q8_0"
    elif category == "attn_k":
        if n_expert == 8:
            new = "q8_0"
    elif category == "attn_output":
        if n_expert == 8 and recipe == "q4_k_m":
            new = "q5_k"
    elif category == "ffn_down":
        if recipe in ("q4_k_m", "q5_k_m") and _use_more_bits(_layer_of(name, n_layer), n_layer):
            new = "q6_k"
    return _fallback(new, name, ncols)


def _fallback(new: str, name: str, ncols: int) -> str:
    block = BLOCKS[new][0]
    if ncols % block == 0:
        return new
    if new in ("q8_0", "q4_0", "q5_0"):
        raise ValueError(
            f"tensor {name!r}: rows of {ncols} are not a multiple of {block}, "
            f"which {new} needs (llama-quantize has no fallback for it either)"
        )
    new = {"q4_k": "q5_0", "q5_k": "q8_0", "q6_k": "q8_0"}[new]
    return new if ncols % BLOCKS[new][0] == 0 else "f16"
