"""The generate loop: prefill each prompt in one pass, then decode all live rows together."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from .. import kernels
from ..layers.stack import decode_path
from ..layers.cache import Cache
from ..models.driver import CausalLM
from .sampling import History, SamplingParams, Uniforms, sample


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_rows_started: int = 0  # rows whose first token came out of prefill
    # the run's first decode pass is its warm-up (first use of the cache and the thread pool:
    # several times a later pass); decode_s includes it, decode_tok_s does not
    warmup_s: float = 0.0
    warmup_tokens: int = 0  # tokens that came out of the warm-up pass (one per row in it)
    decode_path: dict | None = None  # how the run's decode passes ran (`layers.stack.decode_path`)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def timed_tokens(self) -> int:
        """The tokens decode_tok_s counts: neither a row's first (it comes out of prefill) nor
        the warm-up pass's."""
        return self.generated_tokens - self.decode_rows_started - self.warmup_tokens

    @property
    def decode_tok_s(self) -> float:
        s = self.decode_s - self.warmup_s
        return self.timed_tokens / s if s > 0 and self.timed_tokens > 0 else 0.0


@dataclass
class Sequence:
    """One prompt being continued: its tokens, its sampler, and its text so far."""

    prompt_ids: list[int]
    params: SamplingParams
    decoder: object | None = None  # IncrementalDecoder when text is wanted
    out_ids: list[int] = field(default_factory=list)
    text: str = ""
    pending: str = ""  # decoded text held back because it may start a stop string
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    _history: History | None = field(default=None, repr=False, compare=False)
    _uniforms: Uniforms | None = field(default=None, repr=False, compare=False)

    @property
    def uniforms(self) -> Uniforms:
        """The sampler's uniform numbers, from `generator` (`sampling.Uniforms`)."""
        if self._uniforms is None:
            self._uniforms = Uniforms(self.generator)
        return self._uniforms

    def history(self) -> History:
        """prompt_ids + out_ids as the repetition penalty reads them, kept from one token to
        the next (`sampling.History`)."""
        h, n = self._history, len(self.prompt_ids) + len(self.out_ids)
        if h is None or h.n > n:
            h = self._history = History(self.prompt_ids + self.out_ids)
        elif h.n < n:
            h.extend(self.out_ids[h.n - len(self.prompt_ids) :])
        return h

    def __post_init__(self):
        if not self.params.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed if self.params.seed is not None else torch.seed())

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int, eos_ids: set[int]) -> str:
        """Take a sampled token; return the text that may now be shown."""
        if token in eos_ids:
            self.finish_reason = "stop"
            piece, self.pending = self.pending, ""
            self.text += piece
            return piece
        self.out_ids.append(token)
        if self.decoder is not None:
            self.pending += self.decoder.push(token)
        piece = self._release()
        if not self.finished and len(self.out_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
            piece += self.pending
            self.text += self.pending
            self.pending = ""
        return piece

    def _release(self) -> str:
        stops = self.params.stop
        if not stops:
            piece, self.pending = self.pending, ""
            self.text += piece
            return piece
        window = self.text[-max(len(s) for s in stops) :] + self.pending
        cut = min((i for i in (window.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            keep = cut - (len(window) - len(self.pending))
            piece = self.pending[: max(keep, 0)]
            self.text += piece
            self.pending = ""
            self.finish_reason = "stop"
            return piece
        # hold back the longest tail of pending text that could still begin a stop string
        hold = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(window)), 0, -1):
                if window.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        hold = min(hold, len(self.pending))
        piece = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        self.text += piece
        return piece


def long_ids(rows: list[list[int]]) -> torch.Tensor:
    """Token ids [B, T] as a long tensor, through numpy (~2 us where torch.tensor takes ~8; a
    decode step makes one, a speculative step a few)."""
    return torch.from_numpy(np.array(rows, dtype=np.int64))


def run_plans(net, cache=None, widths=(), tokens=(1,)) -> dict:
    """Keyword arguments for the forwards of one generation run: its decode program, `plans`
    (a dict: the native stack of each pass shape, and how its decode passes ran,
    `layers.stack.decode_path`). Every model's forward takes one. Given the run's `cache`, the
    program is built now, before the run's first pass, for passes of each of `widths` rows of
    each of `tokens` tokens (`CausalLM.prepare`); a pass of another shape builds its own before
    it runs."""
    plans: dict = {}
    if cache is not None and isinstance(net, CausalLM):
        for T in tokens:
            net.prepare(cache, plans, [B for B in widths if B * T <= kernels.FUSED_MAX_ROWS or B == 1], T)
    return {"plans": plans}


def run(net, seqs: list[Sequence], eos_ids: set[int], dtype: torch.dtype, stats: GenerationStats | None = None,
        after_sample=None, kv_dtype: torch.dtype | None = None) -> Iterator[tuple[int, str]]:
    """Generate for every sequence; yields (row, text piece) as tokens are accepted.

    after_sample(hidden [B, 1, H], tokens [B, 1]), when given, is called after each step's
    sampling with the final normed hidden state that produced the tokens (an MTP-driven
    expert prefetcher uses it to predict the experts of the token after next). kv_dtype is
    the KV cache's storage (`Cache`; None: the model's dtype)."""
    stats = stats if stats is not None else GenerationStats()
    B = len(seqs)
    max_len = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs)
    cache = Cache(net.cache_spec(), B, max_len, dtype, kv_dtype)
    plans = run_plans(net, cache, range(1, B + 1))  # a batch's width falls as its rows finish
    try:
        yield from _decode(net, seqs, eos_ids, stats, after_sample, cache, plans)
    finally:
        stats.decode_path = decode_path(plans.get("plans"))


def _decode(net, seqs: list[Sequence], eos_ids: set[int], stats: GenerationStats, after_sample, cache: Cache,
            plans: dict) -> Iterator[tuple[int, str]]:
    """`run`'s prefill and decode loop on its cache and plans."""
    B = len(seqs)
    last = [None] * B
    hid = [None] * B

    def forward(ids, slots):
        if after_sample is None:
            return net(ids, cache, slots, last_only=True, **plans)[:, -1], None
        logits, hidden = net(ids, cache, slots, last_only=True, return_hidden=True, **plans)
        return logits[:, -1], hidden[:, -1:]
    with torch.inference_mode():
        t0 = time.perf_counter()
        for b, s in enumerate(seqs):
            ids = torch.tensor([s.prompt_ids], dtype=torch.long)
            logits, hidden = forward(ids, torch.tensor([b]))
            last[b], hid[b] = logits[0], hidden
            stats.prompt_tokens += len(s.prompt_ids)
        stats.prefill_s += time.perf_counter() - t0
        active = [b for b, s in enumerate(seqs) if s.params.max_tokens > 0]
        for b, s in enumerate(seqs):
            if s.params.max_tokens == 0:
                s.finish_reason = "length"
        stats.decode_rows_started += len(active)
        slots = torch.tensor(active)
        warm_up = True
        t0 = time.perf_counter()
        while active:
            tokens = []
            for b in active:
                s = seqs[b]
                tok = int(sample(last[b][None], s.params, [s.history()], s.uniforms)[0])
                tokens.append(tok)
                stats.generated_tokens += 1
                piece = s.accept(tok, eos_ids)
                if piece:
                    yield b, piece
            if after_sample is not None:
                after_sample(torch.cat([hid[b] for b in active]), torch.tensor(tokens)[:, None])
            still = [(b, t) for b, t in zip(active, tokens) if not seqs[b].finished]
            if not still:
                break
            if len(still) != len(active):
                active = [b for b, _ in still]
                slots = torch.tensor(active)
            # (the same slots tensor while the rows stay: it keeps what `Cache` learnt of it)
            ids = long_ids([[t] for _, t in still])
            logits, hidden = forward(ids, slots)
            stats.decode_steps += 1
            if warm_up:  # this run's first decode pass: timed apart
                warm_up = False
                stats.warmup_s += time.perf_counter() - t0
                stats.warmup_tokens += len(active)
            for i, b in enumerate(active):
                last[b] = logits[i]
                hid[b] = hidden[i : i + 1] if hidden is not None else None
        stats.decode_s += time.perf_counter() - t0
