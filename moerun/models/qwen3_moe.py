"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with per-head q/k RMSNorm, softmax top-k
routing, optional dense layers (`mlp_only_layers`, `decoder_sparse_step`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import BaseModelArgs, rope_parameters
from ..layers.cache import KVSpec
from ..layers.attention import FusedAttention, attend, attn_residual
from ..layers.moe import Experts, GatedMLP, moe_residual, softmax_topk
from ..layers.norm import RMSNorm
from ..layers.rope import Rope, norm_rope
from .driver import CausalLM

# B batch, T tokens, H hidden, E experts, K experts per token, D head dim


@dataclass(frozen=True)
class ModelArgs(BaseModelArgs):
    aliases = {"num_local_experts": "num_experts"}

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    head_dim: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope: dict[str, Any] | None = None

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in 1..num_experts")

    @classmethod
    def from_dict(cls, d):
        return super().from_dict({**d, "rope": rope_parameters(d)})

    def is_sparse(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


class Attention(FusedAttention):
    # its forward over a few tokens is what layers.attention.attention_fuses's native
    # block computes

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = a.head_dim**-0.5
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x, cos_sin, kv, slots, pos0):
        B, T, _ = x.shape
        q = norm_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), self.q_norm, cos_sin)
        k = norm_rope(self.k_proj(x).view(B, T, self.n_kv, self.head_dim), self.k_norm, cos_sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, kv, slots, pos0, self.scale)  # [B, heads, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class SparseMoeBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = a.num_experts_per_tok, a.norm_topk_prob
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)  # the router
        self.experts = Experts(a.num_experts, a.hidden_size, a.moe_intermediate_size)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])  # [B*T, H]
        weights, ids = softmax_topk(self.gate, h, self.top_k, self.norm_topk_prob)  # [B*T, K]
        return self.experts(h, ids, weights).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = SparseMoeBlock(a) if a.is_sparse(layer) else GatedMLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos_sin, kv, slots, pos0):
        x = attn_residual(x, self.input_layernorm, self.self_attn, cos_sin, kv, slots, pos0)  # x + attn(norm(x))
        return moe_residual(x, self.post_attention_layernorm, self.mlp)  # x + mlp(norm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rope = Rope(a.rope, a.head_dim, a.max_position_embeddings)


class Model(CausalLM):
    tied_parameters = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Qwen3MoeModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def cache_spec(self) -> list:
        a = self.args
        return [KVSpec(a.num_key_value_heads, a.head_dim, a.head_dim)] * a.num_hidden_layers
