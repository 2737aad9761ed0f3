"""Qwen3.5/3.6-MoE (Qwen3.6-35B-A3B): a hybrid of Gated DeltaNet linear attention and gated
full attention (`layer_types`, by default three linear layers then one full), softmax top-k
routing with renormalisation plus one always-on shared expert behind a sigmoid gate,
zero-centred RMSNorm, partial rotary, and an optional multi-token-prediction (MTP) head.

Config: either the text-only `qwen3_5_moe_text` config.json or the multimodal `qwen3_5_moe`
one, whose text part sits under `text_config` and whose tensors sit under
`model.language_model.` (the vision tower `model.visual.*` is never loaded).

Rope: transformers applies interleaved M-RoPE (three position streams: time, height, width,
picked per frequency by `mrope_section`). For text all three streams equal the token
position, so every frequency sees the same position and M-RoPE is plain rope over the first
head_dim * partial_rotary_factor channels; that is what runs here (checked in the tests).

Decode state: KV for full-attention layers; for DeltaNet layers the last K-1 conv inputs
and the [Hv, Dk, Dv] recurrent state, the latter kept in fp32 whatever the model dtype.

MTP: `mtp_logits(hidden, next_token_ids)` runs the checkpoint's `mtp.*` module on the final
normed hidden states; its full-attention layer keeps its own KV cache, a separate `Cache`
built from `mtp_cache_spec()` (not an entry of `cache_spec()`, so the engine's cache and
the draft head's cache advance independently and can be rolled back separately). The head
exists when the config says `mtp_num_hidden_layers: 1` and the checkpoint has its tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import kernels
from ..config import BaseModelArgs, rope_parameters
from ..layers.cache import KVSpec, StateSpec
from ..layers.attention import FusedAttention, attend, attn_residual
from ..kernels.reference import FEW, causal_conv1d, gated_rms_norm, split_heads
from ..layers.deltanet import DELTA_WEIGHTS, SEGMENT, gated_delta_rule, native_pass
from ..layers.linear import native_call_views, packed_views, project
from ..layers.moe import Experts, GatedMLP, moe_residual, softmax_topk
from ..layers.mtp import MtpParts, native_step, prepare as prepare_drafter
from ..layers.norm import RMSNorm, rms_norm_cat
from ..layers.rope import Rope, norm_rope
from .driver import CausalLM

# B batch, T tokens, H hidden, E experts, K experts per token, D head dim,
# Hv/Hk DeltaNet value/key heads, Dv/Dk their dims, C DeltaNet conv channels

LAYER_TYPES = ("linear_attention", "full_attention")


def text_config(cfg: dict) -> dict:
    """The text model's config from a multimodal `qwen3_5_moe` config.json (or cfg itself)."""
    if not isinstance(cfg.get("text_config"), dict):
        return cfg
    text = dict(cfg["text_config"])
    text["model_type"] = cfg["model_type"]
    if "tie_word_embeddings" in cfg:  # the top-level model owns lm_head, so its setting wins
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


@dataclass(frozen=True)
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    head_dim: int = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple[str, ...] | None = None
    full_attention_interval: int = 4
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False
    attn_output_gate: bool = True  # transformers always gates; a config saying otherwise is refused
    rope: dict[str, Any] | None = None

    def __post_init__(self):
        if self.layer_types is None:
            n = self.full_attention_interval
            types = tuple("full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if bad := set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(f"unknown layer types {sorted(bad)} (known: {', '.join(LAYER_TYPES)})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in 1..num_experts")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.mtp_num_hidden_layers not in (0, 1):
            raise ValueError(f"mtp_num_hidden_layers={self.mtp_num_hidden_layers} is not supported (0 or 1)")
        if not self.attn_output_gate:
            raise ValueError("attn_output_gate=false is not supported")
        if self.mtp_use_dedicated_embeddings:
            raise ValueError("mtp_use_dedicated_embeddings is not supported")

    @classmethod
    def from_dict(cls, d):
        rope = rope_parameters(d)
        rope.setdefault("partial_rotary_factor", 0.25)  # transformers' default for this family
        return super().from_dict({**d, "rope": rope})

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope["partial_rotary_factor"])

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim


class Attention(FusedAttention):
    """GQA with per-head zero-centred q/k norm, partial rotary and a sigmoid output gate."""

    # its forward over a few tokens is what layers.attention.attention_fuses's native
    # block computes, with the output gate (q_proj gives each head's query then its gate)
    output_gate = True

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = a.head_dim**-0.5
        # q_proj yields, per head, the query then the output gate
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * a.head_dim * 2, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * a.head_dim, a.hidden_size, bias=a.attention_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, zero_centered=True)

    def forward(self, x, cos_sin, kv, slots, pos0):
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = norm_rope(q, self.q_norm, cos_sin)  # [B, heads, T, D]
        k = norm_rope(self.k_proj(x).view(B, T, self.n_kv, self.head_dim), self.k_norm, cos_sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, kv, slots, pos0, self.scale).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(B, T, -1)))


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


class GatedDeltaNet(nn.Module):
    """Linear attention: causal conv over q,k,v, then the gated delta rule (layers/deltanet.py, kernels/reference.py)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_k, self.n_v = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        C = a.conv_dim
        self.in_proj_qkv = nn.Linear(a.hidden_size, C, bias=False)
        self.in_proj_z = nn.Linear(a.hidden_size, self.n_v * self.dv, bias=False)
        self.in_proj_b = nn.Linear(a.hidden_size, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(a.hidden_size, self.n_v, bias=False)
        self.conv1d = nn.Conv1d(C, C, a.linear_conv_kernel_dim, groups=C, bias=False)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.dv, a.rms_norm_eps)
        self.out_proj = nn.Linear(self.n_v * self.dv, a.hidden_size, bias=False)

    def forward(self, x, state, slots):
        B, T, _ = x.shape
        if state is not None and self._token_by_token(T):  # decode, a verification pass, natively a prompt
            return self._few_tokens(x, state, slots)
        conv_state = state.get("conv", slots) if state is not None else None
        qkv, conv_state = causal_conv1d(self.in_proj_qkv(x), self.conv1d.weight, conv_state)  # [B, T, C]
        q, k, v, beta, g = split_heads(qkv, self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias, self.n_k,
                                       self.dk, self.n_v, self.dv)
        rec = state.get("recurrent", slots) if state is not None else None
        o, rec = gated_delta_rule(q, k, v, g, beta, rec)  # [B, T, Hv, Dv]
        if state is not None:
            state.set("conv", slots, conv_state)
            state.set("recurrent", slots, rec)
        z = self.in_proj_z(x).view(B, T, self.n_v, self.dv)
        o = gated_rms_norm(o, z, self.norm.weight, self.norm.eps)
        return self.out_proj(o.reshape(B, T, -1))

    def residual(self, x, norm, state, slots):
        """x + self(norm(x), state, slots): the decoder layer's first half. A few-token pass
        runs as one native call (`kernels.deltanet_block`) where every part can (`_fusable`),
        bit-identical to the modules one by one."""
        if state is not None and self._token_by_token(x.shape[1]) and not kernels.has_hooks(self):
            return self._few_tokens(x, state, slots, norm)
        return x + self(norm(x), state, slots)

    def _token_by_token(self, T: int) -> bool:
        """A pass with a cache that runs between the projections as `_few_tokens`: a few
        tokens, or any pass where the native call runs it (`deltanet.native_pass`)."""
        return T <= FEW or native_pass()

    def _few_tokens(self, x, state, slots, norm=None):
        """Between the projections as one call (kernels.deltanet_decode): token after token
        for a few tokens, the chunked form natively for a prompt (csrc/delta_chunk.cpp); a
        pass of 2..FEW tokens keeps every token's state, so that a rejected speculative draft
        can be rolled back (a longer one, a prompt, keeps the last only). A prompt of more
        than `SEGMENT` tokens runs in passes of SEGMENT (bounding the native call's buffers).
        With `norm` (`residual`): x + the layer's output on norm(x)."""
        B, T, _ = x.shape
        if T > SEGMENT:
            return torch.cat([self._few_tokens(x[:, t : t + SEGMENT], state, slots, norm)
                              for t in range(0, T, SEGMENT)], dim=1)
        every = 1 < T <= FEW
        conv, rec = state.get("conv", slots), state.get("recurrent", slots)
        bufs = None
        if every:
            bufs = (state.scratch("conv", (B, T, *conv.shape[1:])), state.scratch("recurrent", (B, T, *rec.shape[1:])))
        views = self.weight_views()
        fused = None if norm is None else self._fusable(x, norm, conv, rec)
        if fused is not None:
            proj, out_proj, norm_args = fused
            y, conv_all, rec_all = kernels.deltanet_block(x, norm_args, proj, out_proj, conv, rec, views, self.norm.eps,
                                                          self.n_k, every, bufs)
        else:
            h = x if norm is None else norm(x)
            qkv, z, a, b = project(h, self.in_proj_qkv, self.in_proj_z, self.in_proj_a, self.in_proj_b)
            o, conv_all, rec_all = kernels.deltanet_decode(
                qkv, self.conv1d.weight, conv, a, b, self.A_log, self.dt_bias, rec, z.reshape(B, T, self.n_v, self.dv),
                self.norm.weight, self.norm.eps, self.n_k, every, bufs, views, dtype=h.dtype)
        state.set("conv", slots, conv)  # the states after the last token, written in place: nothing
        state.set("recurrent", slots, rec)  # to copy when `get` gave views of the cache
        if every:
            state.keep_every(conv=conv_all, recurrent=rec_all)
        if fused is not None:
            return y
        y = self.out_proj(o.to(h.dtype).reshape(B, T, -1))
        return y if norm is None else x + y

    def weight_views(self) -> tuple:
        """The conv, A_log, dt_bias and norm weights as the native step takes them (kept on the
        layer: `kernels.native_views`)."""
        return kernels.native_views(self, DELTA_WEIGHTS, kernels.deltanet_weight_views)

    def half_plan(self, x, norm, conv, rec) -> tuple | None:
        """(`weight_views`, `_fusable`'s plan) where `residual` runs x + self(norm(x)) as one
        native call over the states conv, rec; None otherwise. The decode program
        (`layers.stack`) builds its DeltaNet halves from it once a run."""
        if kernels.has_hooks(self) or not self._token_by_token(x.shape[1]):
            return None
        fused = self._fusable(x, norm, conv, rec)
        return None if fused is None else (self.weight_views(), fused)

    def _fusable(self, x, norm, conv, rec) -> tuple | None:
        """(the projections' packed views, out_proj's, the norm's `kernels.norm_args`) when
        `residual` may run norm and this layer as one native call: a decode-sized pass without
        autograd, the DeltaNet step native (`kernels.deltanet_decode_is_native`), a zero-centred
        or plain `RMSNorm` of x's dtype, the projections one native call (`packed_views`) and
        out_proj's call one too (`native_call_views`), no hooks on any of them; None otherwise.
        Kept on the layer (`kernels.module_plan`)."""
        m = self._modules
        group = (norm, m["in_proj_qkv"], m["in_proj_z"], m["in_proj_a"], m["in_proj_b"], m["out_proj"])
        if (type(norm) is not RMSNorm or torch.is_grad_enabled() or not kernels.float_decode_rows(x)
                or not kernels.deltanet_decode_is_native(x, conv, rec) or kernels.has_hooks(*group)):
            return None
        key = (x.dtype, m["out_proj"].__dict__.get("forward"), norm.eps, norm.zero_centered)
        return kernels.module_plan(self, group, key, lambda: self._plan(x, norm))

    def _plan(self, x, norm) -> tuple | None:
        if norm.weight.dtype != x.dtype:
            return None
        proj = packed_views(self.in_proj_qkv, self.in_proj_z, self.in_proj_a, self.in_proj_b, x=x)
        out = native_call_views(self.out_proj, x) if proj is not None else None
        return None if out is None else (proj, out, kernels.norm_args(norm))


class SparseMoeBlock(nn.Module):
    def __init__(self, a: ModelArgs, norm_topk_prob: bool = True):
        super().__init__()
        self.top_k, self.norm_topk_prob = a.num_experts_per_tok, norm_topk_prob
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)  # the router
        self.experts = Experts(a.num_experts, a.hidden_size, a.moe_intermediate_size)
        self.shared_expert = GatedMLP(a.hidden_size, a.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])  # [B*T, H]
        weights, ids = softmax_topk(self.gate, h, self.top_k, self.norm_topk_prob)  # [B*T, K]
        out = self.experts(h, ids, weights)
        return (out + self.shared_expert.gated(h, self.shared_expert_gate)).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, layer_type: str, mlp: nn.Module | None = None):
        """mlp: the layer's MLP half (default: a `SparseMoeBlock`)."""
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(a)
        else:
            self.self_attn = Attention(a)
        self.mlp = SparseMoeBlock(a) if mlp is None else mlp
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, zero_centered=True)

    def forward(self, x, cos_sin, state, slots, pos0, last_only=False):
        """last_only: only the last position goes on through the MoE ([B, 1, H] out): every
        position's state is cached by then, and an MTP catch-up wants no more."""
        if self.layer_type == "linear_attention":
            x = self.linear_attn.residual(x, self.input_layernorm, state, slots)  # x + linear_attn(norm(x))
        else:  # x + attn(norm(x))
            x = attn_residual(x, self.input_layernorm, self.self_attn, cos_sin, state, slots, pos0)
        if last_only:
            x = x[:, -1:]
        return moe_residual(x, self.post_attention_layernorm, self.mlp)  # x + mlp(norm(x))


def _mlp(mlp_for, a: ModelArgs, layer: int) -> nn.Module | None:
    return mlp_for(a, layer) if mlp_for is not None else None


class Qwen3_5MoeTextModel(nn.Module):
    def __init__(self, a: ModelArgs, mlp_for=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, t, _mlp(mlp_for, a, i)) for i, t in enumerate(a.layer_types))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, zero_centered=True)
        self.rope = Rope(a.rope, a.rotary_dim, a.max_position_embeddings)


class MultiTokenPredictor(nn.Module):
    """`mtp.*`: fuse the next token's embedding with the hidden state, one full-attention MoE layer."""

    def __init__(self, a: ModelArgs, mlp_for=None):
        super().__init__()
        H, eps = a.hidden_size, a.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(H, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, zero_centered=True)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(a, "full_attention", _mlp(mlp_for, a, a.num_hidden_layers + k))
                                    for k in range(a.mtp_num_hidden_layers))
        self.norm = RMSNorm(H, eps, zero_centered=True)


class Model(CausalLM):
    tied_parameters = {"lm_head.weight": "model.embed_tokens.weight"}
    checkpoint_renames = [(r"^model\.language_model\.", "model.")]
    # a config may claim an MTP head (real configs carry mtp_num_hidden_layers: 1) while the
    # checkpoint was stripped of it: with none of the mtp.* tensors the model loads without the
    # head (has_mtp False); with only some of them the loader names the missing one
    optional_submodules = ("mtp",)
    # (args, layer index) -> that layer's MLP half; None: a SparseMoeBlock in every layer (the
    # MTP head's layers are numbered after the trunk's). Qwen3-Next sets its own.
    mlp_for = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Qwen3_5MoeTextModel(args, self.mlp_for)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp = MultiTokenPredictor(args, self.mlp_for) if args.mtp_num_hidden_layers > 0 else None

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    def _kv_spec(self) -> KVSpec:
        a = self.args
        return KVSpec(a.num_key_value_heads, a.head_dim, a.head_dim)

    def cache_spec(self) -> list:
        a = self.args
        state = StateSpec(
            shapes=(
                ("conv", (a.conv_dim, a.linear_conv_kernel_dim - 1)),  # the last K-1 conv inputs
                ("recurrent", (a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim)),
            ),
            # the delta rule runs in fp32 (as transformers and FLA do); keeping its state in bf16
            # would round it at every token. The conv state holds the last inputs, exactly, in
            # fp32 so that decode's native step (kernels.deltanet_decode) updates it in place.
            dtypes=(("recurrent", torch.float32), ("conv", torch.float32)),
        )
        return [self._kv_spec() if t == "full_attention" else state for t in a.layer_types]

    def mtp_cache_spec(self) -> list:
        """Specs for the MTP head's own `Cache` (one KV entry per MTP layer; [] without MTP)."""
        return [self._kv_spec()] * len(self.mtp.layers) if self.has_mtp else []

    def _mtp_parts(self, head=None) -> MtpParts:
        mtp, layer = self.mtp, self.mtp.layers[0]
        return MtpParts(self.model.embed_tokens, (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden), mtp.fc, layer,
                        layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp, mtp.norm,
                        head or self.lm_head)

    def mtp_drafter(self, cache, slot: int, head=None):
        """The head's calls on one slot of `cache` (a `Cache(model.mtp_cache_spec(), ...)`) made
        ready once for a speculative decoding run (`layers.mtp.Drafter`): its `run(hidden,
        tokens, pos)` gives what `mtp_logits(..., return_hidden=True, last_only=True)` gives
        one row, without moving the cache's length; None where they would not run natively."""
        if not self.has_mtp or len(self.mtp.layers) != 1:
            return None
        return prepare_drafter(self.mtp, self._mtp_parts(head), cache.layers[0], slot, self.model.rope)

    def mtp_logits(self, hidden, next_token_ids, cache=None, slots=None, *, return_hidden=False, head=None,
                   last_only=False):
        """MTP head: hidden [B, T, H] (final normed states at positions p..p+T-1) and
        next_token_ids [B, T] (the token after each of them) -> logits [B, T, vocab] for the
        token after next (and, with return_hidden, the head's normed output [B, T, H], which
        chained speculative drafts feed back in).

        `cache` is a `Cache(model.mtp_cache_spec(), ...)`; its length per slot is the
        position of hidden[:, 0] (0 without a cache), and it advances by T. `head` stands in
        for the LM head (a drafter's smaller vocabulary: logits [B, T, its rows]); with
        last_only the logits and hidden state are the last position's alone ([B, 1, .]): the
        layer's MoE runs on it only.
        """
        if not self.has_mtp:
            raise RuntimeError("this checkpoint has no MTP head (has_mtp is False)")
        B, T, _ = hidden.shape
        slots, pos0 = self._positions(B, cache, slots)
        mtp, m = self.mtp, self.model
        if B == 1 and (T == 1 or last_only) and cache is not None and len(mtp.layers) == 1:  # a draft step: one native call
            got = native_step(mtp, self._mtp_parts(head), hidden, next_token_ids, cache.layers[0], int(slots[0]),
                              int(pos0[0]), m.rope)
            if got is not None:
                cache.advance(slots, T)
                return got if return_hidden else got[0]
        e = m.embed_tokens(next_token_ids)
        normed = rms_norm_cat(mtp, ("pre_fc_norm_embedding", "pre_fc_norm_hidden"), [e, hidden.to(e.dtype)])
        x = mtp.fc(normed)  # [B, T, H]
        cos_sin = m.rope.span(pos0, T, x.dtype)
        for i, layer in enumerate(mtp.layers):  # one layer (deeper heads are refused at load)
            x = layer(x, cos_sin, cache.layers[i] if cache is not None else None, slots, pos0, last_only=last_only)
        if cache is not None:
            cache.advance(slots, T)
        h = mtp.norm(x)
        logits = (head or self.lm_head)(h)
        return (logits, h) if return_hidden else logits
