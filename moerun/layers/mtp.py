"""One draft step of a multi-token-prediction head as one native call.

An MTP head (Qwen3.5's `mtp`) takes the next token's embedding and the trunk's final hidden
state, RMS-norms each, runs them side by side through a linear (`fc`), one decoder layer
(attention half, MoE half), a final norm and the LM head. Speculative decoding calls it
once per draft, one row and one token at a time, where its ~10 module calls cost several
times their arithmetic. `native_step` runs the same ops (the layer's two halves as their
fused ops compute them) in one call, with every weight's arguments made once: bit-identical
to the modules one by one, which the caller runs wherever these would not all run natively.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .. import kernels
from .attention import attn_half_fuses
from .linear import native_call_views
from .moe import call_observers, moe_fusable, routes_seen
from .norm import RMSNorm, stacked_norm_weights


class MtpParts(NamedTuple):
    """The modules of a one-layer MTP head, in the order they run."""

    embed: nn.Module  # the trunk's token embedding
    pre_norms: tuple  # the embedding's RMSNorm, the hidden state's
    fc: nn.Module  # [2H] -> [H]
    layer: nn.Module  # the decoder layer (checked for hooks), whose halves are:
    attn_norm: nn.Module
    attn: nn.Module
    moe_norm: nn.Module
    moe: nn.Module
    norm: nn.Module  # the final norm
    head: nn.Module  # the LM head, or a drafter's smaller one


def native_step(owner: nn.Module, parts: MtpParts, hidden: torch.Tensor, tokens: torch.Tensor, kv, slot: int,
                pos: int, rope) -> tuple | None:
    """(logits [1, 1, V], the final norm's output h [1, 1, H]) of the head's last position for
    one row of T tokens (hidden [1, T, H], the token after each [1, T]; T at most
    `kernels.FUSED_MAX_TOKENS`), every position's keys and values cached in the layer's KV
    cache `kv` (slot, positions pos..); the model's `Rope`. None (nothing run) unless every
    module would run natively without hooks: then the caller runs them. The experts'
    pre-hooks (expert trackers) are called as `moe_residual` calls them. What the calls
    take from the weights is kept on `owner` (`kernels.MtpStep`)."""
    _, T, H = hidden.shape
    embed = parts.embed
    dtype = embed.weight.dtype
    x = hidden if hidden.dtype == dtype else hidden.to(dtype)
    if (T > kernels.FUSED_MAX_TOKENS or dtype not in kernels.FLOAT_DTYPES or type(embed) is not nn.Embedding
            or not attn_half_fuses(x, parts.attn_norm, parts.attn, kv)
            or kernels.has_hooks(embed, *parts.pre_norms, parts.fc, parts.layer, parts.norm)):
        return None
    moe = moe_fusable(x[:, -1:], parts.moe_norm, parts.moe)
    if moe is None:
        return None
    group = (embed, *parts.pre_norms, parts.fc, parts.norm, parts.head)
    step = kernels.module_plan(owner, group, dtype, lambda: _plan(parts, dtype, H))
    if step is None:
        return None
    experts, moe_args = moe
    observe = bool(experts._forward_pre_hooks)
    logits, h, observed = step.run(tokens.reshape(T).contiguous(), x.reshape(T, H).contiguous(), kernels.attn_plan(parts.attn),
                                   kernels.half_norm_args(parts.attn_norm),
                                   step.rope_rows(rope.float_table(pos + T, dtype), pos, T), kernels._cache_slot(kv, slot),
                                   pos, moe_args, observe, routes_seen(experts))
    if observe:
        call_observers(experts, observed)
    return logits.view(1, 1, -1), h.view(1, 1, H)


def _plan(parts: MtpParts, dtype: torch.dtype, H: int) -> kernels.MtpStep | None:
    """The head's `kernels.MtpStep` (its input norms' weights stacked [2, H] float32, fc, the
    final norm, the head), or None where a part would not run natively."""
    if any(type(n) is not RMSNorm or n.weight.dtype != dtype for n in (*parts.pre_norms, parts.norm)):
        return None
    pre_w = stacked_norm_weights(parts.pre_norms)
    fc = native_call_views(parts.fc, torch.empty(1, 2 * H, dtype=dtype))
    head = native_call_views(parts.head, torch.empty(1, H, dtype=dtype))
    if pre_w is None or fc is None or head is None:
        return None
    return kernels.MtpStep(H, dtype, parts.embed.weight.detach(), pre_w, parts.pre_norms[0].eps, fc,
                           kernels.norm_args(parts.norm), head)
