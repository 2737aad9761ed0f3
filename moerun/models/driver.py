"""The model driver every architecture with a native decode path shares: embedding, the
decoder layers, final norm and head, around the layer stack (`layers.stack`). A model file
subclasses `CausalLM` and holds only its maths and checkpoint mapping: `model.embed_tokens`,
`model.rope`, `model.layers` (each called as layer(x, cos_sin, cache entry, slots, pos0)),
`model.norm` and `lm_head`."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.linear import head_logits
from ..layers.stack import model_pass, prepare, run_layers


class CausalLM(nn.Module):
    def forward(self, input_ids, cache=None, slots=None, *, last_only=False, return_hidden=False, plans=None):
        """input_ids [B, T] -> float32 logits [B, T or 1, vocab] (and the final normed hidden state [B,
        T, H]). plans: a run's decode program (a dict a decode loop keeps for one run, built
        when the run starts: `prepare`)."""
        B, T = input_ids.shape
        fast = model_pass(self, input_ids, cache, slots, last_only, plans)  # a decode pass: all native calls
        if fast is not None:
            return fast if return_hidden else fast[0]
        slots, pos0 = self._positions(B, cache, slots)
        m = self.model
        x = m.embed_tokens(input_ids)
        cos_sin = m.rope.span(pos0, T, x.dtype)
        x = run_layers(m.layers, x, cos_sin, cache, slots, pos0, plans)  # a decode pass: one loop of native calls
        if cache is not None:
            cache.advance(slots, T)
        hidden = m.norm(x)
        logits = head_logits(self.lm_head, hidden[:, -1:] if last_only else hidden)
        return (logits, hidden) if return_hidden else logits

    def prepare(self, cache, plans: dict, widths=(1,), T: int = 1) -> None:
        """Build a run's decode program on `cache` before its first pass: the native stack of
        each of `widths` for passes of T tokens a row (`layers.stack.prepare`)."""
        prepare(self, cache, plans, widths, T)

    def _positions(self, B: int, cache, slots):
        """(the rows' cache slots, their first positions) of a pass of B rows."""
        if cache is None:
            return None, torch.zeros(B, dtype=torch.long)
        slots = torch.arange(B) if slots is None else slots
        return slots, cache.start_positions(slots)
