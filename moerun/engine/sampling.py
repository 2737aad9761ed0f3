"""Choosing the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import kernels
from ..errors import MoerunError


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)
        checks = [
            (self.max_tokens >= 0, "max_tokens must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.seed is None or 0 <= self.seed < 2**64, "seed must be in [0, 2**64)"),  # torch.Generator's domain
        ]
        for ok, msg in checks:
            if not ok:
                raise MoerunError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class History:
    """A row's token ids as the repetition penalty reads them: an int64 array and a set,
    grown as tokens come (`Sequence.history`). The samplers ask at every token (a speculative
    step once per draft and per verified position), and turning a list of ~100 ids into an
    array, and scanning it for the pick, each time was most of a greedy pick's cost."""

    __slots__ = ("_ids", "n", "set")

    def __init__(self, ids=()):
        self._ids = np.empty(max(64, 2 * len(ids)), dtype=np.int64)
        self.n = 0
        self.set: set[int] = set()
        self.extend(ids)

    def extend(self, ids) -> None:
        k = len(ids)
        if self.n + k > len(self._ids):
            grown = np.empty(2 * (self.n + k), dtype=np.int64)
            grown[: self.n] = self._ids[: self.n]
            self._ids = grown
        self._ids[self.n : self.n + k] = ids
        self.n += k
        self.set.update(ids)

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self.n]

    def __len__(self) -> int:
        return self.n


def _id_array(history) -> np.ndarray:
    """A list of ids or a `History` as an int64 array."""
    return history.ids if isinstance(history, History) else np.asarray(history, dtype=np.int64)


def apply_repetition_penalty(logits: torch.Tensor, history: list, penalty: float) -> torch.Tensor:
    """CTRL-style: seen tokens' positive logits are divided by the penalty, negative multiplied.

    logits [B, V] float32; history: per row, a list of ids or a `History`. The arithmetic runs
    in numpy on the tensor's memory: a decode step calls this for every token checked (a
    speculative step for every draft, too), and a few numpy calls cost ~20 us where the same
    torch ops cost ~100 us. IEEE float32 division and multiplication round the same in both."""
    if penalty == 1.0:
        return logits
    out = logits.float().clone()
    x = out.numpy()
    for b, seen in enumerate(history):
        _penalize(x[b], seen, penalty)
    return out


def _penalize(rows: np.ndarray, seen, penalty: float) -> None:
    """The penalty on float32 rows [..., V], in place, for the ids in `seen` (a list or a
    `History`). A token seen twice is listed twice: both writes put the same value, computed
    from the rows before any of them."""
    if len(seen):
        idx = _id_array(seen)
        vals = rows[..., idx]
        p = np.float32(penalty)
        rows[..., idx] = np.where(vals > 0, vals / p, vals * p)


def greedy_token(logits: torch.Tensor | np.ndarray, history, penalty: float, extra: list[int] = ()) -> int:
    """One row's greedy pick: the first maximum of logits [V] (a float32 or bf16 tensor, or a
    float32 numpy row) after the repetition penalty over `history` (a list of ids or a
    `History`) followed by `extra` (the drafts so far), as `sample` picks it (same arithmetic)."""
    return greedy_tokens(logits[None], history, penalty, list(extra), extra_per_row=False)[0]


def greedy_tokens(rows: torch.Tensor | np.ndarray, history, penalty: float, extra: list[int],
                  extra_per_row: bool = True) -> list[int]:
    """greedy_token for each row j of rows [n+1, V] with the history followed by extra[:j]
    (a verification pass's positions; without `extra_per_row`, all of extra for every row),
    in one native call (`kernels.greedy_picks`: a dozen numpy calls each cost several times
    more inside a decode step than in a loop of their own), else `greedy_tokens_ref`."""
    seen = _id_array(history)
    picks = kernels.greedy_picks(rows, seen, extra, penalty, extra_per_row)
    if picks is not None:
        return picks
    return greedy_tokens_ref(rows if isinstance(rows, np.ndarray) else rows.float().numpy(), history, penalty,
                             extra, extra_per_row)


def greedy_tokens_ref(rows: np.ndarray, history, penalty: float, extra: list[int],
                      extra_per_row: bool = True) -> list[int]:
    """greedy_tokens in numpy (float32 rows): every first maximum at once, and one penalised
    copy of the rows at most. A penalty above 1 only lowers seen tokens, so where every
    row's own first maximum is unseen, those are the picks and nothing is copied."""
    tops = rows.argmax(-1).tolist()
    if penalty == 1.0 or not (len(history) or extra):
        return tops
    seen = history.set if isinstance(history, History) else set(history)
    # each id of extra not seen before is penalised from the row after its first place on
    first = {t: (i + 1 if extra_per_row else 0) for i, t in reversed(list(enumerate(extra))) if t not in seen}
    if penalty > 1.0 and all(t not in seen and first.get(t, len(rows)) > j for j, t in enumerate(tops)):
        return tops
    y = rows.copy()
    _penalize(y, history, penalty)
    for t, j in first.items():
        _penalize(y[j:], [t], penalty)
    return y.argmax(-1).tolist()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 -> [B] long, the first maximum (numpy's argmax: ~1 us where
    torch's takes ~12 on this machine's 4096-token rows)."""
    return torch.from_numpy(logits.numpy().argmax(-1))


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to fp32 logits [B, V]; removed tokens get -inf."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if p.min_p > 0:
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * p.min_p
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def candidate_probs(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sampler's distribution over penalised fp32 logits [B, V] after temperature, top-k,
    top-p and min-p, as `filter_logits(logits, p).softmax(-1)` gives it: (probs [B, k], their
    token ids [B, k]) with top-k, else (probs [B, V], None). With top-k only its k candidates
    are sorted, filtered, normalised and drawn from: on a 4096-token row the full-row sort,
    scatter, softmax and multinomial took ~0.5 ms of a ~3.5 ms demo-model decode step.
    `filter_logits` keeps every logit tied with the k-th too (common with bf16 logits), so
    the candidates are the largest m >= k, m the most any row keeps, and those of a row
    below its k-th get no probability."""
    V = logits.shape[-1]
    if not 0 < p.top_k < V:
        return filter_logits(logits, p).softmax(-1), None
    scaled = logits / p.temperature
    vals, ids = scaled.topk(p.top_k, dim=-1)  # largest first, as top-p sorts them
    kth = vals[:, -1:]
    m = int((scaled >= kth).sum(-1).max())
    if m > p.top_k:
        vals, ids = scaled.topk(m, dim=-1)
        vals = vals.masked_fill(vals < kth, float("-inf"))
    if p.top_p < 1.0:
        sm = vals.softmax(-1)
        vals = vals.masked_fill(sm.cumsum(-1) - sm >= p.top_p, float("-inf"))
    if p.min_p > 0:
        probs = vals.softmax(-1)
        vals = vals.masked_fill(probs < probs.max(-1, keepdim=True).values * p.min_p, float("-inf"))
    return vals.softmax(-1), ids


def full_probs(probs: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """candidate_probs' (probs, ids) as probabilities over the whole vocabulary [B, vocab]."""
    return probs if ids is None else torch.zeros(probs.shape[0], vocab).scatter_(-1, ids, probs)


def sample(logits: torch.Tensor, p: SamplingParams, history: list, generator) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]. history: per row, a list of ids or a `History`;
    generator: a torch.Generator, `Uniforms` or None."""
    if p.greedy:
        picks = [greedy_token(row, seen, p.repetition_penalty) for row, seen in zip(logits, history)]
    else:
        picks = [draw(row, p, seen, generator) for row, seen in zip(logits, history)]
    return torch.from_numpy(np.array(picks, dtype=np.int64))


class Uniforms:
    """u ~ U[0, 1) from a torch.Generator, drawn 64 at a time (`Sequence.uniforms`): one
    torch.rand call cost ~10-50 us inside a decode step, where a sampled token needs one
    number (a speculative step one per draft checked, too). The stream a seed gives is fixed."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator
        self._left: list[float] = []

    def next(self) -> float:
        if not self._left:
            self._left = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self._left.pop()


def uniform(generator: torch.Generator | Uniforms | None) -> float:
    return generator.next() if isinstance(generator, Uniforms) else float(torch.rand((), generator=generator))


def draw(logits: torch.Tensor, p: SamplingParams, history, generator: torch.Generator | Uniforms | None,
         extra: list[int] = (), probs: torch.Tensor | None = None) -> int:
    """One token sampled from a row of logits [V] with the history followed by `extra` (a
    list of ids or a `History`): u ~ U[0, 1) from the generator (or `Uniforms`), then the
    token whose cumulative probability first passes u, in the order of `candidate_probs`
    (inverse CDF). `probs` [V] float32, when given, gets the distribution. One native call
    (`kernels.sample_row`), else the torch reference (`draw_ref`)."""
    return _row(logits, p, history, extra, uniform(generator), probs)


def residual_draw(p: torch.Tensor, q: torch.Tensor, u: float) -> int:
    """Speculative sampling's replacement for a rejected draft: an id from norm(max(0, p - q))
    (p itself where that is all zero: q covers p, up to rounding) by inverse CDF with u in
    [0, 1), in id order, the cumulative sum in double precision. Natively where the
    extension runs (`kernels.residual_draw`, which a draft checked inside its pass uses too),
    else the same in numpy."""
    tok = kernels.residual_draw(p, q, u)
    if tok is not None:
        return tok
    w = np.maximum(p.numpy() - q.numpy(), np.float32(0)).astype(np.float64)
    if not w.sum() > 0:
        w = p.numpy().astype(np.float64)
    c = np.cumsum(w)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(np.flatnonzero(w)[-1]) if i >= len(w) else i


def distribution(logits: torch.Tensor, p: SamplingParams, history, extra: list[int] = ()) -> torch.Tensor:
    """The sampler's distribution over a row of logits [V] -> fp32 [V] (what `draw` draws from)."""
    probs = torch.empty(logits.shape[-1], dtype=torch.float32)
    _row(logits, p, history, extra, -1.0, probs)
    return probs


def _row(logits: torch.Tensor, p: SamplingParams, history, extra: list[int], u: float,
         probs: torch.Tensor | None) -> int:
    """`draw` (u >= 0) or `distribution` (u < 0, probs given) natively, else by `draw_ref`."""
    seen = _id_array(history)
    tok = kernels.sample_row(logits, seen, extra, p.repetition_penalty, p.temperature, p.top_k, p.top_p, p.min_p, u,
                             probs)
    return tok if tok is not None else draw_ref(logits, p, history, extra, u, probs)


def draw_ref(logits: torch.Tensor, p: SamplingParams, history, extra: list[int], u: float,
             probs: torch.Tensor | None = None) -> int:
    """`draw` in torch: the penalty, `candidate_probs`, and the first candidate whose
    cumulative probability passes u (-1 for u < 0)."""
    if extra:
        history = [*(history.ids.tolist() if isinstance(history, History) else history), *extra]
    cand, ids = candidate_probs(apply_repetition_penalty(logits.float()[None], [history], p.repetition_penalty), p)
    if probs is not None:
        probs.copy_(full_probs(cand, ids, logits.shape[-1])[0])
    if u < 0:
        return -1
    c = cand[0].cumsum(0)
    i = int(torch.searchsorted(c, u * c[-1], right=True))
    if i >= len(c):  # rounding: the last candidate with a probability
        i = int(cand[0].nonzero()[-1])
    return int(i if ids is None else ids[0, i])
