"""Mixtral (Mixtral-8x7B, Mixtral-8x22B): GQA without q/k norm, every layer sparse, top-k of a
softmax router renormalised over the chosen experts, optional sliding-window attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BaseModelArgs, rope_parameters
from ..layers.cache import KVSpec
from ..layers.attention import FusedAttention, attend, attn_residual
from ..layers.moe import Experts, moe_residual, softmax_topk
from ..layers.norm import RMSNorm
from ..layers.rope import Rope, norm_rope
from .driver import CausalLM

# B batch, T tokens, S keys, H hidden, E experts, K experts per token, D head dim

DEFAULT_ROPE_THETA = 1e6  # MixtralConfig's default when config.json names none


@dataclass(frozen=True)
class ModelArgs(BaseModelArgs):
    aliases = {"num_experts": "num_local_experts"}

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the width of one expert
    num_hidden_layers: int
    num_attention_heads: int
    num_local_experts: int
    num_experts_per_tok: int = 2
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    rope: dict[str, Any] | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError("num_experts_per_tok must be in 1..num_local_experts")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("sliding_window must be a positive number of tokens or null")

    @classmethod
    def from_dict(cls, d):
        if not d.get("rope_parameters") and "rope_theta" not in d:
            d = {**d, "rope_theta": DEFAULT_ROPE_THETA}
        return super().from_dict({**d, "rope": rope_parameters(d)})


def attend_window(q, k, v, kv, slots, pos0, scale, window: int | None):
    """`attend` where a query at position p sees only keys at p-window+1 .. p (as transformers'
    sliding-window mask). The cache keeps every position; old keys are masked, not dropped."""
    T = q.shape[2]
    if window is None or int(pos0.max()) + T <= window:
        return attend(q, k, v, kv, slots, pos0, scale)
    if kv is not None:
        k, v = kv.update(slots, pos0, k, v)  # [B, kv heads, S, D]
    # uncached passes start at position 0, so in both cases key s sits at position s
    key_pos = torch.arange(k.shape[2])  # [S]
    query_pos = (pos0[:, None] + torch.arange(T))[:, :, None]  # [B, T, 1]
    mask = ((key_pos <= query_pos) & (key_pos > query_pos - window))[:, None]  # [B, 1, T, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


class Attention(FusedAttention):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = a.head_dim**-0.5
        self.window = a.sliding_window
        # (the fused native decode call, `layers.attention.attention_fuses`, takes the window too)
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * a.head_dim, a.hidden_size, bias=False)

    def forward(self, x, cos_sin, kv, slots, pos0):
        B, T, _ = x.shape
        q = norm_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), None, cos_sin)
        k = norm_rope(self.k_proj(x).view(B, T, self.n_kv, self.head_dim), None, cos_sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        out = attend_window(q, k, v, kv, slots, pos0, self.scale, self.window)  # [B, heads, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class SparseMoeBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = a.num_experts_per_tok, True
        self.gate = nn.Linear(a.hidden_size, a.num_local_experts, bias=False)  # the router
        self.experts = Experts(a.num_local_experts, a.hidden_size, a.intermediate_size)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])  # [B*T, H]
        # transformers' order: softmax over all E, top-k, renormalise; the same as a softmax
        # over the K chosen logits, but this order keeps the fp32 rounding identical
        weights, ids = softmax_topk(self.gate, h, self.top_k, renorm=self.norm_topk_prob)  # [B*T, K]
        return self.experts(h, ids, weights).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = SparseMoeBlock(a)  # `block_sparse_moe` in checkpoints
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos_sin, kv, slots, pos0):
        x = attn_residual(x, self.input_layernorm, self.self_attn, cos_sin, kv, slots, pos0)  # x + attn(norm(x))
        return moe_residual(x, self.post_attention_layernorm, self.mlp)  # x + mlp(norm(x))


class MixtralModel(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rope = Rope(a.rope, a.head_dim, a.max_position_embeddings)


class Model(CausalLM):
    tied_parameters = {"lm_head.weight": "model.embed_tokens.weight"}
    # Hub checkpoints: block_sparse_moe.experts.{e}.w1/w3/w2 (gate/up/down); transformers 5
    # in memory (and fused checkpoints) say mlp.experts.gate_up_proj/down_proj
    checkpoint_renames = [
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    ]

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = MixtralModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def cache_spec(self) -> list:
        a = self.args
        return [KVSpec(a.num_key_value_heads, a.head_dim, a.head_dim)] * a.num_hidden_layers
