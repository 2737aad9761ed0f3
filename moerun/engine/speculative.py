"""Self-speculative decoding with the checkpoint's multi-token-prediction (MTP) head.

One step for a row whose last accepted token t_L sits at position L (not yet run through
the trunk):

1. Draft.  The MTP head turns (h_{L-1}, t_L) into a guess d1 for position L+1. Chained
   drafts d2..dN reuse the *same* MTP layer (Qwen3.5 has one; DeepSeek-V3 checkpoints ship
   one depth, and we always use depth 0): the head's own final normed hidden state stands
   in for the trunk's h_{L+j-1} and d_j is the next token, as vLLM does when it asks for
   more drafts than the checkpoint has MTP layers. The head's KV cache gets entries for
   those guessed states; they are overwritten next step (below).
2. Verify.  One trunk pass over [t_L, d1..dN] (T = N+1 per row) gives the trunk's
   distribution at every draft position. Greedy (temperature 0): accept d_j while it is
   the trunk's argmax (after the repetition penalty, exactly as the plain sampler sees
   it); the first mismatch is replaced by the argmax, so the text is the plain greedy
   text. Sampling: accept d_j with probability min(1, p(d_j)/q(d_j)), otherwise draw from
   norm(max(0, p - q)) (inverse CDF with the row's next uniform: `sampling.residual_draw`)
   and stop (Leviathan et al. 2023); when all N are accepted one more token comes from p
   at the last position. p is the plain sampler's distribution (penalty, temperature,
   top-k/p, min-p), q the distribution the draft was drawn from, so the output
   distribution equals plain sampling.
3. Roll back to the last accepted position L+k.
   - KV caches (trunk and MTP): set the slot's length back; the stale entries past it are
     masked by attention and overwritten by the next write.
   - Gated DeltaNet conv and recurrent states cannot be truncated. A verification pass (a
     few tokens) runs the delta rule token by token, the same update as one-token decode,
     and leaves the state after every token in the layer's `RecurrentState.positions`
     (`keep_every`); a rejection copies back the state after the last kept token: no copy
     before verification, no re-run. Cost: the pass holds N+1 states per row and DeltaNet
     layer instead of one until the next pass (for Qwen3.6-35B-A3B, 30 layers x (32 x 128
     x 128 fp32 + conv 8192 x 3) ~ 61 MiB per token of the pass; ~0.1 MiB on the demo
     model), and runs the recurrence as N+1 sequential updates instead of one chunk.
   - The MTP cache is set back to the first position whose (trunk hidden, next token)
     pair it has not seen with the trunk's own hidden state; the first MTP call of the
     next step feeds the k+1 accepted hidden states together (T = k+1), rewriting the
     guessed entries, and its last row is that step's first draft.

One draft on one row, on two threads, where the trunk's 2-token pass runs token by token in
two lanes (a small model: `layers.stack.LANES_LAYER_BYTES`): steps 1 and 2 are one native
call (`_draft_in_pass`). The pass's lane 0 takes t_L through the trunk while lane 1 makes
the head's step and the draft's pick (greedy, or sampled with the row's next uniform), then
takes the draft through the trunk one layer behind t_L; after the lanes, both positions'
final norm, LM head and check (greedy picks, or the sampling test with the row's next two
uniforms) are native too. The same tokens, logits and states as steps 1 then 2.

Expert traffic: a forward pre-hook on every `moerun.layers.moe.Experts` module sees the
routed ids of each pass; a verification pass reads the union of its tokens' experts.
`SpeculativeStats` reports bytes read per emitted token against one token's experts, and,
with an expert store (`net.expert_store`), the bytes it moved and the seconds waited.

Expert-aware drafting (`DraftPrefetch`, with a store): every token of the coming
verification pass is known once drafted, so as soon as t_L and then each d_j is known its
experts are hinted to the store for the pass, while the head drafts the next one. The
prediction is the `token` predictor's (the token's embedding through the routers); only
layer 0 is hinted, where that is nearly the router's real input (top-K precision 0.90 on
the demo model, against 0.30-0.40 deeper, where the wrong reads cost more than the right
ones save).

`draft_tokens="auto"` (`DraftLength`) chooses N in 0..4 each step to maximise expected
tokens per second,
    E(N) / t(N),   E(N) = 1 + sum_{j=1..N} prod_{i<=j} a_i
a_i being the measured acceptance of draft i given drafts < i were accepted (EMA, prior
0.6), and
    t(N) = c(N) + w * U(N)
c(N) the measured seconds of a step with N drafts (the median of its last 15: draft +
verification + rollback; a run's first two passes of a width, which make its plans, left
out) less its waits for the expert store, U(N) the routed-expert bytes of its
verification pass (measured per N; before that, the expected union of N+1 tokens routed
uniformly, one token's bytes * (1-(1-K/E)^(N+1)) / (K/E)), and w the measured seconds
waited per union byte (the store's stall time over the pass's union bytes: the miss rate
times the seconds a miss takes). Far-away experts raise w, and N drops when the union
grows faster than the accepted tokens. An N not measured yet gets c from the nearest
measured N' through
    c(N) ~ c(N') * cost(N) / cost(N'),
    cost(N) = 1 + expert_cost * (U(N)/U(0) - 1) + N * draft_cost,  cost(0) = 1
expert_cost being the share of a plain step spent reading experts (1.0: memory-bound on
experts), draft_cost one MTP call against a trunk step (1 / (layers + 1)). N = 0 is a
plain step (the head catches up later), so "auto" falls back to plain decoding when drafts
are rarely accepted. N = 0 and 1 are measured once first, then a neighbour of the best N is
tried every 8th step so that its figures stay current, the gap doubling (up to 64 steps)
each time a try leaves the best N unchanged and back to 8 when the best N changes; a try
of drafting while plain steps are the best is EXPLORE_BURST steps, the first unpriced
(the head's weights are cold after plain steps), a try of plain steps one step. The
acceptance EMAs average ~30 drafts (`accept_decay`). `LLM` keeps one chooser per loaded model,
so what one request measured serves the next.

Within a step (not a measuring or exploring one) the chosen N only decides between a plain
step and drafting; how many drafts follows the head's confidence. Each draft's probability
under the head falls in one of a few bins whose acceptance is measured (EMA, prior 0.6;
on the demo model drafts above 0.3 are nearly always accepted, those below ~half the
time), so after n drafts the chance that the trunk accepts them all is P = prod of their
bins' acceptance. One more draft adds P * a_{n+1} tokens in expectation and costs t(n+1) -
t(n) seconds; it is drafted (up to 4) while P * a_{n+1} >= (t(n+1) - t(n)) * max_N E(N)/t(N),
the tokens those seconds give at the best expected rate.
"""

from __future__ import annotations

import bisect
import collections
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from .. import kernels
from ..errors import MoerunError
from ..layers.moe import Experts
from ..layers.mtp import MAX_TOKENS as MTP_CALL_TOKENS
from .cache import Cache, RecurrentState
from .generate import GenerationStats, Sequence, kept_run, long_ids
from ..layers.stack import draft_head_args, draft_pass, draft_pass_ready
from .sampling import (_id_array, distribution, draw, greedy_token, greedy_token_probability, greedy_tokens,
                       residual_draw, sample)

# B batch (active rows), N draft tokens, T tokens per pass, H hidden, V vocab

MAX_DRAFT_TOKENS = 4
# a run of plain steps ("auto" choosing N=0) feeds the MTP head its pending pairs this often
PLAIN_CATCH_UP_PAIRS = 32
# plain steps of one row in one go at most, before "auto" chooses again (`_plain_steps`)
PLAIN_STRETCH = 16
_TWO_IDS = torch.zeros(1, 2, dtype=torch.long)  # a 2-token pass's ids, as split_threads' hook reads them
# the most pending pairs a draft made inside its pass feeds the head (`_draft_in_pass`): its lane
# runs on one thread, so a longer backlog (a prompt's, at a run's first step) goes through
# `_draft` on both
IN_PASS_MAX_PAIRS = 8


@dataclass
class SpeculativeStats(GenerationStats):
    draft_tokens: int | str = 1
    draft_vocab: int | None = None  # drafts among the first N token ids (None: all)
    verify_steps: int = 0
    row_steps: int = 0  # (row, verification step) pairs
    drafted: int = 0  # drafts checked by the trunk
    accepted: int = 0  # drafts the trunk accepted
    emitted: int = 0  # tokens that came out of verification steps (accepted drafts + the trunk's own)
    draft_hist: dict = field(default_factory=dict)  # N -> steps that used it
    verify_expert_bytes: int = 0  # routed-expert bytes read by verification passes (union per layer)
    draft_expert_bytes: int = 0  # routed-expert bytes read by the MTP head
    single_token_expert_bytes: int = 0  # routed-expert bytes one token reads in the trunk
    # with an expert store: bytes moved into its compute tier (disk reads, link transfers) and
    # seconds waited for experts, while decoding; `prefetch`: drafts' experts were hinted
    moved_expert_bytes: int = 0
    expert_stall_s: float = 0.0
    prefetch: bool = False

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_tokens_per_step(self) -> float:
        return self.emitted / self.row_steps if self.row_steps else 0.0

    @property
    def expert_bytes_per_token(self) -> float:
        """Trunk expert bytes per emitted token (verification unions), drafts excluded."""
        return self.verify_expert_bytes / self.emitted if self.emitted else 0.0

    @property
    def extra_expert_bytes_per_token(self) -> float:
        """expert_bytes_per_token minus what a plain decode step reads per token."""
        return self.expert_bytes_per_token - self.single_token_expert_bytes if self.emitted else 0.0

    def as_dict(self) -> dict:
        return {
            "draft_tokens": self.draft_tokens,
            "draft_vocab": self.draft_vocab,
            "acceptance_rate": self.acceptance_rate,
            "accepted_tokens_per_step": self.accepted_tokens_per_step,
            "decode_tok_s": self.decode_tok_s,
            "prefill_tok_s": self.prefill_tok_s,
            "generated_tokens": self.generated_tokens,
            "verify_steps": self.verify_steps,
            "draft_tokens_used": dict(sorted(self.draft_hist.items())),
            "expert_bytes_per_token": self.expert_bytes_per_token,
            "extra_expert_bytes_per_token": self.extra_expert_bytes_per_token,
            "single_token_expert_bytes": self.single_token_expert_bytes,
            "draft_expert_bytes_per_token": self.draft_expert_bytes / self.emitted if self.emitted else 0.0,
            "moved_expert_bytes_per_token": self.moved_expert_bytes / self.emitted if self.emitted else 0.0,
            "expert_stall_s_per_token": self.expert_stall_s / self.emitted if self.emitted else 0.0,
            "prefetch": self.prefetch,
        }


def check_draft_tokens(draft_tokens) -> int | str:
    if draft_tokens == "auto":
        return "auto"
    try:
        n = int(draft_tokens)
    except (TypeError, ValueError):
        n = 0
    if str(n) != str(draft_tokens).strip() or not 1 <= n <= MAX_DRAFT_TOKENS:
        raise MoerunError(f"draft_tokens must be 1..{MAX_DRAFT_TOKENS} or 'auto', not {draft_tokens!r}")
    return n


def check_speculative(net, speculative: str | None) -> None:
    if speculative is None:
        return
    if speculative != "mtp":
        raise MoerunError(f"unknown speculative method {speculative!r} (known: mtp)")
    if not getattr(net, "has_mtp", False):
        raise MoerunError(
            "speculative decoding with 'mtp' needs a checkpoint with a multi-token-prediction head; "
            "this one has none (mtp_num_hidden_layers / num_nextn_predict_layers is 0)"
        )


def check_options(net, speculative: str, draft_tokens, draft_vocab) -> int | str:
    """All of speculative decoding's choices checked at once (before a server listens, say):
    the normalised draft_tokens."""
    check_speculative(net, speculative)
    check_draft_vocab(net, draft_vocab)
    return check_draft_tokens(draft_tokens)


def check_draft_vocab(net, draft_vocab) -> int | None:
    """None (the whole vocabulary), or a row count 1..V of the LM head."""
    if draft_vocab is None:
        return None
    V = net.lm_head.out_features
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= V:
        raise MoerunError(f"draft_vocab must be 1..{V} (this model's vocabulary), not {draft_vocab!r}")
    return draft_vocab


def draft_head(lm_head: torch.nn.Module, n: int) -> torch.nn.Module:
    """The LM head's first n rows as a module of its own kind (views of its weights, no copy):
    the drafter's vocabulary. BPE vocabularies number tokens roughly by merge order, so the
    low ids are the frequent ones; drafting among them only (FR-Spec's frequency-ranked
    draft vocabulary, with the id order standing in for the ranking) makes an MTP call read
    n/V of the head, which dominates the call on a large-vocabulary model. Drafts are still
    verified by the full model, so the output does not change; only tokens >= n are never
    drafted."""
    from ..quant.modules import QuantizedLinear

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
        kernels.native_float_linears(sub)  # as the head itself runs (`LLM` wraps the net's)
        return sub
    return _FirstRows(lm_head, n)


class _FirstRows(torch.nn.Module):
    """Any other head: its logits' first n columns (correct, but the whole head is read)."""

    def __init__(self, head: torch.nn.Module, n: int):
        super().__init__()
        self.head, self.n = head, n

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)[..., : self.n]


class ExpertTracker:
    """Counts the routed-expert bytes each pass reads: the union of ids per Experts module,
    from the route mask each module marks while tracked (`layers.routes`). The masks are
    views into one buffer, so that a pass starts with one fill and ends with one add of it
    into its phase's counts (per-module numpy calls cost ~40 us a pass on the demo model).
    The bytes are the counts weighed by each module's bytes per expert (`bytes`): a sum of
    unions is the masks summed, so they are weighed once, when asked. With `per_pass`, each
    verification pass's own figures (`pass_bytes`, `token_bytes`, `top_k`, `num_experts`)
    are worked out at its end (`DraftLength` prices N by them); without, the first pass's
    only (one token's bytes)."""

    def __init__(self, net, per_pass: bool = True):
        self.phase: str | None = None
        self.per_pass = per_pass
        self.pass_bytes = 0
        self.token_bytes = 0  # K * bytes per expert summed over the last pass's modules
        self.top_k = 0
        self.num_experts = 0
        self.masks: dict[torch.nn.Module, np.ndarray] = {}  # module -> its route mask (`layers.routes`)
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
        self.num_experts_of = np.array([m.num_experts for m in mods], dtype=np.int64)
        # module i's mask: flat[starts[i] : starts[i] + E_i + 1]; its routed experts, then its top-k
        sizes = self.num_experts_of + 1
        starts = np.cumsum(sizes) - sizes
        self.flat = np.zeros(int(sizes.sum()), dtype=np.uint8)
        # reduceat over [start, start + E) and [start + E, next start): each module's union, then its k
        self.bounds = np.stack([starts, starts + self.num_experts_of], axis=1).reshape(-1)
        # a pass's bytes in one dot product each: the flat masks weighed by their module's bytes
        # per expert, at its experts' places (the union) or at its top-k's (one token)
        self.union_weights = np.zeros(len(self.flat), dtype=np.int64)
        self.k_weights = np.zeros(len(self.flat), dtype=np.int64)
        self.offset = {m: int(starts[i]) for i, m in enumerate(mods)}  # module -> its mask's place in flat
        for i, m in enumerate(mods):
            # its own mask, installed on the module: a tracker left behind by an earlier run
            # (a generator dropped unfinished) neither shares it nor takes it away (close)
            self.masks[m] = m.routes_seen = self.flat[starts[i] : starts[i] + sizes[i]]
            self.union_weights[starts[i] : starts[i] + self.num_experts_of[i]] = self.per_expert[i]
            self.k_weights[starts[i] + self.num_experts_of[i]] = self.per_expert[i]
        self.counts = {phase: np.zeros(len(self.flat), dtype=np.int64) for phase in ("verify", "draft")}
        self.token_passes = 0  # `token_pass`

    def start_pass(self, phase: str) -> None:
        self.phase = phase
        self.flat[:] = 0  # every module's mask (calls outside a pass count nowhere)

    def end_pass(self, figures: bool = True) -> None:
        """Count what the pass's Experts calls read: the union of their ids, per module (and
        a verification pass's own figures, unless `figures` is False: a caller that knows
        them, as long as one token's bytes are known)."""
        phase, self.phase = self.phase, None
        if not len(self.bounds):
            return
        self.counts[phase] += self.flat
        if phase == "verify" and ((self.per_pass and figures) or not self.token_bytes):
            self.pass_bytes = int(self.flat @ self.union_weights)
            self.token_bytes = int(self.flat @ self.k_weights)  # a module not called in this pass: 0
            if self.token_bytes and not self.top_k:  # from the last module called, once
                k = self.flat[self.bounds[1::2]]
                i = len(k) - 1 - int(k[::-1].argmax())
                self.top_k, self.num_experts = int(k[i]), int(self.num_experts_of[i])

    def end_pass_with_draft(self, draft_experts, figures: bool = True) -> None:
        """`end_pass` for a verification pass that made the head's draft step too (in its lane
        1, `SpeculativeDecoder._draft_in_pass`): the head's experts count as a draft's, the
        rest as the verification pass's."""
        mask = self.masks.get(draft_experts)
        if mask is not None:
            at = self.offset[draft_experts]
            self.counts["draft"][at : at + len(mask)] += mask
            mask[:] = 0
        self.end_pass(figures)

    def token_pass(self) -> None:
        """Count a one-row, one-token verification pass without its masks: it reads one
        token's experts, `token_bytes` (known from an earlier pass)."""
        self.token_passes += 1

    @property
    def bytes(self) -> dict[str, int]:
        """Routed-expert bytes the passes of each phase read so far."""
        if not len(self.bounds):
            return {phase: 0 for phase in self.counts}
        spent = {phase: int(np.add.reduceat(c, self.bounds)[0::2] @ self.per_expert) for phase, c in self.counts.items()}
        spent["verify"] += self.token_passes * self.token_bytes
        return spent

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
    experts the verification pass will read at layer 0 (module doc).

    The pass runs the trunk on [t_L, d1..dN]; each token is known as soon as it is drafted,
    so its layer-0 experts are predicted with the `token` predictor (experts/predict.py):
    the token's embedding through the router (`profile.mtp_route_scores`), top K. Hints
    target the store's next step (the verification pass) and are dropped after it. The
    prediction depends on the token alone, so each token's is computed once per decoder
    (~0.5 ms through the router, as long as an MTP draft step) and looked up after.
    """

    def __init__(self, net, store):
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


class DraftLength:
    """`draft_tokens="auto"`: the N in 0..4 with the most expected tokens per second (module doc)."""

    CONFIDENCE_EDGES = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)  # bins of a draft's probability under the head
    TIME_WINDOW = 15  # step times per N whose median prices that N
    # a try of drafting while plain steps are the best is this many steps in a row, the first
    # not priced (`cold`): the first drafting step after plain ones finds the head's weights
    # out of cache and its backlog to feed, and priced one draft at ~1.4x its usual step on
    # the demo model, so that "auto" kept to plain steps where one draft was 1.1x faster
    # (tries from a drafting N find the head warm: one step each)
    EXPLORE_BURST = 3
    FIRST_MEASURED = 2  # N = 0 .. FIRST_MEASURED - 1 measured before any is chosen by its price

    def __init__(self, max_n: int = MAX_DRAFT_TOKENS, prior: float = 0.6, expert_cost: float = 1.0,
                 draft_cost: float = 0.1, decay: float = 0.9, explore_every: int = 8, accept_decay: float = 0.97):
        self.max_n = max_n
        self.accept = [prior] * max_n  # a_i: P(draft i accepted | drafts < i accepted)
        # P(a draft accepted | drafts before it accepted) per bin of its probability under the head
        self.calibration = [prior] * (len(self.CONFIDENCE_EDGES) + 1)
        self.forced = False  # the last choice measures or explores an N: draft exactly that many
        self.expert_cost, self.draft_cost, self.decay = expert_cost, draft_cost, decay
        # the acceptance EMAs' (a_i, the bins'): over ~30 drafts, where ~10 (0.9) swung by
        # +-0.13 around the demo model's 0.76, a streak of misses priced one draft below a
        # plain step, and the rare tries of it after that were slow to price it back
        # (interleaved runs: auto 0.99x plain decoding with 0.9, 1.05x with 0.97; one draft 1.09-1.13x)
        self.accept_decay = accept_decay
        self.union: dict[int, float] = {}  # N -> EMA of verify-pass bytes / one token's bytes
        self.step_s: dict[int, float] = {}  # N -> a step's seconds, waits for experts excluded (`observe_time`)
        self._times: dict[int, collections.deque] = {}  # N -> the last TIME_WINDOW of them
        self.token_bytes = 0  # one token's routed-expert bytes
        self.wait_s_per_byte = 0.0  # EMA: seconds waited for experts per byte of a verification union
        self.k_over_e = 0.0
        self.explore_every = explore_every  # steps between explorations at first
        self.steps = 0
        self._flip = False
        # an exploration that leaves the best N as it was doubles the gap to the next one (up
        # to 8x): where drafting clearly loses (experts far away) the tries cost little
        self._gap = explore_every
        self._next_explore = explore_every
        self._last_best: int | None = None
        self._explored = False
        self._priced: tuple | None = None  # `_prices`, until the next measurement
        self._burst: list[int] = []  # the rest of a try's steps (EXPLORE_BURST)
        self.cold = False  # the step `choose` gave is a try's first: its time does not price its N
        self._plain_try = False

    def expected_tokens(self, n: int) -> float:
        total, run = 1.0, 1.0
        for a in self.accept[:n]:
            run *= a
            total += run
        return total

    def union_ratio(self, n: int) -> float:
        if n in self.union:
            return self.union[n]
        f = self.k_over_e
        return (1 - (1 - f) ** (n + 1)) / f if f > 0 else float(n + 1)

    def cost(self, n: int) -> float:
        """A step with n drafts relative to a plain decode step, from expert bytes alone."""
        if n == 0:
            return 1.0
        return 1.0 + self.expert_cost * (self.union_ratio(n) - 1.0) + n * self.draft_cost

    def step_time(self, n: int) -> float:
        """Seconds of a step with n drafts: its measured compute (an unmeasured n scaled by
        `cost` from the nearest measured one, or `cost` alone before any measurement) plus
        the expected wait for experts, the union's bytes times the measured seconds per byte."""
        wait = self.wait_s_per_byte * self.union_ratio(n) * self.token_bytes
        if n in self.step_s:
            return self.step_s[n] + wait
        if not self.step_s:
            return self.cost(n) + wait
        m = min(self.step_s, key=lambda m: (abs(m - n), m))
        return self.step_s[m] * self.cost(n) / self.cost(m) + wait

    def _prices(self) -> tuple[list[float], float]:
        """(step_time(n) for n in 0..max_n, the best expected tokens per second): worked out
        once between two measurements (a step's choice and its drafts' `more` ask several
        times; each `update` or `observe_*` starts afresh)."""
        if self._priced is None:
            times = [self.step_time(n) for n in range(self.max_n + 1)]
            rates = [self.expected_tokens(n) / t for n, t in enumerate(times)]
            self._priced = (times, max(rates), rates.index(max(rates)))
        return self._priced[:2]

    def best(self) -> int:
        self._prices()
        return self._priced[2]

    def choose(self) -> int:
        """N for the next step: 0 for a plain step; otherwise drafting may stop earlier or go
        further by the drafts' confidence (`more`), unless `forced` (measuring or exploring N)."""
        self.steps += 1
        self.forced = True
        self.cold = False
        # measure N = 0 and 1 first (cheaper than trusting the model for long); a larger N is
        # priced from them (`step_time`) until it is the best or the best's neighbour and tried:
        # measuring all five first cost a fresh run more than it learnt (`moerun generate
        # --draft-tokens auto`, 128 tokens of the demo model: 0.90x plain, where one draft was 1.14x)
        unmeasured = [n for n in range(min(self.FIRST_MEASURED, self.max_n + 1)) if n not in self.step_s]
        if unmeasured:
            return unmeasured[0]
        if self._burst:  # the rest of a try
            return self._burst.pop()
        n = self.best()
        if n != self._last_best:  # the figures moved: look around often again
            self._gap = self.explore_every
            self._next_explore = min(self._next_explore, self.steps + self._gap)
        elif self._explored:  # the last try left the best N as it was
            self._gap = min(2 * self._gap, 8 * self.explore_every)
        self._last_best, self._explored = n, False
        if self.steps >= self._next_explore:  # keep the neighbours' figures fresh
            self._next_explore = self.steps + self._gap
            self._explored = True
            self._flip = not self._flip
            step = 1 if self._flip or n == 0 else -1
            tried = min(max(n + step, 0), self.max_n)
            if n == 0:  # drafting tried after plain steps
                self._burst, self.cold = [tried] * (self.EXPLORE_BURST - 1), True
            self._plain_try = tried == 0  # a plain step tried while drafting is the best: one (`plain_run`)
            return tried
        self.forced = False
        return n

    def plain_run(self, most: int) -> int:
        """After `choose` gave a plain step: how many plain steps to make in one go (at most
        `most`), up to the next exploration, or one where it is a try while drafting is the
        best (a stretch of them cost ~16% of the demo model's steps); `steps` counts the
        first, the caller the rest."""
        if self._plain_try:
            self._plain_try = False
            return 1
        return max(1, min(most, self._next_explore - self.steps))

    def confidence_accept(self, confidence: float) -> float:
        """The measured acceptance of a draft with this probability under the head."""
        return self.calibration[self._bin(confidence)]

    def _bin(self, confidence: float) -> int:
        return bisect.bisect_right(self.CONFIDENCE_EDGES, confidence)

    def more(self, n: int, all_accepted: float) -> bool:
        """After n drafts that the trunk accepts all of with probability `all_accepted` (the
        product of their `confidence_accept`): whether one more is worth its cost. It adds
        all_accepted * a_{n+1} tokens in expectation and costs t(n+1) - t(n) seconds, which at
        the best N's expected rate would have given that many tokens too."""
        if n >= self.max_n:
            return False
        times, rate = self._prices()
        return all_accepted * self.accept[n] >= (times[n + 1] - times[n]) * rate

    def update(self, checked: int, accepted: int, confidences: list[float] | None = None) -> None:
        """A row's step: `accepted` of its first `checked` drafts accepted, their probabilities
        under the head `confidences` (if known)."""
        if not checked:  # a plain step: nothing to learn
            return
        self._priced = None
        for i in range(min(accepted + 1, checked)):  # drafts 1..accepted+1 were looked at
            hit = 1.0 if i < accepted else 0.0
            d = self.accept_decay
            self.accept[i] = d * self.accept[i] + (1 - d) * hit
            if confidences is not None:
                b = self._bin(confidences[i])
                self.calibration[b] = d * self.calibration[b] + (1 - d) * hit

    def observe_union(self, n: int, ratio: float, k_over_e: float, token_bytes: int = 0) -> None:
        self._priced = None
        self.k_over_e = k_over_e
        self.token_bytes = token_bytes or self.token_bytes
        old = self.union.get(n)
        self.union[n] = ratio if old is None else self.decay * old + (1 - self.decay) * ratio

    def observe_time(self, n: int, seconds: float, wait_s: float = 0.0, union_bytes: int = 0) -> None:
        """A step with n drafts took `seconds`, `wait_s` of them waiting for the expert store
        while reading `union_bytes` of routed experts in its verification pass."""
        window = self._times.setdefault(n, collections.deque(maxlen=self.TIME_WINDOW))
        window.append(seconds - wait_s)
        # the median of the last few: on a shared machine one preempted step is several times
        # the others, and an average would carry it for many steps (it priced one draft at 2x
        # its real cost here, and auto chose too few)
        median = sorted(window)[len(window) // 2]
        if self.step_s.get(n) != median:
            self.step_s[n] = median
            self._priced = None
        if union_bytes and (wait_s or self.wait_s_per_byte):
            self.wait_s_per_byte = self.decay * self.wait_s_per_byte + (1 - self.decay) * wait_s / union_bytes
            self._priced = None


class SpeculativeDecoder:
    """Runs `Sequence`s like `generate.run`, drafting with the MTP head and verifying in one pass.

    After `run` the trunk's `cache`, the head's `mtp_cache` and each row's pending (hidden
    state, next token) pairs not yet given to the head (`pend_h`, `pend_t`) are kept for
    inspection.
    """

    def __init__(self, net, dtype: torch.dtype, draft_tokens: int | str = 1, expert_cost: float = 1.0,
                 chooser: DraftLength | None = None, kv_dtype: torch.dtype | None = None, prefetch: bool = True,
                 draft_vocab: int | None = None):
        check_speculative(net, "mtp")
        self.net = net
        # drafts come from the LM head's first draft_vocab rows (`draft_head`); None: all of them
        self.draft_vocab = check_draft_vocab(net, draft_vocab)
        self.draft_head = draft_head(net.lm_head, self.draft_vocab) if self.draft_vocab is not None else None
        self.vocab = net.lm_head.out_features
        # with an expert store (`net.expert_store`): its figures, and the drafts' experts hinted to it
        self.store = getattr(net, "expert_store", None)
        self.prefetcher = DraftPrefetch(net, self.store) if self.store is not None and prefetch else None
        self.dtype = dtype
        self.kv_dtype = kv_dtype  # the KV caches' storage (`Cache`)
        self.draft_tokens = check_draft_tokens(draft_tokens)
        self.chooser = None
        if self.draft_tokens == "auto":  # a chooser passed in keeps what earlier runs measured
            self.chooser = chooser if chooser is not None else new_draft_length(net, expert_cost)
        self.cache: Cache | None = None
        self.mtp_cache: Cache | None = None
        self.drafter = None  # a run's MTP calls made ready once (`mtp_drafter`), for one row
        self._mtp_len = None  # the head's cache lengths (a numpy view): where the drafter's calls go
        self._len = None  # the trunk's cache lengths (a numpy view)
        self._slots = (None, None)  # (rows, their slots tensor): a step's, kept while the rows stay the same
        self.plans: dict = {}  # the trunk forwards' keyword arguments for a run (`generate.run_plans`)
        self._fused = None  # a run's `Drafter.bind_draft`, for drafts made in a pass (`_draft_in_pass`)

    # -- the MTP head ----------------------------------------------------------
    def _mtp(self, hidden, tokens, slots):
        """-> (the last position's logits [B, 1, V] and the head's final normed hidden state
        [B, 1, H]): drafting reads only the last; a catch-up call over T pending pairs caches
        every pair's keys and values but runs the layer's MoE and the LM head on the last
        position alone (they would read the experts of T tokens, and the head once per 4).
        One row (single-stream decoding) goes through the run's `drafter` when it takes the call."""
        if self.drafter is not None:
            # more pairs than one native call takes (a long prompt's, at a run's first step):
            # calls of mtp.MAX_TOKENS in turn, the last one's output kept (each caches its
            # pairs' keys and values as the one call would)
            pos, T = int(self._mtp_len[0]), hidden.shape[1]
            step = MTP_CALL_TOKENS
            for t0 in range(0, T, step):
                got = self.drafter.run(hidden[:, t0 : t0 + step], tokens[:, t0 : t0 + step], pos + t0)
                if got is None:
                    break
                self._mtp_len[0] = pos + min(t0 + step, T)
            else:
                return got
            self._mtp_len[0] = pos
        return self.net.mtp_logits(hidden, tokens, self.mtp_cache, slots, return_hidden=True, head=self.draft_head,
                                   last_only=True)

    # -- the loop --------------------------------------------------------------
    def run(self, seqs: list[Sequence], eos_ids: set[int], stats: SpeculativeStats | None = None) -> Iterator[tuple[int, str]]:
        stats = stats if stats is not None else SpeculativeStats()
        stats.draft_tokens = self.draft_tokens
        stats.draft_vocab = self.draft_vocab
        stats.prefetch = self.prefetcher is not None
        net = self.net
        B = len(seqs)
        n_max = MAX_DRAFT_TOKENS if self.draft_tokens == "auto" else self.draft_tokens
        # slack: a verification pass may write up to n_max positions past the last useful one
        max_len = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs) + n_max + 2
        # the caches and the trunk's plans, kept from one run to the next (`generate.kept_run`)
        (cache, self.mtp_cache), self.plans, release = kept_run(
            net, "speculative", [net.cache_spec(), net.mtp_cache_spec()], B, max_len, self.dtype, self.kv_dtype)
        self.cache = cache
        recurrent = [layer for layer in cache.layers if isinstance(layer, RecurrentState)]
        for layer in recurrent:  # verification passes leave every token's state here (keep_every)
            layer.positions = {}
        tracker = ExpertTracker(net, per_pass=self.chooser is not None)
        # per row: trunk hidden states not yet given to the MTP head, and the token after each
        # (the last of them: the sampled token the trunk has not run yet)
        self.pend_h = pend_h = [None] * B
        self.pend_t = pend_t = [[] for _ in range(B)]
        try:
            with torch.inference_mode():
                # one row: the head's calls on its slot made ready once for the run (the checks
                # and arguments `mtp_logits` makes again at every call)
                mtp_drafter = getattr(net, "mtp_drafter", None)
                self.drafter = mtp_drafter(self.mtp_cache, 0, self.draft_head) if B == 1 and mtp_drafter else None
                # drafts made inside 2-token passes (`_draft_in_pass`): the drafter takes the
                # trunk's embedding, final norm and LM head once
                head = draft_head_args(net, cache) if self.drafter is not None else None
                self._fused = self.drafter.bind_draft(*head) if head is not None else None
                # trunk passes run so far per width, since the plans were made: the first pass of
                # a width runs the modules (making the plans), the second builds the native
                # stack, so neither prices its N for "auto" (a plain step's first pass took
                # several times a later one's, and "auto" then kept away from plain steps that
                # were the fastest); kept with the plans
                inner = self.plans.get("plans")
                self._passes = collections.Counter() if inner is None else \
                    inner.setdefault(("speculative", "passes"), collections.Counter())
                self._mtp_len = self.mtp_cache.lengths.numpy()
                self._len = cache.lengths.numpy()
                t0 = time.perf_counter()
                last = [None] * B
                by_length: dict[int, list[int]] = {}
                for b, s in enumerate(seqs):
                    by_length.setdefault(len(s.prompt_ids), []).append(b)
                    stats.prompt_tokens += len(s.prompt_ids)
                for rows in by_length.values():  # prompts of one length prefill together
                    ids = torch.tensor([seqs[b].prompt_ids for b in rows], dtype=torch.long)
                    logits, hidden = net(ids, cache, torch.tensor(rows), last_only=True, return_hidden=True,
                                         **self.plans)
                    for j, b in enumerate(rows):
                        last[b], pend_h[b], pend_t[b] = logits[j, -1], hidden[j], list(seqs[b].prompt_ids[1:])
                stats.prefill_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                store0 = store_figures(self.store) if self.store is not None else None
                active = []
                for b, s in enumerate(seqs):
                    if s.params.max_tokens == 0:
                        s.finish_reason = "length"
                        continue
                    stats.decode_rows_started += 1
                    tok = int(sample(last[b][None], s.params, [s.history()], s.uniforms)[0])
                    stats.generated_tokens += 1
                    piece = s.accept(tok, eos_ids)
                    if piece:
                        yield b, piece
                    if not s.finished:
                        pend_t[b].append(tok)
                        active.append(b)
                if active:  # the head takes the prompt's pairs as its prefill (all but the last: `_settle`)
                    t1 = time.perf_counter()
                    self._settle(active, self._len[active].tolist(), pend_h, pend_t, tracker)
                    settled = time.perf_counter() - t1
                    stats.prefill_s += settled
                    t0 += settled
                while active:
                    yield from self._step(seqs, active, pend_h, pend_t, eos_ids, stats, tracker, recurrent)
                    active = [b for b in active if not seqs[b].finished]
                stats.decode_s += time.perf_counter() - t0
                if store0 is not None:
                    moved, stall = store_figures(self.store)
                    stats.moved_expert_bytes += moved - store0[0]
                    stats.expert_stall_s += stall - store0[1]
        finally:
            release()
            spent = tracker.bytes
            stats.verify_expert_bytes += spent["verify"]
            stats.draft_expert_bytes += spent["draft"]
            tracker.close()

    def _draft(self, seqs, active, slots, L, n, pend_h, pend_t, tracker):
        """Drafts [len(active)][n'] and their distributions (None when greedy), and each draft's
        probability under the head. slots: the rows' cache slots (`active` as a tensor), L
        their trunk cache lengths. n' is n, except with "auto" (not `forced`): drafting goes
        on while the chooser finds one more draft worth it (`DraftLength.more`), up to its
        max_n, from the rows' chances that every draft so far is accepted."""
        tracker.start_pass("draft")
        B = len(active)
        logits_now, h_last = self._catch_up(active, slots, L, pend_h, pend_t)
        drafts = [[] for _ in active]
        qs = [[] for _ in active]
        confidences = [[] for _ in active]
        chooser = self.chooser if self.chooser is not None and not self.chooser.forced else None
        all_accepted = [1.0] * B  # per row: the chance that every draft so far is accepted
        n_cap = chooser.max_n if chooser is not None else n
        for d in range(n_cap):
            for i, b in enumerate(active):
                s = seqs[b]
                if self.draft_vocab is not None:  # the penalty's tokens among the drafter's
                    history, extra = [t for t in s.prompt_ids + s.out_ids + drafts[i] if t < self.draft_vocab], []
                else:
                    history, extra = s.history(), drafts[i]
                conf = None  # the draft's probability under the head, where "auto" bins it
                if s.params.greedy and self.chooser is not None:
                    (tok, conf), q = greedy_token_probability(logits_now[i], history, s.params.repetition_penalty,
                                                              extra), None
                elif s.params.greedy:
                    tok, q = greedy_token(logits_now[i], history, s.params.repetition_penalty, extra), None
                else:
                    q = torch.empty(logits_now[i].shape[-1])
                    tok = draw(logits_now[i], s.params, history, s.uniforms, extra, probs=q)
                    conf = float(q[tok])
                drafts[i].append(tok)
                qs[i].append(q)
                if self.chooser is not None:
                    confidences[i].append(conf)
                    if chooser is not None:
                        all_accepted[i] *= chooser.confidence_accept(conf)
                if q is not None and self.draft_vocab is not None:  # q over the whole vocabulary, for the
                    qs[i][-1] = torch.nn.functional.pad(q, (0, self.vocab - self.draft_vocab))  # rejection test
            if self.prefetcher is not None:  # moved while the head drafts the next one
                self.prefetcher.tokens([dr[-1] for dr in drafts])
            if chooser is not None and not chooser.more(d + 1, max(all_accepted)):
                break
            if d + 1 < n_cap:  # chained: the head's own output stands in for the trunk's hidden state
                # [B, 1, H]
                hidden = h_last if torch.is_tensor(h_last) else h_last[0][None] if B == 1 else torch.stack(h_last)
                tokens = long_ids([[dr[-1]] for dr in drafts])
                logits, h = self._mtp(hidden, tokens, slots)
                logits_now, h_last = logits[:, -1], h[:, -1:]
        tracker.end_pass()
        return drafts, qs, confidences

    def _draft_in_pass(self, seqs, active, slots, L, pend_h, pend_t, first, tracker, recurrent):
        """One draft on one row, made inside its verification pass: the head's catch-up and
        draft step and the draft's pick (greedy, or sampled with the row's next uniform, as
        `_draft` makes them) run in the trunk pass's lane 1 while lane 0 takes t_L through the
        trunk, and the draft follows it as the pass's second token; both positions' final
        norm and LM head, and for a greedy row their picks, are native too
        (`layers.stack.draft_pass`; two threads, a model whose 2-token pass runs in lanes).
        The same tokens, logits and states as `_draft` then the pass (tested), with the head's
        call off the step's critical path and none of their Python: on the demo model,
        drafting first then verifying was 0.87-0.91x plain decoding's speed, this 1.1-1.2x
        greedy. A sampled row's draft is checked in the pass too (speculative sampling with the
        row's next two uniforms, `NativeMtp.stage`). -> (drafts, qs, confidences, logits [1,
        2, V], hidden [1, 2, H], a greedy row's picks [2], a sampled row's (tokens to emit,
        drafts accepted)), or None with nothing run where it does not apply."""
        fused = self._fused
        if fused is None or len(active) != 1:
            return None
        b, s = active[0], seqs[active[0]]
        net = self.net
        # the pass goes to `draft_pass` as the model's forward would go to `model_pass`, past
        # its call: only where the call's hooks can be made here
        hooks = kernels.call_hooks(net)
        if hooks is None:
            return None
        native, hidden, logits, picks, pick, prob, q = fused
        ph = pend_h[b]
        if ph.shape[0] > IN_PASS_MAX_PAIRS:  # a long backlog (a prompt's) runs on both cores first
            return None
        if not draft_pass_ready(net, self.cache, b, self.plans.get("plans")):  # (one thread, a run's first passes)
            return None
        greedy = s.params.greedy
        if not greedy and s.params.max_tokens - len(s.out_ids) < 2:
            return None  # (a last token checks no draft: `_accept` draws it alone)
        # a sampled row's uniforms now, in the order `_draft` and `_accept` draw them: the
        # draft's, its check's, and the next token's (the one after an accepted draft, or a
        # rejected one's replacement); given back if the pass does not run
        us = [] if greedy else [s.uniforms.next() for _ in range(3)]
        if not self.drafter.stage(native, ph, np.array(pend_t[b], dtype=np.int64), L[0] - ph.shape[0],
                                  _id_array(s.history()), s.params, *(us or [-1.0])):
            for u in reversed(us):
                s.uniforms.put_back(u)
            return None
        for layer in recurrent:
            layer.positions.clear()
        hooks(_TWO_IDS)
        tracker.start_pass("verify")  # (none ran if the pass does not apply: the next start clears it)
        if not draft_pass(net, first[0], self.cache, slots, self.plans.get("plans"), native):
            for u in reversed(us):
                s.uniforms.put_back(u)
            return None
        tracker.end_pass_with_draft(self.drafter.experts)
        self._mtp_len[b] = L[0]  # the head's cache took every pending pair
        d = int(pick[0])
        conf = [float(prob[0])] if self.chooser is not None or not greedy else []
        if greedy:
            return [[d]], [[None]], [conf], logits, hidden.clone(), picks.tolist(), None
        k, tok = picks.tolist()  # the pass checked the draft: (accepted, the token after)
        return [[d]], [[None]], [conf], logits, hidden.clone(), None, ([d, tok] if k else [tok], k)

    def _catch_up(self, active, slots, L, pend_h, pend_t) -> tuple[list, list]:
        """Feed the head every pending (hidden, next token) pair of the rows, rows with as many
        pairs together (all rows, in single-stream decoding): its KV cache then reaches the
        trunk's lengths L. -> each row's logits [V] and normed hidden state [1, H] at its last
        pair (what the first draft comes from)."""
        B = len(active)
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(active):
            c = pend_h[b].shape[0]
            self._mtp_len[b] = L[i] - c
            groups.setdefault(c, []).append(i)
        logits_now: list = [None] * B
        h_last: list = [None] * B
        for rows in groups.values():
            hidden = pend_h[active[rows[0]]][None] if len(rows) == 1 else torch.stack([pend_h[active[i]] for i in rows])
            tokens = long_ids([pend_t[active[i]] for i in rows])
            logits, h = self._mtp(hidden, tokens, slots if len(rows) == B else slots[rows])
            for j, i in enumerate(rows):
                logits_now[i], h_last[i] = logits[j, -1], h[j, -1:]
        return logits_now, h_last

    def _feed_pending(self, active, slots, L, pend_h, pend_t, tracker):
        """A plain step's catch-up (every PLAIN_CATCH_UP_PAIRS of them): the head takes every
        pending pair of the rows, and none is left pending."""
        tracker.start_pass("draft")
        self._catch_up(active, slots, L, pend_h, pend_t)
        tracker.end_pass()
        for b in active:
            pend_h[b], pend_t[b] = pend_h[b][:0], []

    def _settle(self, active, L, pend_h, pend_t, tracker):
        """After the prompt (as the head's prefill: its time counts as prefill) and before a
        drafting step of "auto": feed the head all but the last of the pending pairs of each
        row that has more than a drafting step leaves (MAX_DRAFT_TOKENS + 1): the prompt's, or
        the backlog of a run of plain steps. The step then catches up on one pair, as after a
        drafting step, and its time (what prices N) leaves out the backlog."""
        rows = [i for i, b in enumerate(active) if pend_h[b].shape[0] > MAX_DRAFT_TOKENS + 1]
        if not rows:
            return
        sub = [active[i] for i in rows]
        last = {b: (pend_h[b][-1:], pend_t[b][-1:]) for b in sub}
        for b in sub:
            pend_h[b], pend_t[b] = pend_h[b][:-1], pend_t[b][:-1]
        tracker.start_pass("draft")
        self._catch_up(sub, torch.tensor(sub), [L[i] - 1 for i in rows], pend_h, pend_t)
        tracker.end_pass()
        for b in sub:
            pend_h[b], pend_t[b] = last[b]

    def _step(self, seqs, active, pend_h, pend_t, eos_ids, stats, tracker, recurrent):
        net, cache = self.net, self.cache
        n = self.chooser.choose() if self.chooser is not None else self.draft_tokens
        if self._slots[0] != active:  # the same tensor while the rows stay (it keeps what `Cache` learnt of it)
            self._slots = (list(active), torch.tensor(active))
        slots = self._slots[1]
        if n == 0 and len(active) == 1:
            yield from self._plain_steps(seqs, active[0], slots, pend_h, pend_t, eos_ids, stats, tracker)
            return
        L = self._len[active].tolist()
        if n > 0 and self.chooser is not None:
            self._settle(active, L, pend_h, pend_t, tracker)
        t0 = time.perf_counter()
        wait0 = store_figures(self.store)[1] if self.chooser is not None and self.store is not None else 0.0
        if self.prefetcher is not None and n > 0:  # t_L: the first token of the verification pass
            # (a plain step hints nothing, as plain decoding does not: with half the demo's
            # experts in RAM, hints on "auto"'s plain steps cost ~10% of their speed)
            self.prefetcher.tokens([pend_t[b][-1] for b in active])
        first = [pend_t[b][-1] for b in active]  # t_L, the sampled token the trunk runs first
        # one row's plain step reads one token's experts: its union figures are known (ratio 1)
        figures = n > 0 or len(active) > 1
        fused = None if n != 1 else self._draft_in_pass(seqs, active, slots, L, pend_h, pend_t, first, tracker,
                                                         recurrent)
        # where the pass made them: a greedy row's picks at each position, a sampled row's check
        picks = decided = None
        if fused is not None:
            drafts, qs, confidences, logits, hidden, picks, decided = fused
        else:
            if n > 0:
                drafts, qs, confidences = self._draft(seqs, active, slots, L, n, pend_h, pend_t, tracker)
                n = len(drafts[0])
            else:  # a plain step of several rows ("auto" only; one row's: `_plain_steps`): the head catches up later
                drafts, qs, confidences = [[] for _ in active], [[] for _ in active], [[] for _ in active]
                if max(pend_h[b].shape[0] for b in active) >= PLAIN_CATCH_UP_PAIRS:
                    # ... or here, every PLAIN_CATCH_UP_PAIRS steps of a long run of plain ones.
                    # Not every FUSED_MAX_TOKENS, in one native call each: each call runs the head's
                    # MoE and reads its experts (from disk, with half the demo's experts in RAM:
                    # plain steps in the speculative loop were then 0.84x plain decoding's speed)
                    self._feed_pending(active, slots, L, pend_h, pend_t, tracker)
            ids = long_ids([[t] + drafts[i] for i, t in enumerate(first)])
            if n > 0:  # (a one-token pass keeps no per-token states)
                for layer in recurrent:
                    layer.positions.clear()
            tracker.start_pass("verify")
            try:
                logits, hidden = net(ids, cache, slots, return_hidden=True, **self.plans)  # [B, n+1, V], [B, n+1, H]
            finally:
                tracker.end_pass(figures)
        stats.draft_hist[n] = stats.draft_hist.get(n, 0) + 1
        if n > 0 and not all(layer.positions for layer in recurrent):
            raise MoerunError("speculative decoding cannot roll back this model's recurrent state (no per-token states)")
        stats.verify_steps += 1
        stats.decode_steps += 1
        stats.single_token_expert_bytes = max(stats.single_token_expert_bytes, tracker.token_bytes)
        if self.chooser is not None and tracker.token_bytes and figures:
            k_over_e = tracker.top_k / tracker.num_experts if tracker.num_experts else 0.0
            self.chooser.observe_union(n, tracker.pass_bytes / (tracker.token_bytes * len(active)), k_over_e,
                                       tracker.token_bytes)
        busy = time.perf_counter() - t0  # the step's own time, not the consumer's between yields
        wait = store_figures(self.store)[1] - wait0 if self.chooser is not None and self.store is not None else 0.0
        rollback: dict[int, int] = {}  # row of the batch -> positions it keeps
        for i, b in enumerate(active):
            s = seqs[b]
            cap = min(n, s.params.max_tokens - len(s.out_ids))  # drafts worth checking
            tokens, k = (decided if decided is not None else _greedy_accept(drafts[i][:cap], picks)
                         if picks is not None else self._accept(s, drafts[i][:cap], qs[i][:cap], logits[i]))
            stats.drafted += cap
            stats.accepted += k
            if self.chooser is not None:
                self.chooser.update(cap, k, confidences[i][:cap])
            stats.row_steps += 1
            emitted = 0
            for tok in tokens:
                stats.generated_tokens += 1
                stats.emitted += 1
                emitted += 1
                piece = s.accept(tok, eos_ids)
                if piece:
                    yield b, piece
                if s.finished:
                    break
            # the trunk keeps t_L and the drafts that were emitted (all k, unless the row
            # finished on one of them); the token after them is the next to run. Finished
            # rows are rolled back too, so the cache always ends at a token boundary.
            keep = 1 + min(emitted, k)
            self._len[b] = L[i] + keep
            if n > 0:
                pend_h[b] = hidden[i, :keep]
                pend_t[b] = (drafts[i][:k] + [tokens[-1]])[:keep]
            else:  # the head was not called: these pairs join the ones still pending
                pend_h[b] = torch.cat([pend_h[b], hidden[i, :1]])
                pend_t[b] = pend_t[b] + [tokens[-1]]
            if keep < n + 1:
                rollback[i] = keep
        t1 = time.perf_counter()
        for i, keep in rollback.items():  # recurrent states: the one after the last kept token
            for state in recurrent:
                state.roll_back(active[i], i, keep)
        self._passes[n] += 1
        if self.chooser is not None and self._passes[n] > 2 and not self.chooser.cold:
            union = tracker.pass_bytes if figures else tracker.token_bytes
            self.chooser.observe_time(n, busy + time.perf_counter() - t1, wait, union // len(active))

    def _plain_steps(self, seqs, b, slots, pend_h, pend_t, eos_ids, stats, tracker):
        """"auto"'s plain steps on one row (the chooser's N = 0), one after another as plain
        decoding makes them, until the chooser's next exploration (at most PLAIN_STRETCH) or
        the row's end: each runs the row's next token through the trunk and samples the one
        after, its (hidden state, token) pair joining the head's pending ones (fed to it every
        PLAIN_CATCH_UP_PAIRS steps). What `_step` does for a plain step, without the work a
        drafting step needs (per-step lists, the drafts' bookkeeping, the pass's expert masks
        once one token's bytes are known: a one-row plain step reads exactly them); in a
        `_step` each cost ~0.1 ms a token, 14% of the demo model's plain speed."""
        net, cache, chooser, s = self.net, self.cache, self.chooser, seqs[b]
        steps = chooser.plain_run(PLAIN_STRETCH)
        for i in range(steps):
            t0 = time.perf_counter()
            wait0 = store_figures(self.store)[1] if self.store is not None else 0.0
            first = pend_t[b][-1]  # t_L, the sampled token the trunk runs
            if len(pend_t[b]) >= PLAIN_CATCH_UP_PAIRS:  # (as `_step` does)
                self._feed_pending([b], slots, [int(self._len[b])], pend_h, pend_t, tracker)
            counted = tracker.token_bytes > 0  # else this pass's masks tell them
            if not counted:
                tracker.start_pass("verify")
            logits, hidden = net(long_ids([[first]]), cache, slots, last_only=True, return_hidden=True, **self.plans)
            if counted:
                tracker.token_pass()
            else:
                tracker.end_pass(False)
            stats.draft_hist[0] = stats.draft_hist.get(0, 0) + 1
            stats.verify_steps += 1
            stats.decode_steps += 1
            stats.row_steps += 1
            stats.single_token_expert_bytes = max(stats.single_token_expert_bytes, tracker.token_bytes)
            (tok,), _ = self._accept(s, [], [], logits[0])
            busy = time.perf_counter() - t0
            pend_h[b] = torch.cat([pend_h[b], hidden[0]])
            pend_t[b].append(tok)
            self._passes[0] += 1
            if self._passes[0] > 2:
                wait = store_figures(self.store)[1] - wait0 if self.store is not None else 0.0
                chooser.observe_time(0, busy, wait, tracker.token_bytes)
            stats.generated_tokens += 1
            stats.emitted += 1
            piece = s.accept(tok, eos_ids)
            if piece:
                yield b, piece
            if s.finished:
                break
        chooser.steps += i  # choose() counted the first

    @staticmethod
    def _accept(s: Sequence, drafts: list[int], qs: list, logits: torch.Tensor) -> tuple[list[int], int]:
        """Check drafts against the trunk's logits [n+1, V]: (tokens to emit, drafts accepted)."""
        p_ = s.params
        n = len(drafts)
        if p_.greedy:  # the trunk's pick at each position (history ending with drafts[:j]) up to the first miss
            # every position's pick at once
            return _greedy_accept(drafts, greedy_tokens(logits, s.history(), p_.repetition_penalty, drafts))
        out: list[int] = []
        for j, d in enumerate(drafts):
            p = distribution(logits[j], p_, s.history(), out)
            q = qs[j]
            u = s.uniforms.next()
            if q[d] > 0 and u * float(q[d]) < float(p[d]):
                out.append(d)
                continue
            # its replacement from norm(max(0, p - q)) with the row's next uniform (as a draft
            # checked inside its pass draws it, natively)
            return out + [residual_draw(p, q, s.uniforms.next())], j
        return out + [draw(logits[n], p_, s.history(), s.uniforms, out)], n


def _greedy_accept(drafts: list[int], picks: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance: drafts up to the first that is not the trunk's pick at its position
    (picks [n+1]: each position's, the history ending with the drafts before it), then the
    trunk's pick there -> (tokens to emit, drafts accepted)."""
    for j, d in enumerate(drafts):
        if picks[j] != d:
            return drafts[:j] + [picks[j]], j
    return drafts + [picks[len(drafts)]], len(drafts)


def new_draft_length(net, expert_cost: float = 1.0) -> DraftLength:
    n_layers = len(getattr(getattr(net, "model", None), "layers", [])) or 1
    return DraftLength(expert_cost=expert_cost, draft_cost=1.0 / (n_layers + 1))


def run_speculative(net, seqs: list[Sequence], eos_ids: set[int], dtype: torch.dtype, stats: SpeculativeStats | None = None,
                    draft_tokens: int | str = 1, expert_cost: float = 1.0, chooser: DraftLength | None = None,
                    kv_dtype: torch.dtype | None = None, prefetch: bool = True,
                    draft_vocab: int | None = None) -> Iterator[tuple[int, str]]:
    """`generate.run` with MTP drafting: yields (row, text piece) as tokens are accepted.
    prefetch: with an expert store, hint it with the drafts' experts (`DraftPrefetch`);
    draft_vocab: draft among the LM head's first rows only (`draft_head`)."""
    return SpeculativeDecoder(net, dtype, draft_tokens, expert_cost, chooser, kv_dtype, prefetch,
                              draft_vocab).run(seqs, eos_ids, stats)
