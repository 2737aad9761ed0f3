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
from .attention import attn_half_plan
from .linear import native_call_views
from .moe import call_observers, moe_fusable, routes_seen
from .routes import route_observers
from .norm import RMSNorm, stacked_norm_weights

# tokens per native call at most: a catch-up over a long prompt's pairs goes in calls of this
# many (its workspace grows with them: ~5 KB a token at Qwen3.6-35B-A3B's widths)
MAX_TOKENS = 2048


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
    `MAX_TOKENS`), every position's keys and values cached in the layer's KV
    cache `kv` (slot, positions pos..); the model's `Rope`. None (nothing run) unless every
    module would run natively without hooks: then the caller runs them. The experts'
    pre-hooks (expert trackers) are called as `moe_residual` calls them. What the calls
    take from the weights is kept on `owner` (`kernels.MtpStep`)."""
    drafter = prepare(owner, parts, kv, slot, rope)
    return None if drafter is None else drafter.run(hidden, tokens, pos)


class Drafter:
    """`native_step` on one slot of one KV cache, its checks made and its arguments taken once
    (`prepare`), for a run of calls: a speculative decoding run's draft steps and catch-ups
    (`engine.speculative`), where checking every module again at each call cost more than
    the call's arithmetic (~150 of ~240 us on the demo model). It stands for the modules as
    they were when it was made: a run must not add hooks or change weights while it uses it."""

    def __init__(self, step: kernels.MtpStep, bound: tuple, rope, experts: nn.Module, H: int, dtype: torch.dtype):
        self.step, self.bound, self.rope, self.experts, self.H, self.dtype = step, bound, rope, experts, H, dtype
        self.observe = bool(experts._forward_pre_hooks or route_observers(experts))

    def run(self, hidden: torch.Tensor, tokens: torch.Tensor, pos: int) -> tuple | None:
        """`native_step`'s result for hidden [1, T, H] and tokens [1, T] at positions pos..; None
        (nothing run) for more than `MAX_TOKENS` tokens."""
        _, T, H = hidden.shape
        if T > MAX_TOKENS:
            return None
        x = hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)
        step = self.step
        logits, h, observed = step.run(tokens.reshape(T).contiguous(), x.reshape(T, H).contiguous(),
                                       self.rope.float_rows(pos, T, self.dtype), pos, self.bound, self.observe)
        if self.observe:
            call_observers(self.experts, observed)
        return logits.view(1, 1, -1), h.view(1, 1, H)


def prepare(owner: nn.Module, parts: MtpParts, kv, slot: int, rope) -> Drafter | None:
    """A `Drafter` for calls on `slot` of the KV cache `kv` (the head's layer's, in a cache of
    the model's dtype), or None where `native_step` would not run."""
    embed = parts.embed
    if type(embed) is not nn.Embedding:  # e.g. a GGUF file's token embeddings kept in blocks
        return None
    dtype = embed.weight.dtype
    H = embed.weight.shape[1]
    x = torch.empty(1, 1, H, dtype=dtype)  # what the checks look at: a one-token call's shape and dtype
    if (dtype not in kernels.FLOAT_DTYPES
            or attn_half_plan(x, parts.attn_norm, parts.attn, kv) is None
            or kernels.has_hooks(embed, *parts.pre_norms, parts.fc, parts.layer, parts.norm)):
        return None
    moe = moe_fusable(x, parts.moe_norm, parts.moe)
    if moe is None:
        return None
    group = (embed, *parts.pre_norms, parts.fc, parts.norm, parts.head)
    step = kernels.module_plan(owner, group, dtype, lambda: _plan(parts, dtype, H))
    if step is None:
        return None
    experts, moe_args = moe
    bound = step.bind(kernels.attn_plan(parts.attn), kernels.half_norm_args(parts.attn_norm),
                      kernels._cache_slot(kv, slot), moe_args, rope.float_rows(0, 1, dtype), routes_seen(experts))
    return Drafter(step, bound, rope, experts, H, dtype)


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
