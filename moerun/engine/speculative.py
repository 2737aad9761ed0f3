"""Self-speculative decoding with the checkpoint's multi-token-prediction (MTP) head.

One step for a row whose last accepted token t_L sits at position L (not yet run through
the trunk):

1. Draft.  The MTP head turns (h_{L-1}, t_L) into a guess d1 for position L+1. Chained
   drafts d2..dN reuse the same MTP layer (depth 0): the head's own final normed hidden
   state stands in for the trunk's h_{L+j-1}. The head's KV cache gets entries for those
   guessed states; they are overwritten next step (below).
2. Verify.  One trunk pass over [t_L, d1..dN] (T = N+1 per row) gives the trunk's
   distribution at every draft position. Greedy (temperature 0): accept d_j while it is
   the trunk's argmax (after the repetition penalty, exactly as the plain sampler sees
   it); the first mismatch is replaced by the argmax: the plain greedy text. Sampling:
   accept d_j with probability min(1, p(d_j)/q(d_j)), otherwise draw from norm(max(0, p -
   q)) (`sampling.residual_draw`) and stop (Leviathan et al. 2023); when all N are accepted
   one more token comes from p. p is the plain sampler's distribution, q the draft's, so
   the output distribution equals plain sampling.
3. Roll back to the last accepted position L+k.
   - KV caches (trunk and MTP): set the slot's length back; the stale entries past it are
     masked by attention and overwritten by the next write.
   - Gated DeltaNet conv and recurrent states cannot be truncated. A verification pass runs
     the delta rule token by token, the same update as one-token decode, and leaves the
     state after every token in the layer's `RecurrentState.positions` (`keep_every`); a
     rejection copies back the state after the last kept token: no copy before
     verification, no re-run.
   - The MTP head keeps the (trunk hidden state, next token) pairs it has not seen yet
     (`pend_h`, `pend_t`); the next step's first MTP call feeds them together, rewriting
     the guessed entries, and its last row is that step's first draft.

`draft_tokens="auto"` (`DraftLength`) chooses N in 0..4 each step: the N with the most
expected tokens per second, E(N) / t(N), where E(N) = 1 + sum_{j<=N} prod_{i<=j} a_i from
an EMA of each draft's acceptance a_i, and t(N) the median of the last measured step times
with N drafts (waits for the expert store included). N = 0 is a plain step, so "auto" falls
back to plain decoding when drafts are rarely accepted; a neighbour of the best N is tried
every few steps so that its figures stay current.

Around the algorithm (engine/draft_extras.py): the routed-expert bytes of each pass
(`ExpertTracker`); with an expert store, the drafts' layer-0 experts hinted to it
(`DraftPrefetch`) and the bytes it moved and the seconds waited; and the draft vocabulary
(`draft_head`: drafts among the LM head's first rows).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .. import kernels
from ..errors import MoerunError
from ..layers.mtp import MAX_TOKENS as MTP_CALL_TOKENS
from ..layers.stack import decode_path
from ..layers.cache import Cache, RecurrentState
from .draft_extras import DraftPrefetch, ExpertTracker, draft_head, store_figures
from .generate import GenerationStats, Sequence, long_ids, run_plans
from .sampling import distribution, draw, greedy_token, greedy_tokens, residual_draw, sample

MAX_DRAFT_TOKENS = 4


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
    # with an expert store: bytes moved into its compute tier and seconds waited for experts,
    # while decoding; `prefetch`: drafts' experts were hinted
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
        """Trunk expert bytes per emitted token (verification unions), and that minus one token's."""
        return self.verify_expert_bytes / self.emitted if self.emitted else 0.0

    @property
    def extra_expert_bytes_per_token(self) -> float:
        return self.expert_bytes_per_token - self.single_token_expert_bytes if self.emitted else 0.0

    def as_dict(self) -> dict:
        per = (lambda x: x / self.emitted) if self.emitted else (lambda x: 0.0)
        return {
            **{k: getattr(self, k) for k in ("draft_tokens", "draft_vocab", "acceptance_rate", "accepted_tokens_per_step",
                                             "decode_tok_s", "prefill_tok_s", "generated_tokens", "verify_steps")},
            "draft_tokens_used": dict(sorted(self.draft_hist.items())),
            "expert_bytes_per_token": self.expert_bytes_per_token,
            "extra_expert_bytes_per_token": self.extra_expert_bytes_per_token,
            "single_token_expert_bytes": self.single_token_expert_bytes,
            "draft_expert_bytes_per_token": per(self.draft_expert_bytes),
            "moved_expert_bytes_per_token": per(self.moved_expert_bytes),
            "expert_stall_s_per_token": per(self.expert_stall_s),
            "prefetch": self.prefetch,
        }


def check_draft_tokens(draft_tokens) -> int | str:
    if draft_tokens == "auto":
        return "auto"
    n = int(draft_tokens) if str(draft_tokens).strip().isdigit() else 0
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


class DraftLength:
    """`draft_tokens="auto"`: the N in 0..max_n with the most expected tokens per second
    (module doc)."""

    TIME_WINDOW = 15  # a step time per N is the median of its last this many (a preempted step moves nothing)

    def __init__(self, max_n: int = MAX_DRAFT_TOKENS, prior: float = 0.6, decay: float = 0.97,
                 explore_every: int = 8):
        self.max_n = max_n
        self.accept = [prior] * max_n  # a_i: P(draft i accepted | drafts < i accepted), EMAs
        self.decay = decay  # the EMAs average ~1 / (1 - decay) drafts
        self.explore_every = explore_every
        self.step_s: dict[int, float] = {}  # N -> the median of its measured step times
        self._times: dict[int, collections.deque] = {}
        self.steps = 0

    def expected_tokens(self, n: int) -> float:
        total, run = 1.0, 1.0
        for a in self.accept[:n]:
            run *= a
            total += run
        return total

    def step_time(self, n: int) -> float:
        """A step's seconds with n drafts: measured, else extrapolated along the line through
        the measured N = 0 and 1 (both are measured first)."""
        if n in self.step_s:
            return self.step_s[n]
        t0, t1 = self.step_s.get(0, 1.0), self.step_s.get(1, 1.1)
        return t0 + n * max(t1 - t0, 0.0)

    def best(self) -> int:
        rates = [self.expected_tokens(n) / self.step_time(n) for n in range(self.max_n + 1)]
        return rates.index(max(rates))

    def choose(self) -> int:
        """N for the next step (0: a plain step): N = 0 and 1 measured first, then the best N,
        and every `explore_every` steps a neighbour of it (alternately above and below)."""
        self.steps += 1
        for n in range(min(2, self.max_n + 1)):
            if n not in self.step_s:
                return n
        n = self.best()
        if self.steps % self.explore_every == 0:
            up = (self.steps // self.explore_every) % 2 == 0 or n == 0
            return min(max(n + (1 if up else -1), 0), self.max_n)
        return n

    def update(self, checked: int, accepted: int) -> None:
        """A row's step: `accepted` of its first `checked` drafts accepted."""
        for i in range(min(accepted + 1, checked)):  # drafts 1..accepted+1 were looked at
            self.accept[i] = self.decay * self.accept[i] + (1 - self.decay) * (i < accepted)

    def observe_time(self, n: int, seconds: float) -> None:
        window = self._times.setdefault(n, collections.deque(maxlen=self.TIME_WINDOW))
        window.append(seconds)
        self.step_s[n] = sorted(window)[len(window) // 2]


def new_draft_length(net) -> DraftLength:
    """A chooser for "auto" (`LLM` and the server keep one per model: what one run measured
    serves the next)."""
    return DraftLength()


class SpeculativeDecoder:
    """Runs `Sequence`s like `generate.run`, drafting with the MTP head and verifying in one pass.

    After `run` the trunk's `cache`, the head's `mtp_cache` and each row's pending (hidden
    state, next token) pairs not yet given to the head (`pend_h`, `pend_t`) are kept for
    inspection.
    """

    def __init__(self, net, dtype: torch.dtype, draft_tokens: int | str = 1, chooser: DraftLength | None = None,
                 kv_dtype: torch.dtype | None = None, prefetch: bool = True, draft_vocab: int | None = None):
        check_speculative(net, "mtp")
        self.net = net
        # drafts come from the LM head's first draft_vocab rows (`draft_head`); None: all of them
        self.draft_vocab = check_draft_vocab(net, draft_vocab)
        self.draft_head = draft_head(net.lm_head, self.draft_vocab) if self.draft_vocab is not None else None
        self.vocab = net.lm_head.out_features
        self.store = getattr(net, "expert_store", None)
        self.prefetcher = DraftPrefetch(net, self.store) if self.store is not None and prefetch else None
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.draft_tokens = check_draft_tokens(draft_tokens)
        self.chooser = None
        if self.draft_tokens == "auto":  # a chooser passed in keeps what earlier runs measured
            self.chooser = chooser if chooser is not None else new_draft_length(net)
        self.cache: Cache | None = None
        self.mtp_cache: Cache | None = None
        self.drafter = None  # the head's native calls made ready once for a run (`mtp_drafter`), for one row
        self.plans: dict = {}

    def _mtp(self, hidden, tokens, slots):
        """-> (the last position's logits [B, 1, V] and the head's final normed hidden state
        [B, 1, H]); every pair's keys and values are cached. One row goes through the run's
        `drafter` (calls of at most mtp.MAX_TOKENS pairs, in turn) where it takes the call."""
        if self.drafter is not None:
            pos, T = int(self._mtp_len[0]), hidden.shape[1]
            for t0 in range(0, T, MTP_CALL_TOKENS):
                got = self.drafter.run(hidden[:, t0 : t0 + MTP_CALL_TOKENS], tokens[:, t0 : t0 + MTP_CALL_TOKENS], pos + t0)
                if got is None:
                    break
                self._mtp_len[0] = pos + min(t0 + MTP_CALL_TOKENS, T)
            else:
                return got
            self._mtp_len[0] = pos
        return self.net.mtp_logits(hidden, tokens, self.mtp_cache, slots, return_hidden=True, head=self.draft_head,
                                   last_only=True)

    def run(self, seqs: list[Sequence], eos_ids: set[int], stats: SpeculativeStats | None = None) -> Iterator[tuple[int, str]]:
        stats = stats if stats is not None else SpeculativeStats()
        stats.draft_tokens, stats.draft_vocab, stats.prefetch = self.draft_tokens, self.draft_vocab, self.prefetcher is not None
        net = self.net
        B = len(seqs)
        n_max = MAX_DRAFT_TOKENS if self.draft_tokens == "auto" else self.draft_tokens
        # slack: a verification pass may write up to n_max positions past the last useful one
        max_len = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs) + n_max + 2
        self.cache = cache = Cache(net.cache_spec(), B, max_len, self.dtype, self.kv_dtype)
        self.mtp_cache = Cache(net.mtp_cache_spec(), B, max_len, self.dtype, self.kv_dtype)
        self.plans = run_plans(net, cache, range(1, B + 1), range(1, min(n_max, kernels.FUSED_MAX_TOKENS - 1) + 2))
        recurrent = [layer for layer in cache.layers if isinstance(layer, RecurrentState)]
        for layer in recurrent:  # verification passes leave every token's state here (keep_every)
            layer.positions = {}
        tracker = ExpertTracker(net)
        # per row: trunk hidden states not yet given to the MTP head, and the token after each
        # (the last of them: the sampled token the trunk has not run yet)
        self.pend_h = pend_h = [None] * B
        self.pend_t = pend_t = [[] for _ in range(B)]
        self._passes = collections.Counter()  # trunk passes per width (the first ones warm caches up)
        try:
            with torch.inference_mode():
                mtp_drafter = getattr(net, "mtp_drafter", None)
                self.drafter = mtp_drafter(self.mtp_cache, 0, self.draft_head) if B == 1 and mtp_drafter else None
                self._mtp_len, self._len = self.mtp_cache.lengths.numpy(), cache.lengths.numpy()
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
                self._feed_backlog(active, pend_h, pend_t, tracker)  # the head's prefill: the prompt's pairs
                stats.prefill_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                store0 = store_figures(self.store) if self.store is not None else None
                while active:
                    yield from self._step(seqs, active, pend_h, pend_t, eos_ids, stats, tracker, recurrent)
                    active = [b for b in active if not seqs[b].finished]
                stats.decode_s += time.perf_counter() - t0
                if store0 is not None:
                    moved, stall = store_figures(self.store)
                    stats.moved_expert_bytes += moved - store0[0]
                    stats.expert_stall_s += stall - store0[1]
        finally:
            spent = tracker.bytes
            stats.verify_expert_bytes += spent["verify"]
            stats.draft_expert_bytes += spent["draft"]
            tracker.close()
            stats.decode_path = decode_path(self.plans.get("plans"))

    def _feed(self, rows, pend_h, pend_t, keep: int = 0) -> tuple[list, list]:
        """Give the head each row's pending (hidden, next token) pairs but the last `keep`,
        rows with as many pairs together -> each row's logits [V] and normed hidden state
        [1, H] at its last pair fed (what the first draft comes from)."""
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(rows):
            c = pend_h[b].shape[0]
            self._mtp_len[b] = int(self._len[b]) - c  # the pairs' first position
            groups.setdefault(c - keep, []).append(i)
        logits_now: list = [None] * len(rows)
        h_last: list = [None] * len(rows)
        for c, members in groups.items():
            slots = torch.tensor([rows[i] for i in members])
            hidden = torch.stack([pend_h[rows[i]][:c] for i in members])
            tokens = long_ids([pend_t[rows[i]][:c] for i in members])
            logits, h = self._mtp(hidden, tokens, slots)
            for j, i in enumerate(members):
                logits_now[i], h_last[i] = logits[j, -1], h[j, -1:]
        return logits_now, h_last

    def _feed_backlog(self, active, pend_h, pend_t, tracker) -> None:
        """Before a drafting step: rows with more pending pairs than a drafting step leaves (a
        prompt's, or a run of plain steps') give the head all but their last, so that the
        step's own catch-up is one pair (and its time, which prices N, leaves the backlog out)."""
        rows = [b for b in active if pend_h[b].shape[0] > MAX_DRAFT_TOKENS + 1]
        if not rows:
            return
        tracker.start_pass("draft")
        self._feed(rows, pend_h, pend_t, keep=1)
        tracker.end_pass()
        for b in rows:
            pend_h[b], pend_t[b] = pend_h[b][-1:], pend_t[b][-1:]

    def _draft(self, seqs, active, slots, n, pend_h, pend_t, tracker):
        """n drafts per row and the distributions they were drawn from (None when greedy)."""
        tracker.start_pass("draft")
        logits_now, h_last = self._feed(active, pend_h, pend_t)
        drafts, qs = [[] for _ in active], [[] for _ in active]
        for d in range(n):
            for i, b in enumerate(active):
                s = seqs[b]
                if self.draft_vocab is not None:  # the penalty's tokens among the drafter's
                    history, extra = [t for t in s.prompt_ids + s.out_ids + drafts[i] if t < self.draft_vocab], []
                else:
                    history, extra = s.history(), drafts[i]
                if s.params.greedy:
                    tok, q = greedy_token(logits_now[i], history, s.params.repetition_penalty, extra), None
                else:
                    q = torch.empty(logits_now[i].shape[-1])
                    tok = draw(logits_now[i], s.params, history, s.uniforms, extra, probs=q)
                    if self.draft_vocab is not None:  # q over the whole vocabulary, for the rejection test
                        q = torch.nn.functional.pad(q, (0, self.vocab - self.draft_vocab))
                drafts[i].append(tok)
                qs[i].append(q)
            if self.prefetcher is not None:  # moved while the head drafts the next one
                self.prefetcher.tokens([dr[-1] for dr in drafts])
            if d + 1 < n:  # chained: the head's own output stands in for the trunk's hidden state
                logits, h = self._mtp(torch.stack(h_last), long_ids([[dr[-1]] for dr in drafts]), slots)
                logits_now, h_last = list(logits[:, -1]), list(h[:, -1:])
        tracker.end_pass()
        return drafts, qs

    def _step(self, seqs, active, pend_h, pend_t, eos_ids, stats, tracker, recurrent):
        net, cache, chooser = self.net, self.cache, self.chooser
        n = chooser.choose() if chooser is not None else self.draft_tokens
        slots = torch.tensor(active)
        if n > 0:
            self._feed_backlog(active, pend_h, pend_t, tracker)
        L = self._len[active].tolist()
        t0 = time.perf_counter()
        first = [pend_t[b][-1] for b in active]  # t_L, the sampled token the trunk runs first
        if n > 0:
            if self.prefetcher is not None:  # t_L: the first token of the verification pass
                self.prefetcher.tokens(first)
            drafts, qs = self._draft(seqs, active, slots, n, pend_h, pend_t, tracker)
        else:  # a plain step ("auto" only): the head catches up at the next drafting step
            drafts, qs = [[] for _ in active], [[] for _ in active]
        ids = long_ids([[t] + drafts[i] for i, t in enumerate(first)])
        if n > 0:  # (a one-token pass keeps no per-token states)
            for layer in recurrent:
                layer.positions.clear()
        tracker.start_pass("verify")
        try:
            logits, hidden = net(ids, cache, slots, return_hidden=True, **self.plans)  # [B, n+1, V], [B, n+1, H]
        finally:
            tracker.end_pass()
        if n > 0 and not all(layer.positions for layer in recurrent):
            raise MoerunError("speculative decoding cannot roll back this model's recurrent state (no per-token states)")
        stats.draft_hist[n] = stats.draft_hist.get(n, 0) + 1
        stats.verify_steps += 1
        stats.decode_steps += 1
        stats.single_token_expert_bytes = max(stats.single_token_expert_bytes, tracker.token_bytes)
        busy = time.perf_counter() - t0  # the step's own time, not the consumer's between yields
        rollback: dict[int, int] = {}  # row of the batch -> positions it keeps
        for i, b in enumerate(active):
            s = seqs[b]
            cap = min(n, s.params.max_tokens - len(s.out_ids))  # drafts worth checking
            tokens, k = self._accept(s, drafts[i][:cap], qs[i][:cap], logits[i])
            stats.drafted += cap
            stats.accepted += k
            stats.row_steps += 1
            if chooser is not None:
                chooser.update(cap, k)
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
            else:  # the head was not called: this pair joins the ones still pending
                pend_h[b] = torch.cat([pend_h[b], hidden[i, :1]])
                pend_t[b] = pend_t[b] + [tokens[-1]]
            if keep < n + 1:
                rollback[i] = keep
        t1 = time.perf_counter()
        for i, keep in rollback.items():  # recurrent states: the one after the last kept token
            for state in recurrent:
                state.roll_back(active[i], i, keep)
        self._passes[n] += 1
        if chooser is not None and self._passes[n] > 2:  # (a width's first passes: first use of its buffers)
            chooser.observe_time(n, busy + time.perf_counter() - t1)

    @staticmethod
    def _accept(s: Sequence, drafts: list[int], qs: list, logits: torch.Tensor) -> tuple[list[int], int]:
        """Check drafts against the trunk's logits [n+1, V]: (tokens to emit, drafts accepted)."""
        p_ = s.params
        n = len(drafts)
        if p_.greedy:  # the trunk's pick at each position (history ending with drafts[:j]), all at once
            picks = greedy_tokens(logits, s.history(), p_.repetition_penalty, drafts)
            for j, d in enumerate(drafts):
                if picks[j] != d:
                    return drafts[:j] + [picks[j]], j
            return drafts + [picks[n]], n
        out: list[int] = []
        for j, d in enumerate(drafts):
            p = distribution(logits[j], p_, s.history(), out)
            q = qs[j]
            u = s.uniforms.next()
            if q[d] > 0 and u * float(q[d]) < float(p[d]):
                out.append(d)
                continue
            # its replacement from norm(max(0, p - q)) with the row's next uniform
            return out + [residual_draw(p, q, s.uniforms.next())], j
        return out + [draw(logits[n], p_, s.history(), s.uniforms, out)], n


def run_speculative(net, seqs: list[Sequence], eos_ids: set[int], dtype: torch.dtype, stats: SpeculativeStats | None = None,
                    draft_tokens: int | str = 1, chooser: DraftLength | None = None,
                    kv_dtype: torch.dtype | None = None, prefetch: bool = True,
                    draft_vocab: int | None = None) -> Iterator[tuple[int, str]]:
    """`generate.run` with MTP drafting: yields (row, text piece) as tokens are accepted.
    prefetch: with an expert store, hint it with the drafts' experts (`DraftPrefetch`);
    draft_vocab: draft among the LM head's first rows only (`draft_head`)."""
    return SpeculativeDecoder(net, dtype, draft_tokens, chooser, kv_dtype, prefetch, draft_vocab).run(seqs, eos_ids, stats)
