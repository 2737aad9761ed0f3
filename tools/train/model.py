"""The demo model's architecture: transformers' Qwen3.5-MoE text trunk plus a Qwen3.5-style MTP head.

MTP head (checkpoint names `mtp.*`, as in Qwen3-Next / Qwen3.5 checkpoints):

    e   = embed_tokens(x[t+1])                       # the token after position t
    h   = trunk's final *normed* hidden state at t   # model.norm output
    u   = fc(cat([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)], -1))    # 2H -> H
    u   = layers[0](u, position t)                   # full-attention decoder layer with MoE
    logits(x[t+2]) = lm_head(norm(u))                # lm_head shared with the trunk

All RMSNorms are transformers' zero-centred Qwen3_5MoeRMSNorm (stored w, applied as 1+w).
# B batch, T tokens, H hidden, E experts
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def make_config(vocab_size: int, **overrides):
    from transformers import Qwen3_5MoeTextConfig

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
    )
    kw.update(overrides)
    return Qwen3_5MoeTextConfig(**kw)


class MTPHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

        H, eps = config.hidden_size, config.rms_norm_eps
        layer_cfg = copy.deepcopy(config)
        layer_cfg.layer_types = ["full_attention"]
        layer_cfg.num_hidden_layers = 1
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(H, eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(H, eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(layer_cfg, 0)])
        self.norm = Qwen3_5MoeRMSNorm(H, eps)

    def forward(self, next_embeds, hidden, position_embeddings, attention_mask=None):
        # next_embeds, hidden: [B, T, H] (embedding of x[t+1], trunk output at t)
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            u = layer(u, position_embeddings=position_embeddings, attention_mask=attention_mask)
        return self.norm(u)


class RouterRecorder:
    """Collects the router logits of every MoE block it is attached to, in call order."""

    def __init__(self, modules):
        self.logits: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, module, inputs, output):
        self.logits.append(output[0])  # router_logits [B*T, E]

    def pop(self):
        out, self.logits = self.logits, []
        return out


def balance_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-style load-balancing loss, computed per layer and averaged (1.0 when uniform)."""
    losses = []
    for logits in router_logits:
        probs = F.softmax(logits.float(), dim=-1)  # [N, E]
        E = probs.shape[-1]
        top = torch.topk(probs, top_k, dim=-1).indices
        frac = torch.zeros(E, device=probs.device).scatter_add_(0, top.reshape(-1), torch.ones(top.numel()))
        frac = frac / top.numel()
        losses.append(E * (frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()


class DemoModel(nn.Module):
    """Trunk (Qwen3_5MoeForCausalLM) + MTP head; `losses()` is the training objective."""

    def __init__(self, config):
        super().__init__()
        from transformers import Qwen3_5MoeForCausalLM

        self.config = config
        self.trunk = Qwen3_5MoeForCausalLM(config)
        self.mtp = MTPHead(self.trunk.config)
        std = config.initializer_range
        for name, p in self.mtp.named_parameters():
            if "norm" in name:
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, std)
        self.routers = [m for n, m in self.named_modules() if n.endswith("mlp.gate")]
        self.recorder = RouterRecorder(self.routers)

    def forward_all(self, input_ids):
        """input_ids [B, T] -> (logits [B,T,V], mtp_logits [B,T-1,V] for x[t+2], router logits per layer)."""
        tm = self.trunk.model
        self.recorder.pop()
        h = tm(input_ids=input_ids).last_hidden_state  # [B, T, H], after model.norm
        logits = self.trunk.lm_head(h)
        B, T = input_ids.shape
        pos = torch.arange(T - 1, device=input_ids.device)[None].expand(B, -1)
        emb_next = tm.embed_tokens(input_ids[:, 1:])  # [B, T-1, H]
        pe = tm.rotary_emb(emb_next, pos)
        # The MTP layer's attention is causal over the T-1 MTP positions.
        mask = None  # sdpa with is_causal when no mask is given
        u = self.mtp(emb_next, h[:, :-1], pe, mask)
        mtp_logits = self.trunk.lm_head(u)
        return logits, mtp_logits, self.recorder.pop()

    def losses(self, input_ids, mtp_weight: float, aux_coef: float):
        logits, mtp_logits, router_logits = self.forward_all(input_ids)
        V = logits.shape[-1]
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), input_ids[:, 1:].reshape(-1))
        ce_mtp = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V).float(), input_ids[:, 2:].reshape(-1))
        aux = balance_loss(router_logits, self.config.num_experts_per_tok)
        total = ce + mtp_weight * ce_mtp + aux_coef * aux
        return total, {"ce": ce.item(), "ce_mtp": ce_mtp.item(), "aux": aux.item()}
