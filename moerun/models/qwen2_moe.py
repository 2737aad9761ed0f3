"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with q/k/v bias, softmax top-k routing
plus an always-on shared expert scaled by a sigmoid gate, optional dense layers
(`mlp_only_layers`, `decoder_sparse_step`) and optional sliding-window layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BaseModelArgs, rope_parameters
from ..layers.cache import KVSpec
from ..layers.attention import FusedAttention, attend, attn_residual
from ..layers.moe import Experts, GatedMLP, moe_residual, softmax_topk
from ..layers.norm import RMSNorm
from ..layers.rope import Rope, norm_rope
from .driver import CausalLM

# B batch, T tokens, S keys, H hidden, E experts, K experts per token, D head dim


@dataclass(frozen=True)
class ModelArgs(BaseModelArgs):
    aliases = {"num_local_experts": "num_experts"}

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers
    moe_intermediate_size: int  # one routed expert
    shared_expert_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    qkv_bias: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None
    tie_word_embeddings: bool = False
    rope: dict[str, Any] | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.mlp_only_layers is None:
            object.__setattr__(self, "mlp_only_layers", ())
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in 1..num_experts")
        if self.decoder_sparse_step < 1:
            raise ValueError("decoder_sparse_step must be at least 1")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must name one type per layer")
        if self.use_sliding_window and not (self.sliding_window or 0) > 0:
            raise ValueError("use_sliding_window needs a positive sliding_window")

    @classmethod
    def from_dict(cls, d):
        return super().from_dict({**d, "rope": rope_parameters(d)})

    def is_sparse(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def window(self, layer: int) -> int | None:
        """The layer's attention window, None for full attention (transformers 5's rule:
        windows only with use_sliding_window, on the layers layer_types marks, by default
        every other layer below max_window_layers)."""
        if not self.use_sliding_window:
            return None
        if self.layer_types is not None:
            sliding = self.layer_types[layer] == "sliding_attention"
        else:
            sliding = (layer + 1) % 2 == 1 and layer < self.max_window_layers
        return self.sliding_window if sliding else None


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
    # its forward over a few tokens is what layers.attention.attention_fuses's native
    # block computes (with the q/k/v biases and the layer's window)

    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = a.head_dim**-0.5
        self.window = a.window(layer)
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=a.qkv_bias)
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
        self.top_k, self.norm_topk_prob = a.num_experts_per_tok, a.norm_topk_prob
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)  # the router
        self.experts = Experts(a.num_experts, a.hidden_size, a.moe_intermediate_size)
        self.shared_expert = GatedMLP(a.hidden_size, a.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])  # [B*T, H]
        weights, ids = softmax_topk(self.gate, h, self.top_k, self.norm_topk_prob)  # [B*T, K]
        routed = self.experts(h, ids, weights)  # [B*T, H]
        shared = self.shared_expert.gated(h, self.shared_expert_gate)  # sigmoid([B*T, 1]) * [B*T, H]
        return (routed + shared).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(a, layer)
        self.mlp = SparseMoeBlock(a) if a.is_sparse(layer) else GatedMLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos_sin, kv, slots, pos0):
        x = attn_residual(x, self.input_layernorm, self.self_attn, cos_sin, kv, slots, pos0)  # x + attn(norm(x))
        return moe_residual(x, self.post_attention_layernorm, self.mlp)  # x + mlp(norm(x))


class Qwen2MoeModel(nn.Module):
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
        self.model = Qwen2MoeModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def cache_spec(self) -> list:
        a = self.args
        return [KVSpec(a.num_key_value_heads, a.head_dim, a.head_dim)] * a.num_hidden_layers
