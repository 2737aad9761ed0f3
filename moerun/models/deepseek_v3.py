"""DeepSeek-V3 (and the smaller models on its code path): multi-head latent attention (MLA)
with a compressed KV cache, YaRN rope, sigmoid routing with grouped top-k and a selection-only
bias, shared experts, dense first layers, and the multi-token-prediction (MTP) module.

The MTP module is checkpoint layer `model.layers.{num_hidden_layers}` (enorm, hnorm,
eh_proj, one decoder block, shared_head.norm); we load it as `mtp.0`, apart from the trunk.
Its embedding and output head are the main model's (DeepSeek stores copies of both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BaseModelArgs, rope_parameters
from ..layers.cache import KVCache, KVSpec
from ..layers.quantized import QuantizedLinear
from ..errors import MoerunError
from .. import kernels
from ..layers.moe import Experts, GatedMLP, moe_residual, sigmoid_grouped_topk
from ..layers.norm import RMSNorm, rms_norm_cat
from ..kernels.reference import apply_rope
from ..layers.rope import Rope
from .driver import CausalLM

# B batch, T tokens, S cached tokens, H hidden, N heads, E experts, K experts per token,
# R kv_lora_rank (the latent), Dn/Dr/Dv the no-rope, rope and value head dims


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelArgs(BaseModelArgs):
    aliases = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    # behaviour fields default as transformers' DeepseekV3Config does when a key is absent
    q_lora_rank: int | None = 1536
    n_shared_experts: int | None = 1
    routed_scaling_factor: float = 2.5
    n_group: int | None = 8
    topk_group: int | None = 4
    first_k_dense_replace: int | None = 3
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    rope_interleave: bool | None = True
    tie_word_embeddings: bool = False
    # unlike transformers (which defaults to 1), an absent field means no MTP module
    num_nextn_predict_layers: int | None = 0
    rope: dict[str, Any] | None = None

    def __post_init__(self):
        fix = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        fix("n_group", self.n_group or 1)
        fix("topk_group", self.topk_group or self.n_group)
        fix("first_k_dense_replace", self.first_k_dense_replace or 0)
        fix("n_shared_experts", self.n_shared_experts or 0)
        fix("num_nextn_predict_layers", self.num_nextn_predict_layers or 0)
        fix("rope_interleave", True if self.rope_interleave is None else self.rope_interleave)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.n_routed_experts % self.n_group:
            raise ValueError("n_routed_experts must be a multiple of n_group")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError("grouped routing needs at least 2 experts per group")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError("topk_group must be in 1..n_group")
        if not 0 < self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError("num_experts_per_tok must be in 1..(experts in the topk_group groups)")

    @classmethod
    def from_dict(cls, d):
        quant = d.get("quantization_config") or {}
        if quant.get("quant_method") == "fp8":
            # DeepSeek's own release: fp8 weights with per-block `weight_scale_inv` tensors
            raise MoerunError("FP8 checkpoints (quantization_config fp8) are not supported yet; "
                              "use a bf16 conversion of the model")
        return super().from_dict({**d, "rope": rope_parameters(d)})

    @property
    def softmax_scale(self) -> float:
        """(Dn+Dr)^-0.5, times mscale(factor, mscale_all_dim)^2 under a scaled rope, as transformers does."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rope = self.rope or {}
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            factor = rope.get("factor") or self.max_position_embeddings / rope["original_max_position_embeddings"]
            m = yarn_mscale(float(factor), float(rope["mscale_all_dim"]))
            scale = scale * m * m
        return scale


def causal_mask(pos0: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """Which of S cached keys each of T queries sees ([B, 1, T, S]); row b starts at pos0[b]."""
    query_pos = pos0[:, None] + torch.arange(T)  # [B, T]
    return (torch.arange(S)[None, None, :] <= query_pos[:, :, None])[:, None]


class Attention(nn.Module):
    """MLA. The cache holds the normed latent [R] and the roped shared key [Dr] per token.

    Prefill expands the latent into per-head keys and values; decode (one token per row)
    absorbs kv_b_proj into the query and the output instead, so it reads only the latent.
    The cache keeps both in one row per position (`KVSpec(joined=True)`), which a decode-sized
    pass's native call (`mla_residual`, the native stack's `add_mla`) reads as one key.
    """

    mla = True  # (the native stack takes its half as MLA: `layers.stack`)

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.rank = a.num_attention_heads, a.kv_lora_rank
        self.dn, self.dr, self.dv = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.interleaved = a.rope_interleave
        self.scale = a.softmax_scale
        qk_dim = self.n_heads * (self.dn + self.dr)
        if a.q_lora_rank is None:
            self.q_proj = nn.Linear(a.hidden_size, qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(a.hidden_size, a.q_lora_rank, bias=a.attention_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, 1e-6)  # the reference uses the default eps here
            self.q_b_proj = nn.Linear(a.q_lora_rank, qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden_size, self.rank + self.dr, bias=a.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, self.n_heads * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.dv, a.hidden_size, bias=a.attention_bias)

    def half_plan(self, x, norm, kv) -> tuple | None:
        """The decode program's plan for x + self(norm(x)) as one native call (`mla_residual`'s),
        or None where the pass is not one the MLA block serves."""
        return _half_plan(x, norm, self, kv)

    def forward(self, x, cos_sin, kv, slots, pos0):
        B, T, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.n_heads, self.dn + self.dr).transpose(1, 2)  # [B, N, T, Dn+Dr]
        q_nope, q_rot = q.split([self.dn, self.dr], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.dr], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # [B, 1, T, R]
        k_rot = k_rot[:, None]  # [B, 1, T, Dr]
        q_rot = apply_rope(q_rot, *cos_sin, interleaved=self.interleaved)
        k_rot = apply_rope(k_rot, *cos_sin, interleaved=self.interleaved)
        if kv is not None:
            latent, k_rot = kv.update(slots, pos0, latent, k_rot)  # [B, 1, S, R], [B, 1, S, Dr]
        if kv is not None and T == 1:
            out = self._absorbed(q_nope, q_rot, latent, k_rot, pos0)
        else:
            out = self._expanded(q_nope, q_rot, latent, k_rot, pos0 if kv is not None else None)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # out [B, N, T, Dv]

    def _expanded(self, q_nope, q_rot, latent, k_rot, pos0):
        B, _, S, _ = latent.shape
        T = q_nope.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).view(B, S, self.n_heads, self.dn + self.dv).transpose(1, 2)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)  # [B, N, S, Dn], [B, N, S, Dv]
        k = torch.cat((k_nope, k_rot.expand(-1, self.n_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rot), dim=-1)
        if pos0 is None or (B == 1 and S == T):
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(pos0, T, S), scale=self.scale)

    def _absorbed(self, q_nope, q_rot, latent, k_rot, pos0):
        B, _, S, _ = latent.shape
        T = q_nope.shape[2]
        w = self.kv_b_proj.weight.view(self.n_heads, self.dn + self.dv, self.rank)
        q_lat = torch.einsum("bntd,ndr->bntr", q_nope, w[:, : self.dn])  # [B, N, T, R]
        # fp32 over the cache: torch's CPU bf16 matmuls of these shapes are 4-7x slower
        latent = latent.float()
        scores = q_lat.float() @ latent.transpose(-1, -2) + q_rot.float() @ k_rot.float().transpose(-1, -2)
        scores = scores * self.scale  # [B, N, T, S]
        if B > 1 or T > 1:
            scores = scores.masked_fill(~causal_mask(pos0, T, S), float("-inf"))
        out_lat = (scores.softmax(-1) @ latent).to(q_nope.dtype)  # [B, N, T, R]
        return torch.einsum("bntr,nvr->bntv", out_lat, w[:, self.dn :])  # [B, N, T, Dv]


def mla_fuses(attn: "Attention", dtype: torch.dtype) -> bool:
    """Whether the native MLA half (`kernels.mla_plan`, `mla_block`) reads this attention's parts
    as they are, in a model of `dtype`: each projection a QuantizedLinear or a contiguous
    nn.Linear of `dtype` (q_b_proj without bias), kv_b_proj a float nn.Linear without bias (it is
    never quantized), the q and kv norms plain RMSNorms, no hooks on any of them."""
    mods = attn._modules
    projs = [mods[n] for n in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj") if n in mods]
    norms = [mods[n] for n in ("q_a_layernorm", "kv_a_layernorm") if n in mods]
    kvb = mods["kv_b_proj"]
    return (all(type(p) is QuantizedLinear or type(p) is nn.Linear and p.weight.dtype == dtype
                and p.weight.is_contiguous() for p in projs)
            and ("q_b_proj" not in mods or mods["q_b_proj"].bias is None)
            and type(kvb) is nn.Linear and kvb.bias is None and kvb.weight.dtype in kernels.FLOAT_DTYPES
            and all(type(n) is RMSNorm and not n.zero_centered for n in norms)
            and not kernels.has_hooks(*projs, *norms, kvb))


def mla_applies(x: torch.Tensor, kv) -> bool:
    """Whether a pass takes the native MLA half: rows of at most FUSED_MAX_TOKENS tokens (one row,
    or a batch of at most FUSED_MAX_ROWS tokens), float32 or bf16 activations, a joined float32 or
    bf16 cache, the native extension, no autograd."""
    B, T, _ = x.shape
    return (T <= kernels.FUSED_MAX_TOKENS and (B == 1 or B * T <= kernels.FUSED_MAX_ROWS) and type(kv) is KVCache
            and kv.joined is not None and kv.joined.dtype in kernels.FLOAT_DTYPES and x.dtype in kernels.FLOAT_DTYPES
            and kernels.native() and not torch.is_grad_enabled())


def _half_plan(x, norm, attn, kv) -> tuple | None:
    """(`kernels.MlaPlan`, the input norm's `half_norm_args`) where x + attn(norm(x)) runs as one native call."""
    if (not mla_applies(x, kv) or type(norm) is not RMSNorm or norm.weight.dtype != x.dtype
            or kernels.has_hooks(attn, norm) or not mla_fuses(attn, x.dtype)):
        return None
    return kernels.mla_plan(attn), kernels.half_norm_args(norm)


def mla_residual(x, norm, attn, cos_sin, kv, slots, pos0) -> torch.Tensor:
    """x + attn(norm(x)): the layer's attention half; a decode-sized pass (`mla_applies`) as one
    native call (`mla_block`: the projections, norms, rope, the cache rows' writes, the attention
    with W_kb and W_vb absorbed, o_proj, the norm and the residual), the modules otherwise.
    Within float rounding of the module's `_absorbed` (the native call keeps float32 where torch
    rounds its einsums' and softmax's sums differently), and each tensor the bf16 module hands on
    rounded to bf16 alike. The native stack runs the same call (`NativeStack.add_mla`, its plan
    from `Attention.half_plan`), so its passes are those of this path bit for bit."""
    plan = _half_plan(x, norm, attn, kv)
    if plan is None:
        return x + attn(norm(x), cos_sin, kv, slots, pos0)
    (weights, settings), half = plan
    return kernels.mla_block(x, weights, settings, cos_sin, kv.joined, slots, pos0, half)


class Router(nn.Module):
    """Sigmoid scores; the bias picks experts (groups first) but does not weigh them."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = a.num_experts_per_tok, a.n_group, a.topk_group
        self.norm_topk_prob, self.scaling = a.norm_topk_prob, a.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(a.n_routed_experts, a.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(a.n_routed_experts))

    def routing(self) -> kernels.SigmoidRouting:
        return kernels.SigmoidRouting(self.e_score_correction_bias, self.n_group, self.topk_group, self.scaling)

    def forward(self, h):
        """h [B*T, H] -> weights [B*T, K] (fp32), ids [B*T, K] (`layers.moe.sigmoid_grouped_topk`)."""
        return sigmoid_grouped_topk(self, h, self.top_k, self.norm_topk_prob)


class MoE(nn.Module):
    """Routed experts by grouped sigmoid routing plus shared experts. A decode-sized pass runs as
    one native call with its layer's norm and residual (`layers.moe.moe_residual`)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate = Router(a)
        self.experts = Experts(a.n_routed_experts, a.hidden_size, a.moe_intermediate_size)
        if a.n_shared_experts:
            self.shared_experts = GatedMLP(a.hidden_size, a.moe_intermediate_size * a.n_shared_experts)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])  # [B*T, H]
        weights, ids = self.gate(h)
        out = self.experts(h, ids, weights.to(h.dtype))
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(h)
        return out.view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, sparse: bool):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MoE(a) if sparse else GatedMLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos_sin, kv, slots, pos0, last_only=False):
        """last_only: only the last position goes on through the MLP ([B, 1, H] out): every
        position's keys and values are cached by then, and an MTP catch-up wants no more.
        The MLP half (MoE, or a dense MLP) runs as one native call where it can (`moe_residual`),
        and so does a decode-sized attention half (`mla_residual`)."""
        x = mla_residual(x, self.input_layernorm, self.self_attn, cos_sin, kv, slots, pos0)
        if last_only:
            x = x[:, -1:]
        return moe_residual(x, self.post_attention_layernorm, self.mlp)


class SharedHead(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class MtpLayer(nn.Module):
    """h' = block(eh_proj([enorm(embed(t+1)), hnorm(h)])); logits = head(shared_head.norm(h'))."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.enorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hnorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=False)
        self.block = DecoderLayer(a, sparse=True)  # always MoE, whatever first_k_dense_replace says
        self.shared_head = SharedHead(a)


class DeepseekV3Model(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(a, sparse=i >= a.first_k_dense_replace) for i in range(a.num_hidden_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rope = Rope(a.rope, a.qk_rope_head_dim, a.max_position_embeddings)


class Model(CausalLM):
    tied_parameters = {"lm_head.weight": "model.embed_tokens.weight"}
    # the loader keeps these in fp32 whatever the model dtype (transformers does the same):
    # in bf16 the selection bias would lose the digits that separate close experts
    fp32_parameters = (r"\.mlp\.gate\.(weight|e_score_correction_bias)$",)
    # a checkpoint without any MTP tensor loads without the head (transformers writes
    # num_nextn_predict_layers into every config it saves, with or without the weights)
    optional_submodules = ("mtp",)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DeepseekV3Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MtpLayer(args) for _ in range(args.num_nextn_predict_layers))
        # The MTP blocks follow the trunk in the checkpoint's layer numbering; their copies
        # of embed_tokens and shared_head.head are left unused.
        L = args.num_hidden_layers
        self.checkpoint_renames = [
            rule
            for k in range(args.num_nextn_predict_layers)
            for rule in (
                (rf"^model\.layers\.{L + k}\.(enorm|hnorm|eh_proj|shared_head)\.", rf"mtp.{k}.\1."),
                (rf"^model\.layers\.{L + k}\.(?!embed_tokens\.)", rf"mtp.{k}.block."),
            )
        ]

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None and len(self.mtp) > 0

    def cache_spec(self) -> list:
        a = self.args
        return [KVSpec(1, a.kv_lora_rank, a.qk_rope_head_dim, joined=True)] * a.num_hidden_layers

    def mtp_cache_spec(self) -> list:
        """Decode state of one MTP depth: allocate `Cache(net.mtp_cache_spec(), ...)` per depth."""
        return [KVSpec(1, self.args.kv_lora_rank, self.args.qk_rope_head_dim, joined=True)]

    def mtp_logits(self, hidden, next_token_ids, cache=None, slots=None, *, depth=0, return_hidden=False,
                   head=None, last_only=False):
        """MTP logits for the token after next: hidden [B, T, H] at positions p..p+T-1 (the final
        normed hidden state of `forward(..., return_hidden=True)`), next_token_ids [B, T] the
        tokens at p+1..p+T -> logits [B, T, vocab], row t predicting the token at p+t+2
        (and, with return_hidden, this module's normed output [B, T, H]).

        `cache` is this depth's own `Cache(mtp_cache_spec(), ...)`: its entry i pairs hidden
        state i with token i+1, so after each decode step it holds one entry per main-cache
        token. Depth d > 0 (checkpoints with several MTP modules) takes depth d-1's output
        hidden state and the tokens one further along, and predicts the token at p+t+2+d.
        `head` stands in for the LM head (a drafter's smaller vocabulary: logits over its rows);
        with last_only the logits and hidden state are the last position's alone ([B, 1, .]):
        the block's MLP runs on it only.
        """
        if not self.has_mtp:
            raise MoerunError("this checkpoint has no MTP module (num_nextn_predict_layers is 0)")
        mtp = self.mtp[depth]
        B, T = next_token_ids.shape
        slots, pos0 = self._positions(B, cache, slots)
        e = self.model.embed_tokens(next_token_ids)
        x = mtp.eh_proj(rms_norm_cat(mtp, ("enorm", "hnorm"), [e, hidden]))  # [B, T, H]
        # rope at the new token's own position; attention sees only relative positions anyway
        cos_sin = self.model.rope.span(pos0 + 1 + depth, T, x.dtype)
        x = mtp.block(x, cos_sin, cache.layers[0] if cache is not None else None, slots, pos0, last_only=last_only)
        if cache is not None:
            cache.advance(slots, T)
        h = mtp.shared_head.norm(x)
        logits = (head or self.lm_head)(h)
        return (logits, h) if return_hidden else logits
