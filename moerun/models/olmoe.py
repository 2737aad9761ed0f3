"""OLMoE (OLMoE-1B-7B): GQA with RMSNorm over the whole q and k projections (not per head),
optional clipping of q/k/v (`clip_qkv`), every layer sparse with softmax top-k routing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import BaseModelArgs, rope_parameters
from ..layers.cache import KVSpec
from ..layers.attention import FusedAttention, attend, attn_residual
from ..layers.moe import Experts, moe_residual, softmax_topk
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
    intermediate_size: int  # the width of one expert
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    norm_topk_prob: bool = False
    clip_qkv: float | None = None
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope: dict[str, Any] | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            # transformers sizes q_norm by hidden_size: heads must split hidden_size evenly
            raise ValueError("num_attention_heads * head_dim must equal hidden_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in 1..num_experts")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError("clip_qkv must be positive or null")

    @classmethod
    def from_dict(cls, d):
        return super().from_dict({**d, "rope": rope_parameters(d)})


class Attention(FusedAttention):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = a.head_dim**-0.5
        self.clip = a.clip_qkv
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * a.head_dim, a.hidden_size, bias=a.attention_bias)
        # one norm over all heads together, unlike Qwen3's per-head q/k norm
        self.q_norm = RMSNorm(self.n_heads * a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(self.n_kv * a.head_dim, a.rms_norm_eps)

    def fusable(self) -> bool:
        """The fused native block (its q/k norms across all heads) clips nothing: only without
        clip_qkv."""
        return self.clip is None

    def forward(self, x, cos_sin, kv, slots, pos0):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x))  # [B, T, heads*D]
        k = self.k_norm(self.k_proj(x))  # [B, T, kv heads*D]
        v = self.v_proj(x)
        if self.clip is not None:  # after the norms, before rope, as OLMo does
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = norm_rope(q.view(B, T, self.n_heads, self.head_dim), None, cos_sin)  # [B, heads, T, D]
        k = norm_rope(k.view(B, T, self.n_kv, self.head_dim), None, cos_sin)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, kv, slots, pos0, self.scale)  # [B, heads, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class SparseMoeBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = a.num_experts_per_tok, a.norm_topk_prob
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)  # the router
        self.experts = Experts(a.num_experts, a.hidden_size, a.intermediate_size)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])  # [B*T, H]
        weights, ids = softmax_topk(self.gate, h, self.top_k, self.norm_topk_prob)  # [B*T, K]
        return self.experts(h, ids, weights).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = SparseMoeBlock(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos_sin, kv, slots, pos0):
        x = attn_residual(x, self.input_layernorm, self.self_attn, cos_sin, kv, slots, pos0)  # x + attn(norm(x))
        return moe_residual(x, self.post_attention_layernorm, self.mlp)  # x + mlp(norm(x))


class OlmoeModel(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rope = Rope(a.rope, a.head_dim, a.max_position_embeddings)


class Model(CausalLM):
    tied_parameters = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = OlmoeModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def cache_spec(self) -> list:
        a = self.args
        return [KVSpec(a.num_key_value_heads, a.head_dim, a.head_dim)] * a.num_hidden_layers
