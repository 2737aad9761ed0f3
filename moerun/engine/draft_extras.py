"""What speculative decoding does around its algorithm (engine/speculative.py).

`ExpertTracker` counts the routed-expert bytes of each pass (a verification pass reads the
union of its tokens' experts); `DraftPrefetch` hints the expert store with the experts the
coming verification pass will read at layer 0, as each of its tokens is drafted;
`store_figures` reads the store's bytes moved and seconds waited; `draft_head` is the
drafter's vocabulary, the LM head's first rows.
"""

from __future__ import annotations

import numpy as np
import torch

from ..layers.moe import Experts
from ..layers.linear import native_float_linears


class ExpertTracker:
    """Counts the routed-expert bytes each pass reads: the union of ids per Experts module,
    from the route mask each module marks while tracked (`layers.routes`). The masks are
    views into one buffer, so that a pass starts with one fill and ends with one add of it
    into its phase's counts. The bytes are the counts weighed by each module's bytes per
    expert, worked out when asked (`bytes`); a verification pass's own union (`pass_bytes`)
    and one token's bytes (`token_bytes`: K experts per module called) at its end."""

    def __init__(self, net):
        self.phase: str | None = None
        self.pass_bytes = 0
        self.token_bytes = 0
        self.masks: dict[torch.nn.Module, np.ndarray] = {}
        store = getattr(net, "expert_store", None)
        mods, held_bytes = [], []
        for m in net.modules():
            # Experts, or a drop-in with the same call: QuantizedExperts (routed_experts), or the
            # store's StoreExperts and its subclasses (weights in the store: `store` attribute)
            if isinstance(m, Experts) or getattr(m, "routed_experts", False) or (store is not None and getattr(m, "store", None) is store):
                held = [*m.parameters(recurse=False), *m.buffers(recurse=False)]  # stacked [E, ...] (and scales)
                mods.append(m)
                held_bytes.append(sum(t.numel() * t.element_size() for t in held) if held else None)
        stored = [m for m, b in zip(mods, held_bytes) if b is None]
        per_stored = store.stats()["experts_bytes"] // sum(m.num_experts for m in stored) if stored else 0
        # per module: bytes of one expert (the store's bytes over every expert it holds, for its modules)
        self.per_expert = np.array([per_stored if b is None else b // max(m.num_experts, 1)
                                    for m, b in zip(mods, held_bytes)], dtype=np.int64)
        num_experts = np.array([m.num_experts for m in mods], dtype=np.int64)
        # module i's mask: flat[starts[i] : starts[i] + E_i + 1]; its routed experts, then its top-k
        sizes = num_experts + 1
        starts = np.cumsum(sizes) - sizes
        self.flat = np.zeros(int(sizes.sum()), dtype=np.uint8)
        # reduceat over [start, start + E) and [start + E, next start): each module's union, then its k
        self.bounds = np.stack([starts, starts + num_experts], axis=1).reshape(-1)
        # the flat masks weighed by their module's bytes per expert, at its experts' places (the
        # union) or at its top-k's (one token)
        self.union_weights = np.zeros(len(self.flat), dtype=np.int64)
        self.k_weights = np.zeros(len(self.flat), dtype=np.int64)
        for i, m in enumerate(mods):
            # its own mask, installed on the module: a tracker left behind by an earlier run
            # (a generator dropped unfinished) neither shares it nor takes it away (close)
            self.masks[m] = m.routes_seen = self.flat[starts[i] : starts[i] + sizes[i]]
            self.union_weights[starts[i] : starts[i] + num_experts[i]] = self.per_expert[i]
            self.k_weights[starts[i] + num_experts[i]] = self.per_expert[i]
        self.counts = {phase: np.zeros(len(self.flat), dtype=np.int64) for phase in ("verify", "draft")}

    def start_pass(self, phase: str) -> None:
        self.phase = phase
        self.flat[:] = 0  # every module's mask (calls outside a pass count nowhere)

    def end_pass(self) -> None:
        """Count what the pass's Experts calls read: the union of their ids, per module."""
        phase, self.phase = self.phase, None
        if not len(self.bounds):
            return
        self.counts[phase] += self.flat
        if phase == "verify":
            self.pass_bytes = int(self.flat @ self.union_weights)
            self.token_bytes = max(self.token_bytes, int(self.flat @ self.k_weights))  # a module not called: 0

    @property
    def bytes(self) -> dict[str, int]:
        """Routed-expert bytes the passes of each phase read so far."""
        if not len(self.bounds):
            return {phase: 0 for phase in self.counts}
        return {phase: int(np.add.reduceat(c, self.bounds)[0::2] @ self.per_expert) for phase, c in self.counts.items()}

    def close(self) -> None:
        for m, mask in self.masks.items():
            if m.__dict__.get("routes_seen") is mask:
                del m.__dict__["routes_seen"]


def store_figures(store) -> tuple[int, float]:
    """(bytes moved into the compute tier, seconds waited for experts) so far, from `stats()`."""
    st = store.stats()
    tiers = st.get("tiers", {})
    moved = tiers.get("disk", {}).get("bytes_read", 0) + tiers.get("device", {}).get("bytes", 0)
    return moved, st.get("stall_s", 0.0)


class DraftPrefetch:
    """Expert-aware drafting: while the head drafts, hint the expert store with the trunk
    experts the verification pass will read at layer 0.

    The pass runs the trunk on [t_L, d1..dN]; each token is known as soon as it is drafted,
    so its layer-0 experts are predicted with the `token` predictor (experts/predict.py):
    the token's embedding through the router (`profile.mtp_route_scores`), top K. Only layer
    0 is hinted, where that is nearly the router's real input (top-K precision 0.90 on the
    demo model, against 0.30-0.40 deeper). Hints target the store's next step (the
    verification pass) and are dropped after it. The prediction depends on the token alone,
    so each token's is computed once per decoder and looked up after.
    """

    def __init__(self, net, store):
        # (here, not at the top: importing moerun.experts runs its package, whose attach builds an
        # LLM from this engine; a run with a store has imported it already)
        from ..experts.predict import Token
        from ..experts.profile import moe_blocks

        self.net, self.store = net, store
        self.blocks = moe_blocks(net)[:1]
        self.layer = getattr(self.blocks[0][1].experts, "layer", 0)
        self.pred = Token(1, net.args.num_experts)
        self.budget = net.args.num_experts_per_tok
        self.predicted: dict[int, list[int]] = {}  # token -> its layer-0 experts

    def tokens(self, ids: list[int]) -> None:
        from ..experts.profile import mtp_route_scores

        new = list(dict.fromkeys(t for t in ids if t not in self.predicted))
        if new:
            routes = mtp_route_scores(self.net, self.blocks, torch.tensor(new)[:, None], torch.ones(len(new), 1))  # [n, 1, E]
            for t, route in zip(new, routes.numpy()):
                self.pred.begin_token({"token_route": route})
                self.predicted[t] = self.pred.predict(0, self.budget).tolist()
        step = self.store.step + 1
        for t in ids:
            self.store.prefetch(self.layer, self.predicted[t], for_step=step)


def draft_head(lm_head: torch.nn.Module, n: int) -> torch.nn.Module:
    """The LM head's first n rows as a module of its own kind (views of its weights, no copy):
    the drafter's vocabulary. BPE vocabularies number tokens roughly by merge order, so the
    low ids are the frequent ones; drafting among them only (FR-Spec's frequency-ranked
    draft vocabulary, with the id order standing in for the ranking) makes an MTP call read
    n/V of the head. Drafts are still verified by the full model, so the output does not
    change; only tokens >= n are never drafted."""
    from ..layers.quantized import QuantizedLinear

    if type(lm_head) is QuantizedLinear:
        with torch.device("meta"):
            sub = QuantizedLinear(lm_head.in_features, n, lm_head.fmt, bias=lm_head.bias is not None)
        sub.qweight, sub.scales = lm_head.qweight[:n], lm_head.scales[:n]
        sub.bias = None if lm_head.bias is None else lm_head.bias[:n]
        return sub
    if type(lm_head) is torch.nn.Linear:
        with torch.device("meta"):
            sub = torch.nn.Linear(lm_head.in_features, n, bias=lm_head.bias is not None)
        sub.weight = torch.nn.Parameter(lm_head.weight.detach()[:n], requires_grad=False)
        if lm_head.bias is not None:
            sub.bias = torch.nn.Parameter(lm_head.bias.detach()[:n], requires_grad=False)
        native_float_linears(sub)  # as the head itself runs (`LLM` wraps the net's)
        return sub
    return _FirstRows(lm_head, n)


class _FirstRows(torch.nn.Module):
    """Any other head: its logits' first n columns (correct, but the whole head is read)."""

    def __init__(self, head: torch.nn.Module, n: int):
        super().__init__()
        self.head, self.n = head, n

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)[..., : self.n]
