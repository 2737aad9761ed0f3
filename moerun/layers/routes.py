"""Which routed experts ran: the route mask an expert tracker reads.

Every Experts kind (float, quantized, store-backed) marks it at each call and the fused MoE
ops mark it natively, so that watching costs a call nothing it would notice (a forward
pre-hook must be handed new tensors at every call). Apart from `layers.moe` so that the
quantized and store-backed experts can import it.
"""

from __future__ import annotations

import torch
from torch import nn


def routes_seen(experts: nn.Module):
    """The experts' route mask, when something watches which experts run (an expert tracker,
    `engine.speculative.ExpertTracker`, sets it as `experts.routes_seen`): uint8 [E + 1], 1 at
    each expert routed to since it was cleared and the calls' top-k at [E]. None otherwise.
    Every Experts kind marks it (`note_routes`), the fused ops natively: cheaper than a hook
    that must be handed tensors at every call."""
    return experts.__dict__.get("routes_seen")


def note_routes(experts: nn.Module, ids: torch.Tensor) -> None:
    """Mark ids [N, K] in the experts' route mask (`routes_seen`), if it has one."""
    seen = experts.__dict__.get("routes_seen")
    if seen is not None:
        seen[ids.reshape(-1).numpy()] = 1
        seen[-1] = ids.shape[-1]
