"""Qwen3-Next (Qwen3-Next-80B-A3B), the predecessor of Qwen3.5/3.6-MoE: the same layers (Gated
DeltaNet and gated full attention in `layer_types`, softmax top-k routing plus a sigmoid-gated
shared expert, zero-centred RMSNorm, partial rotary, an MTP head), so it runs on
`qwen3_5_moe`'s modules and native decode path. What differs:

- The checkpoint fuses the DeltaNet input projections per key head: `in_proj_qkvz` holds, for
  each key head g, [q_g (Dk), k_g (Dk), v (r * Dv), z (r * Dv)] with r = Hv / Hk (the value
  heads g*r .. g*r+r-1), and `in_proj_ba` [b (r), a (r)] per key head. The loader takes
  `in_proj_qkv` (all q, all k, all v), `in_proj_z`, `in_proj_b` and `in_proj_a` as those
  rows (`checkpoint_parts`, `fused_rows`): the value heads keep their order, so the conv
  channels and the rest are Qwen3.5's as stored.
- `norm_topk_prob` is read from the config (Qwen3.5 always renormalises).
- Dense layers: `mlp_only_layers` and `decoder_sparse_step` as Qwen2-MoE (a dense layer is a
  plain SwiGLU MLP of `intermediate_size`; released checkpoints have none), a native stack
  half of its own (`mlp_block`).
- Rope is plain partial rotary (Qwen3.5's M-RoPE is the same for text).
- The MTP head: the released config.json does not say `mtp_num_hidden_layers` while the
  checkpoints hold one `mtp.*` layer (transformers ignores it, vLLM runs it as Qwen3.5's), so
  one is assumed, and the model loads without it when the checkpoint has none of its tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.moe import GatedMLP
from . import qwen3_5_moe as q35


@dataclass(frozen=True)
class ModelArgs(q35.ModelArgs):
    intermediate_size: int = 5632  # dense layers (transformers' default)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mtp_num_hidden_layers: int = 1  # see the module's docstring

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_only_layers is None:
            object.__setattr__(self, "mlp_only_layers", ())

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def fused_rows(a: ModelArgs) -> dict[str, torch.Tensor]:
    """Our DeltaNet projection -> its rows in the checkpoint's fused one (`in_proj_qkvz` for
    qkv and z, `in_proj_ba` for b and a), key head by key head."""
    nk, dk, dv = a.linear_num_key_heads, a.linear_key_head_dim, a.linear_value_head_dim
    r = a.linear_num_value_heads // nk

    def span(width: int, start: int, n: int) -> torch.Tensor:  # rows start..start+n of each head's block
        return (torch.arange(nk)[:, None] * width + start + torch.arange(n)).reshape(-1)

    w = 2 * dk + 2 * r * dv
    return {"in_proj_qkv": torch.cat([span(w, 0, dk), span(w, dk, dk), span(w, 2 * dk, r * dv)]),
            "in_proj_z": span(w, 2 * dk + r * dv, r * dv),
            "in_proj_b": span(2 * r, 0, r), "in_proj_a": span(2 * r, r, r)}


def _mlp_for(a: ModelArgs, layer: int):
    if a.is_sparse(layer):
        return q35.SparseMoeBlock(a, a.norm_topk_prob)
    return GatedMLP(a.hidden_size, a.intermediate_size)


class Model(q35.Model):
    # our parameter (regex) <- rows (`fused_rows`) of the checkpoint tensor the replacement names
    checkpoint_parts = [
        (r"^(.*\.linear_attn)\.(in_proj_(?:qkv|z))\.weight$", r"\1.in_proj_qkvz.weight",
         lambda a, m: fused_rows(a)[m[2]]),
        (r"^(.*\.linear_attn)\.(in_proj_[ba])\.weight$", r"\1.in_proj_ba.weight",
         lambda a, m: fused_rows(a)[m[2]]),
    ]
    mlp_for = staticmethod(_mlp_for)
