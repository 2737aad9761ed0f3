"""Expert predictors: which experts will a layer of this (or the next) token use?

Every predictor has one interface, fed the same events whether it replays a trace or runs
beside a live model:

    begin_token(info)              a new token's forward pass starts; `info` holds what the
                                   MTP head said about this token (`mtp_route` [L, E] scores,
                                   `mtp_hidden` [H]) when the trace or engine has it
    observe(layer, ids, ahead)     layer `layer` of this token routed to `ids`; `ahead` maps
                                   d -> router scores of layer+d applied to this layer's
                                   router input (the `layer_ahead` signal)
    predict(layer, budget)         `budget` expert ids for `layer` of this token, best first
    lead(layer)                    (tokens, layers): how early that prediction exists in a
                                   real decode: at the router of layer `layer - layers` of
                                   the token `tokens` steps back (layer -1 = token start)

A predictor only reads signals that exist at its lead (the replay checks nothing; each
class says what it reads). Predictions are rankings, so the prediction at budget b is the
first b of the one at a larger budget.

Predictors (names as `predict-eval` prints them):
    frequency       static prior: the most used experts of the layer in the fit part of the trace
    temporal        most recently used experts of the layer (budget K = the previous token's set)
    layer_ahead1/2  router of layer l+d applied to the hidden state entering layer l's router
                    (approximation: layer l's router input, already normed by layer l's norm,
                    stands in for layer l+d's)
    mtp             the MTP head's top-C candidates for the next token, each candidate's input
                    embedding through every layer's router (profile.mtp_route_scores)
    mtp_learned     per-layer linear probes (ridge least squares) from the MTP head's hidden
                    state to the next token's experts, fitted on the fit part of the trace
    combined        mtp_learned for layer 0 (lead: one token), then layer_ahead1's router
                    probabilities plus `mix` x the probe's normalised scores (lead: one layer);
                    `mix` in {0, 0.1, 0.3} is chosen on the fit part of the trace
    token           the token being decoded is known when its forward pass starts: its input
                    embedding through every layer's router (the same approximation as `mtp`,
                    with the right token but only a token-start lead)
    token_ahead     `token` for layer 0, then layer_ahead1 (lead: one layer)
    lookahead       layer_ahead1 and layer_ahead2 at once: at layer l's router, layer l+1 from
                    router l+1 and layer l+2 from router l+2 (the nearer signal replaces the
                    farther one as it comes); layers 0 and 1 of the next token from this token's
                    choice (temporal). Scored here as layer_ahead1 is (its lead: one layer); the
                    prefetcher (PrefetchDriver) issues both depths, l+2 at a lower priority;
                    `lookaheadD` (live prefetch only) takes depths 1..D
    lookahead_mtp   live prefetch only: `lookahead`, but layer 0 of the next token from the MTP
                    head's draft (PrefetchDriver.mtp_draft, called after each sampled token:
                    the head drafts the token after it, whose input embedding, normed by layer
                    0's post-attention norm, goes through layer 0's router; approximate: the
                    embedding stands in for the residual after layer 0's attention/DeltaNet
                    half, which needs the state the next token leaves). Layer 1 stays this
                    token's choice (its router input needs layer 0's experts on the draft)
    mtp_oracle      diagnostic, not a prefetcher: `mtp` with a perfect candidate list (the
                    `token` scores, credited with mtp's one-token lead)
Where a predictor has no signal (first tokens, first layers) it falls back to `temporal`,
then to the frequency prior.
"""

from __future__ import annotations

import re
import time

import numpy as np

from ..errors import MoerunError
from ..layers.routes import observe_routes
from .profile import Trace, moe_blocks, mtp_route_scores

# N tokens, L MoE layers, K experts per token, E experts, H hidden

NAMES = ("frequency", "temporal", "layer_ahead1", "layer_ahead2", "token", "mtp", "mtp_learned", "combined",
         "token_ahead", "lookahead", "mtp_oracle")
PREFETCHERS = NAMES[:-1]  # mtp_oracle reads the true next token a token early: a diagnostic, not a prefetcher
LIVE_ONLY = ("lookahead_mtp",)  # prefetchers driven by a live model only (no trace replay)
FACTORS = (1.0, 1.5, 2.0)


class Predictor:
    name = "base"

    def __init__(self, num_layers: int, num_experts: int, prior: np.ndarray | None = None):
        self.L, self.E = num_layers, num_experts
        prior = np.zeros((num_layers, num_experts)) if prior is None else np.asarray(prior, dtype=np.float64)
        # ties (and missing signals) are broken by the prior, then by expert index
        self._tiebreak = prior / (prior.max(axis=1, keepdims=True) + 1.0) * 1e-6
        self.prior = prior
        self.reset()

    def reset(self) -> None:
        self.last_used = np.full((self.L, self.E), -1.0)
        self.tick = 0

    def begin_token(self, info: dict | None = None) -> None:
        self.tick += 1

    def observe(self, layer: int, ids, ahead: dict | None = None) -> None:
        self.last_used[layer, np.asarray(ids, dtype=np.int64)] = self.tick

    def scores(self, layer: int) -> np.ndarray | None:
        return None

    def fallback(self, layer: int) -> np.ndarray:
        return self.last_used[layer]  # temporal; the tiebreak adds the prior

    def predict(self, layer: int, budget: int) -> np.ndarray:
        s = self.scores(layer)
        if s is None:
            s = self.fallback(layer)
        s = np.asarray(s, dtype=np.float64) + self._tiebreak[layer]
        budget = min(int(budget), self.E)
        if budget >= self.E:
            return np.argsort(-s, kind="stable")
        top = np.argpartition(-s, budget - 1)[:budget]
        return top[np.argsort(-s[top], kind="stable")]

    def lead(self, layer: int) -> tuple[int, int]:
        return (1, 0)  # temporal: right after the previous token's router at this layer


class Frequency(Predictor):
    name = "frequency"

    def scores(self, layer):
        return self.prior[layer]

    def lead(self, layer):
        return (0, layer + 1)  # static: known before the run; counted as "at token start"


class Temporal(Predictor):
    name = "temporal"


class LayerAhead(Predictor):
    """Reads `ahead[d]` passed with layer l-d's observation of the same token."""

    def __init__(self, num_layers, num_experts, prior=None, d: int = 1):
        self.d = d
        self.name = f"layer_ahead{d}"
        super().__init__(num_layers, num_experts, prior)

    def reset(self):
        super().reset()
        self.cur: dict[int, np.ndarray] = {}

    def begin_token(self, info=None):
        super().begin_token(info)
        self.cur = {}

    def observe(self, layer, ids, ahead=None):
        super().observe(layer, ids, ahead)
        if ahead is not None and self.d in ahead and layer + self.d < self.L:
            self.cur[layer + self.d] = ahead[self.d]

    def scores(self, layer):
        return self.cur.get(layer)

    def lead(self, layer):
        return (0, self.d) if layer >= self.d else (1, 0)


class Lookahead(LayerAhead):
    """layer_ahead d for every d in `depths` at once (`ahead[d]` from layer l-d's observation)."""

    def __init__(self, num_layers, num_experts, prior=None, depths=(1, 2)):
        self.depths = tuple(sorted(depths))
        super().__init__(num_layers, num_experts, prior, d=self.depths[-1])
        self.name = "lookahead"

    def observe(self, layer, ids, ahead=None):
        Predictor.observe(self, layer, ids, ahead)
        for d in self.depths:
            if ahead is not None and d in ahead and layer + d < self.L:
                self.cur[layer + d] = ahead[d]  # layer+1's from d=1 replaces what d=2 said a layer before

    def lead(self, layer):
        return (0, 1) if layer >= 1 else (1, 0)

    def next_token(self, layer: int, budget: int) -> np.ndarray:
        """The next token's experts for `layer`, best first: this token's (temporal), then the prior."""
        s = self.last_used[layer] + self._tiebreak[layer]
        budget = min(int(budget), self.E)
        top = np.argpartition(-s, budget - 1)[:budget]
        return top[np.argsort(-s[top], kind="stable")]


class LookaheadMTP(Lookahead):
    """`lookahead`, with layer 0 of the next token from the MTP head's draft (see the module's
    docstring): `next_token(0, budget, draft)` ranks by `draft`, the drafted token's layer-0
    router scores, where the driver has them; every other layer, and layer 0 without a draft,
    as `lookahead` (this token's choice)."""

    uses_draft = True

    def __init__(self, num_layers, num_experts, prior=None, depths=(1, 2)):
        super().__init__(num_layers, num_experts, prior, depths)
        self.name = "lookahead_mtp"

    def next_token(self, layer: int, budget: int, draft: np.ndarray | None = None) -> np.ndarray:
        if layer != 0 or draft is None:
            return super().next_token(layer, budget)
        s = np.asarray(draft, dtype=np.float64)
        budget = min(int(budget), self.E)
        top = np.argpartition(-s, budget - 1)[:budget]
        return top[np.argsort(-s[top], kind="stable")]


class MTP(Predictor):
    """Reads `info["mtp_route"]` (made by the MTP head one token earlier)."""

    name = "mtp"
    key = "mtp_route"

    def begin_token(self, info=None):
        super().begin_token(info)
        r = (info or {}).get(self.key)
        self.route = None if r is None else np.asarray(r, dtype=np.float64)

    def reset(self):
        super().reset()
        self.route = None

    def scores(self, layer):
        return None if self.route is None else self.route[layer]

    def lead(self, layer):
        return (1, layer + 1)  # the head runs once token n-1 is sampled, before its forward pass


class MTPOracle(MTP):
    name = "mtp_oracle"
    key = "token_route"


class Token(MTP):
    """Reads `info["token_route"]`: the current token's embedding through the routers."""

    name = "token"
    key = "token_route"

    def lead(self, layer):
        return (0, layer + 1)  # at the start of this token's own forward pass


class TokenAhead(LayerAhead):
    """`token` for the first d layers, layer_ahead(d) after."""

    def __init__(self, num_layers, num_experts, prior=None, d: int = 1):
        self.tok = Token(num_layers, num_experts, prior)
        super().__init__(num_layers, num_experts, prior, d)
        self.name = "token_ahead"

    def begin_token(self, info=None):
        super().begin_token(info)
        self.tok.begin_token(info)

    def scores(self, layer):
        a = self.cur.get(layer)
        return self.tok.scores(layer) if a is None else a

    def lead(self, layer):
        return (0, self.d) if layer >= self.d else (0, layer + 1)


class MTPLearned(Predictor):
    """Per-layer linear probes W [L, H+1, E] from the MTP head's hidden state."""

    name = "mtp_learned"

    def __init__(self, num_layers, num_experts, prior=None, probes: np.ndarray | None = None):
        super().__init__(num_layers, num_experts, prior)
        self.W = probes

    def reset(self):
        super().reset()
        self.z = None

    def begin_token(self, info=None):
        super().begin_token(info)
        h = (info or {}).get("mtp_hidden")
        if h is None or self.W is None:
            self.z = None
        else:
            x = np.append(np.asarray(h, dtype=np.float32), np.float32(1.0))
            self.z = np.einsum("h,lhe->le", x, self.W)  # [L, E]

    def scores(self, layer):
        return None if self.z is None else self.z[layer]

    def lead(self, layer):
        return (1, layer + 1)


class Combined(LayerAhead):
    """mtp_learned for the first d layers; then layer_ahead(d) plus half the probe's scores."""

    def __init__(self, num_layers, num_experts, prior=None, probes=None, d: int = 1, mix: float = 0.5):
        self.probe = MTPLearned(num_layers, num_experts, prior, probes)
        self.mix = mix
        super().__init__(num_layers, num_experts, prior, d)
        self.name = "combined"

    def begin_token(self, info=None):
        super().begin_token(info)
        self.probe.begin_token(info)

    def scores(self, layer):
        m = self.probe.scores(layer)
        a = self.cur.get(layer)
        if a is None:
            return m
        p = np.exp(a - a.max())
        p /= p.sum()
        if m is None:
            return p
        q = np.clip(m, 0, None)
        return p + self.mix * q / max(q.sum(), 1e-9)

    def lead(self, layer):
        return (0, self.d) if layer >= self.d else (1, layer + 1)


# -- fitting -----------------------------------------------------------------------------------


def fit_probes(trace, ridge: float = 1e-2) -> np.ndarray | None:
    """Least-squares probes from `mtp_hidden` [N, H] to the multi-hot experts of each layer;
    returns W [L, H+1, E] (None when the trace has no MTP hidden states)."""
    if trace.mtp_hidden is None:
        return None
    v = trace.mtp_valid.astype(bool)
    if v.sum() < 2:
        return None
    X = trace.mtp_hidden[v].astype(np.float64)
    X = np.concatenate([X, np.ones((X.shape[0], 1))], axis=1)  # [N, H+1]
    L, E = trace.num_layers, trace.num_experts
    Y = np.zeros((X.shape[0], L, E))
    ids = trace.ids[v].astype(np.int64)  # [N, L, K]
    n_idx = np.arange(X.shape[0])[:, None, None]
    l_idx = np.arange(L)[None, :, None]
    Y[n_idx, l_idx, ids] = 1.0
    A = X.T @ X
    A += ridge * np.trace(A) / A.shape[0] * np.eye(A.shape[0])
    W = np.linalg.solve(A, X.T @ Y.reshape(X.shape[0], L * E))  # [H+1, L*E]
    return W.reshape(-1, L, E).transpose(1, 0, 2).astype(np.float32)


def check_name(name: str) -> None:
    """Refuse a predictor name that is none of NAMES (layer_aheadD takes any depth D >= 1)."""
    if name not in NAMES and name not in LIVE_ONLY and not re.fullmatch(r"(layer_ahead|lookahead)[1-9][0-9]*", name):
        raise MoerunError(f"unknown predictor {name!r}; choose one of {', '.join(NAMES + LIVE_ONLY)}")


def make_predictors(fit, names=NAMES) -> dict[str, Predictor]:
    """Predictors fitted on the trace `fit` (the frequency prior, the probes)."""
    L, E = fit.num_layers, fit.num_experts
    prior = fit.counts().astype(np.float64)
    probes = fit_probes(fit) if any(n in ("mtp_learned", "combined") for n in names) else None
    out = {}
    for n in names:
        check_name(n)
        if n == "frequency":
            out[n] = Frequency(L, E, prior)
        elif n == "temporal":
            out[n] = Temporal(L, E, prior)
        elif n.startswith("layer_ahead"):
            d = int(n[len("layer_ahead"):] or 1)
            if fit.ahead is None or d > fit.ahead.shape[0]:
                continue
            out[n] = LayerAhead(L, E, prior, d)
        elif n in LIVE_ONLY:  # driven by a live model's MTP head: nothing in a trace to replay
            continue
        elif n.startswith("lookahead"):
            if fit.ahead is None:
                continue
            D = int(n[len("lookahead"):] or 2)
            out[n] = Lookahead(L, E, prior, depths=tuple(range(1, min(D, fit.ahead.shape[0]) + 1)))
        elif n == "mtp":
            if fit.mtp_route is None:
                continue
            out[n] = MTP(L, E, prior)
        elif n == "mtp_learned":
            if probes is None:
                continue
            out[n] = MTPLearned(L, E, prior, probes)
        elif n == "combined":
            if probes is None or fit.ahead is None:
                continue
            best = None
            for mix in (0.0, 0.1, 0.3):  # the probe's weight, chosen on the fit part
                c = Combined(L, E, prior, probes, mix=mix)
                r = score(fit, replay(fit, c, fit.top_k)[0], fit.top_k)["recall"]
                if best is None or r > best[0]:
                    best = (r, c)
            out[n] = best[1]
        elif n in ("mtp_oracle", "token"):
            if fit.token_route is None:
                continue
            out[n] = (MTPOracle if n == "mtp_oracle" else Token)(L, E, prior)
        elif n == "token_ahead":
            if fit.token_route is None or fit.ahead is None:
                continue
            out[n] = TokenAhead(L, E, prior)
    return out


# -- replay and scoring ---------------------------------------------------------------------------


def replay(trace, pred: Predictor, budget: int) -> tuple[np.ndarray, float]:
    """Run `pred` over the trace in decode order; returns (predictions int16 [N, L, budget],
    the predictor's own time per token in µs)."""
    N, L = trace.num_tokens, trace.num_layers
    D = trace.ahead.shape[0] if trace.ahead is not None else 0
    out = np.zeros((N, L, budget), dtype=np.int16)
    ids = trace.ids
    pred.reset()
    mv = trace.mtp_valid
    t_pred = 0.0
    for n in range(N):
        info = {}
        if mv is not None and mv[n]:
            if trace.mtp_route is not None:
                info["mtp_route"] = trace.mtp_route[n]
            if trace.mtp_hidden is not None:
                info["mtp_hidden"] = trace.mtp_hidden[n]
        if trace.token_route is not None:
            info["token_route"] = trace.token_route[n]
        ahead_n = [trace.ahead[d, n].astype(np.float64) for d in range(D)] if D else None
        t0 = time.perf_counter()
        pred.begin_token(info)
        for l in range(L):
            out[n, l] = pred.predict(l, budget)
            pred.observe(l, ids[n, l], {d + 1: ahead_n[d][l] for d in range(D)} if D else None)
        t_pred += time.perf_counter() - t0
    return out, t_pred * 1e6 / max(N, 1)


def score(trace, predictions: np.ndarray, budget: int) -> dict:
    """Recall (share of used experts that were predicted) and precision (share of predicted
    experts that were used) at `budget` (the first `budget` of each ranking)."""
    p = predictions[:, :, :budget].astype(np.int64)
    t = trace.ids.astype(np.int64)
    hit = (p[..., :, None] == t[..., None, :]).any(-1)  # [N, L, budget]: predicted and used
    by_layer = hit.sum(axis=(0, 2)) / (t.shape[0] * t.shape[2])
    n = hit.sum()
    return {"recall": float(n / t.size), "precision": float(n / p.size),
            "recall_by_layer": [round(float(x), 4) for x in by_layer]}


def model_cost_us(trace, name: str) -> float:
    """Model-side work a predictor needs per token, as timed while profiling (router
    matmuls for layer_ahead; the MTP head and candidate routing for mtp)."""
    t = trace.meta.get("timing_us_per_token", {})
    D = max(int(trace.meta.get("ahead", 1)), 1)
    if name.startswith("layer_ahead"):
        return t.get("ahead_us", 0.0) / D
    if name == "lookahead":
        return t.get("ahead_us", 0.0) * min(D, 2) / D
    if name in ("mtp", "mtp_oracle"):
        return t.get("mtp_head_us", 0.0) + t.get("mtp_route_us", 0.0)
    if name == "token":
        return t.get("mtp_route_us", 0.0) / max(int(trace.meta.get("mtp_candidates", 1)), 1)
    if name == "token_ahead":
        return t.get("mtp_route_us", 0.0) / max(int(trace.meta.get("mtp_candidates", 1)), 1) + t.get("ahead_us", 0.0) / D
    if name == "mtp_learned":
        return t.get("mtp_head_us", 0.0)
    if name == "combined":
        return t.get("mtp_head_us", 0.0) + t.get("ahead_us", 0.0) / D
    return 0.0


def evaluate(trace, names=NAMES, factors=FACTORS, fit_fraction: float = 0.5, return_predictions: bool = False):
    """Fit on the first sequences of the trace, score on the rest.

    Returns {predictor: {"1.0": {recall, precision, lead_layers, lead_tokens, cost_us}, ...}}
    (and, with return_predictions, {predictor: int16 [N_eval, L, max budget]} and the eval
    trace). lead_layers: how many layers before its use a prediction exists, averaged over
    layers (one token = L layers; null for the static frequency prior). cost_us: the
    predictor's replay time per token (this Python implementation) plus the model-side work
    timed at profiling (`model_cost_us`: router matmuls, the MTP head); recall_by_layer: [L]."""
    if trace.num_tokens < 4:
        raise MoerunError("the trace is too short to fit and evaluate predictors (needs 4+ tokens)")
    fit, ev = trace.split(fit_fraction)
    preds = make_predictors(fit, names)
    K, L = trace.top_k, trace.num_layers
    budgets = {f: max(1, min(int(round(f * K)), trace.num_experts)) for f in factors}
    bmax = max(budgets.values())
    results, all_preds = {}, {}
    for name, p in preds.items():
        out, own_us = replay(ev, p, bmax)
        all_preds[name] = out
        leads = [p.lead(l) for l in range(L)]
        lead_layers = None if name == "frequency" else float(np.mean([t * L + d for t, d in leads]))
        lead_tokens = float(np.mean([t for t, _ in leads]))
        model_us = model_cost_us(trace, name)
        results[name] = {
            f"{f:.1f}": {**score(ev, out, b), "budget": b, "lead_layers": lead_layers, "lead_tokens": lead_tokens,
                         "cost_us": round(own_us + model_us, 2), "model_cost_us": round(model_us, 2)}
            for f, b in budgets.items()
        }
    if return_predictions:
        return results, all_preds, ev, preds
    return results


def predict_eval(trace: str, as_json: bool = False, predictors: str | None = None, fit_fraction: float = 0.5) -> dict:
    """`moerun predict-eval TRACE [--json] [--predictors a,b] [--fit-fraction F]`: prints
    the JSON object, or a table; returns the dict."""
    import json


    tr = Trace.load(trace)
    names = tuple(n.strip() for n in predictors.split(",")) if predictors else NAMES
    res = evaluate(tr, names, fit_fraction=fit_fraction)
    if as_json:
        print(json.dumps(res, indent=1))
    else:
        print(format_table(res, tr))
    return res


def format_table(res: dict, trace=None) -> str:
    head = "predictor      budget  recall  precision  lead(layers)  cost(µs/token)"
    lines = []
    if trace is not None:
        lines.append(f"{trace.num_tokens} tokens, {trace.num_layers} MoE layers, {trace.num_experts} experts, "
                     f"top-{trace.top_k}; fitted on the first half of the sequences, scored on the rest")
    lines.append(head)
    for name, per in res.items():
        for f, r in per.items():
            lead = "static" if r["lead_layers"] is None else f"{r['lead_layers']:.1f}"
            lines.append(f"{name:<14} {f}x={r['budget']:<3} {r['recall']:6.3f}  {r['precision']:9.3f}  {lead:>12}  "
                         f"{r['cost_us']:14.1f}")
    return "\n".join(lines)


# -- driving the expert store's prefetcher -----------------------------------------------------------


class PrefetchDriver:
    """Feeds a predictor from a live model and turns its predictions into
    `ExpertStore.prefetch` hints.

    It watches the token embedding (a forward hook: the `token` signal, the input token's
    embedding through every router) and each trunk MoE block's routing (a route observer,
    `layers.routes.observe_routes`, which keeps passes on the native path: the routing, and
    the router's input for the `layer_ahead` signal). At a pass's start it hints the layers whose prediction
    exists at token start; after the routing of layer l, those whose prediction exists at
    that moment (per `lead`); after the last layer, `temporal`'s hints for the next token.
    MTP-based predictors need the engine to call `mtp_step(hidden, next_ids)` (or
    `on_mtp(info)`) once the next token is sampled; they then hint the layers of the token
    after it. Batched decode: the last row's routing is what is observed.
    """

    def __init__(self, net, store, predictor: Predictor, factor: float = 1.5):
        import torch


        self.net, self.store, self.pred = net, store, predictor
        self.blocks = moe_blocks(net)
        self.L = len(self.blocks)
        top_k = getattr(getattr(net, "args", None), "num_experts_per_tok", 1)
        self.top_k = top_k
        self.budget = max(1, int(round(factor * top_k)))
        self.D = getattr(predictor, "d", 0)
        # lookahead: every depth hinted at each layer (l+1 at `budget`, farther ones at no more than
        # top_k and a lower priority), held until the layer's own demand misses are in; a prompt's pass
        # hints the union of its rows' predictions for l+1 (each layer's experts read once)
        self.depths = getattr(predictor, "depths", None)
        self.wants_token = isinstance(predictor, (Token, TokenAhead))
        self.name = getattr(predictor, "name", None)
        # lookahead_mtp: the next token's layer 0 from the MTP head's draft (`mtp_draft`)
        self.uses_draft = bool(getattr(predictor, "uses_draft", False))
        self._draft: dict[int, tuple] = {}  # pass number -> (its drafted input token, layer-0 router scores)
        self._pred0: dict[int, dict] = {}  # pass number -> its layer-0 hints by source ("last", "draft"; "token": the ceiling)
        self._mtp_cache = None
        self.layer0 = {"passes": 0, "drafts": 0, "drafts_scored": 0, "drafts_right": 0, "draft_s": 0.0,
                       **{f"{src}_{k}": 0 for src in ("last", "draft", "token") for k in ("actual", "hinted", "hits")}}
        self._handles = []
        self._torch = torch
        self._begun = False
        self._in_mtp = False
        self.passes = 0  # forward passes started (decode steps)
        self.mtp_info: dict[int, dict] = {}  # pass number -> what the MTP head said about its token
        self.layer_ids = [getattr(getattr(b, "experts", None), "layer", i) for i, (_, b) in enumerate(self.blocks)]
        if self.wants_token:
            self._handles.append(net.model.embed_tokens.register_forward_hook(self._embed_hook))
        for i, (_, blk) in enumerate(self.blocks):
            self._handles.append(observe_routes(blk.experts, self._observer(i)))

    def on_mtp(self, info: dict) -> None:
        """The MTP head's view of the token after the one just sampled (`mtp_route` [L, E],
        `mtp_hidden` [H]); called between passes. Hints that token's layers at once; the
        predictor reads `info` again when that token's pass starts (two passes on)."""
        target = self.passes + 2
        self.mtp_info = {target: info}
        tick = self.pred.tick
        self.pred.begin_token(info)  # mtp predictors read only `info` for that token
        for l in range(self.L):
            if self.pred.lead(l)[0] >= 1 and self.pred.scores(l) is not None:
                self._hint(l, step=self.store.step + 2)
        self.pred.tick = tick

    def mtp_step(self, hidden, next_ids, cache=None, slots=None, candidates: int = 8) -> None:
        """For the engine, after sampling: run the MTP head on the last position's final normed
        hidden state (hidden [B, T, H]) and the token just sampled (next_ids [B, T]), turn its
        top-`candidates` into `mtp_route` (profile.mtp_route_scores) and call `on_mtp`. Without
        the head's own `cache` its attention sees only this position (an approximation)."""

        torch = self._torch
        captured = {}
        hk = self.net.mtp.norm.register_forward_hook(lambda m, a, o: captured.__setitem__("h", o))
        self._in_mtp = True
        try:
            with torch.inference_mode():
                lg = self.net.mtp_logits(hidden[-1:, -1:], next_ids[-1:, -1:], cache, slots)[0, -1].float()
                pr, cd = lg.softmax(-1).topk(candidates)
                route = mtp_route_scores(self.net, self.blocks, cd[None], pr[None])[0].numpy()
        finally:
            hk.remove()
            self._in_mtp = False
        self.on_mtp({"mtp_route": route, "mtp_hidden": captured["h"][0, -1].float().numpy()})

    def mtp_draft(self, hidden, next_ids, cache_len: int = 4096) -> None:
        """For the engine, after sampling (a `lookahead_mtp` predictor): the MTP head on the last
        row's final normed hidden state (hidden [B, T, H]) and the token just sampled
        (next_ids [B, T]) drafts the token after it; that token's layer-0 router scores are
        kept for the pass it will be the input of (two passes on), whose layer 0 the last
        layer of the next pass hints from them instead of from this token's choice.

        The draft's router input is its embedding normed by layer 0's post-attention norm
        (approximate: layer 0's attention/DeltaNet half is skipped). The head keeps a KV
        cache of its own over the calls (reset every `cache_len` calls), which sees only the
        decoded positions, not the prompt's."""
        from ..layers.cache import Cache

        torch = self._torch
        t0 = time.perf_counter()
        h, tok = hidden[-1:, -1:], next_ids[-1:, -1:]
        with torch.inference_mode():
            if self._mtp_cache is None or int(self._mtp_cache.lengths[0]) >= cache_len:
                self._mtp_cache = Cache(self.net.mtp_cache_spec(), 1, cache_len, h.dtype)
            self._in_mtp = True
            try:
                lg = self.net.mtp_logits(h, tok, self._mtp_cache, torch.zeros(1, dtype=torch.long))
            finally:
                self._in_mtp = False
            d = int(lg[0, -1].argmax())
            scores = self.router0_scores(d)
        c = self.layer0
        p = self._pred0.get(self.passes + 1)
        if p is not None:  # the ceiling of the draft's approximation: the right token through the same route
            p["token"] = [int(e) for e in self.pred.next_token(0, len(p["last"]), self.router0_scores(int(tok.reshape(-1)[0])))]
        prev = self._draft.get(self.passes + 1)  # the draft made a pass ago, for the token just sampled
        if prev is not None:
            c["drafts_scored"] += 1
            c["drafts_right"] += int(prev[0] == int(tok.reshape(-1)[0]))
        self._draft = {k: v for k, v in self._draft.items() if k > self.passes}
        self._draft[self.passes + 2] = (d, scores)
        c["drafts"] += 1
        c["draft_s"] += time.perf_counter() - t0

    def router0_scores(self, token: int) -> np.ndarray:
        """Layer 0's router logits [E] for `token`: its input embedding normed by layer 0's
        post-attention norm (the input of layer 0's attention half stands in for its output)."""
        torch = self._torch
        name, blk = self.blocks[0]
        layer = self.net.get_submodule(name.rsplit(".mlp", 1)[0]) if ".mlp" in name else None
        norm = getattr(layer, "post_attention_layernorm", None)
        with torch.inference_mode():
            emb = self.net.model.embed_tokens(torch.tensor([[token]]))
            u = norm(emb) if norm is not None else emb
            g = blk.gate
            return torch.nn.functional.linear(u.reshape(1, -1).to(g.weight.dtype), g.weight).float()[0].numpy()

    def layer0_stats(self) -> dict:
        """How well the next token's layer-0 hints named its experts, per source: `last` (this
        token's choice), `draft` (the MTP draft's router scores) and `token` (not a hint: the
        right token through the draft's approximate route, once it is sampled; the ceiling of a
        perfect draft), each as precision (hints the layer then used / hints) and recall (its
        experts hinted / its experts), over the decode passes that had them; and the drafts'
        token accuracy and the head's time per call."""
        c = dict(self.layer0)
        for src in ("last", "draft", "token"):
            c[f"{src}_precision"] = c[f"{src}_hits"] / c[f"{src}_hinted"] if c[f"{src}_hinted"] else None
            c[f"{src}_recall"] = c[f"{src}_hits"] / c[f"{src}_actual"] if c[f"{src}_actual"] else None
        c["draft_accuracy"] = c["drafts_right"] / c["drafts_scored"] if c["drafts_scored"] else None
        c["draft_ms"] = 1e3 * c["draft_s"] / c["drafts"] if c["drafts"] else None
        return c

    def reset_layer0_stats(self) -> None:
        for k in self.layer0:
            self.layer0[k] = 0.0 if k == "draft_s" else 0

    def _score_layer0(self, ids) -> None:
        """This pass's layer 0 routed to `ids`: score the hints made for it a pass ago."""
        p = self._pred0.pop(self.passes, None)
        self._pred0 = {k: v for k, v in self._pred0.items() if k > self.passes}
        if p is None:
            return
        got = {int(e) for e in ids}
        c = self.layer0
        c["passes"] += 1
        for src, hinted in p.items():
            c[f"{src}_actual"] += len(got)
            c[f"{src}_hinted"] += len(hinted)
            c[f"{src}_hits"] += len(got & set(hinted))

    def _start(self, info):
        self._begun = True
        self.passes += 1
        info = dict(self.mtp_info.pop(self.passes, None) or {}, **(info or {}))
        self.pred.begin_token(info)
        for l in range(self.L):
            if self.pred.lead(l) == (0, l + 1):
                self._hint(l, step=self.store.step + 1)

    def _embed_hook(self, mod, args, out):

        if self._in_mtp:
            return
        emb = out[-1:, -1:]  # [1, 1, H]: the last row's last token
        with self._torch.inference_mode():
            r = mtp_route_scores(self.net, self.blocks, None, self._torch.ones(1, 1), emb=emb)[0].float().numpy()
        self._start({"token_route": r})

    def _observer(self, i):
        def observe(h, ids, weights):
            if self.depths:
                return self._observe_multi(i, h, ids)
            ids = ids[-1:]  # prefill or a batch: observe the last row
            if i == 0 and not self._begun:
                self._start(None)
            ahead = None
            if self.D:  # the router's input (the experts' input) through the next D routers
                h = h.reshape(-1, h.shape[-1])[-1:]
                ahead = {}
                with self._torch.inference_mode():
                    for d in range(1, self.D + 1):
                        if i + d < self.L:
                            g = self.blocks[i + d][1].gate
                            # plain torch: this runs inside the native pass, which
                            # refuses a native op called from within it
                            ahead[d] = self._torch.nn.functional.linear(h.to(g.weight.dtype), g.weight).float()[0].numpy()
            self.pred.observe(i, ids[0].tolist(), ahead)
            # the store starts a step inside layer 0's call, after this observer
            step = self.store.step + (1 if i == 0 else 0)
            for l in range(i + 1, self.L):
                if self.pred.lead(l) == (0, l - i):
                    self._hint(l, step=step)
            if i == self.L - 1:
                self._begun = False
                for l in range(self.L):  # temporal: the next token's layers
                    if self.pred.lead(l) == (1, 0):
                        self._hint(l, step=self.store.step + 1)
        return observe

    def _hint(self, l, step):
        ids = self.pred.predict(l, self.budget)
        self.store.prefetch(self.layer_ids[l], [int(e) for e in ids], priority=-l, for_step=step)

    def _observe_multi(self, i, h, ids):
        """A `lookahead` predictor's observation of layer i (see __init__)."""
        torch = self._torch
        if i == 0 and not self._begun:
            self._start(None)
        rows = h.reshape(-1, h.shape[-1])
        if i == 0 and rows.shape[0] == 1:  # a decode pass: how well its layer 0 was hinted
            self._score_layer0(ids[-1].tolist())
        ahead, union = {}, None
        with torch.inference_mode():
            for d in self.depths:
                if i + d < self.L:
                    g = self.blocks[i + d][1].gate
                    if d == 1 and rows.shape[0] > 1:  # a prompt: every row's experts at layer i+1
                        s = torch.nn.functional.linear(rows.to(g.weight.dtype), g.weight).float()
                        top = s.topk(min(self.top_k, s.shape[-1]), dim=-1).indices.reshape(-1)
                        cnt = torch.bincount(top, minlength=s.shape[-1])
                        union = [int(e) for e in cnt.argsort(descending=True, stable=True)[: int((cnt > 0).sum())]]
                        ahead[d] = s[-1].numpy()
                    else:
                        ahead[d] = torch.nn.functional.linear(rows[-1:].to(g.weight.dtype), g.weight).float()[0].numpy()
        self.pred.observe(i, ids[-1].tolist(), ahead)
        step = self.store.step + (1 if i == 0 else 0)  # the store starts a step in layer 0's get, after this
        for d in self.depths:
            l = i + d
            if l >= self.L:
                continue
            pick = union if (d == 1 and union is not None) else \
                [int(e) for e in self.pred.predict(l, self.budget if d == 1 else min(self.budget, self.top_k))]
            self.store.prefetch(self.layer_ids[l], pick, priority=-l - (d - 1) * 0.5, for_step=step, hold=True,
                                replace=True)
        if i == self.L - 1:
            self._begun = False
            for l in range(min(self.depths[-1], self.L)):  # the next token's first layers: this token's choice
                budget = self.budget if l == 0 else min(self.budget, self.top_k)
                ids_next = [int(e) for e in self.pred.next_token(l, budget)]
                if l == 0 and rows.shape[0] == 1:
                    pred0 = {"last": ids_next}
                    draft = self._draft.get(self.passes + 1)
                    if self.uses_draft and draft is not None:  # lookahead_mtp: the MTP head's draft instead
                        ids_next = [int(e) for e in self.pred.next_token(0, budget, draft[1])]
                        pred0["draft"] = ids_next
                    self._pred0[self.passes + 1] = pred0
                self.store.prefetch(self.layer_ids[l], ids_next, priority=-l, for_step=self.store.step + 1,
                                    hold=True, replace=True)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def attach_predictor(net, store, name: str, trace=None, factor: float = 1.5) -> PrefetchDriver:
    """`--predictor NAME`: build the predictor (fitted on `trace`, a Trace or a path, when it
    needs a prior or probes) and drive `store`'s prefetcher from `net`'s routing.
    temporal, layer_ahead1/2, token and token_ahead run from the routing alone (frequency
    needs a trace for its prior); mtp, mtp_learned and combined also need the engine to call
    `driver.mtp_step(hidden, next_ids)` after each sampled token (or `on_mtp(info)`)."""

    check_name(name)
    L = len(moe_blocks(net))
    E = net.args.num_experts
    if trace is not None and not isinstance(trace, Trace):
        trace = Trace.load(trace)
    if trace is not None and name not in LIVE_ONLY:
        preds = make_predictors(trace, (name,))
        if name not in preds:
            raise MoerunError(f"predictor {name!r} needs signals the trace {trace.meta.get('trace', '')} lacks")
        pred = preds[name]
    elif name == "temporal":
        pred = Temporal(L, E)
    elif name.startswith("layer_ahead"):
        pred = LayerAhead(L, E, d=int(name[len("layer_ahead"):] or 1))
    elif name == "lookahead_mtp":
        if not getattr(net, "has_mtp", False):
            raise MoerunError("predictor 'lookahead_mtp' drafts with the model's MTP head; this model has none")
        pred = LookaheadMTP(L, E)
    elif name.startswith("lookahead"):
        pred = Lookahead(L, E, depths=tuple(range(1, int(name[len("lookahead"):] or 2) + 1)))
    elif name == "token":
        pred = Token(L, E)
    elif name == "token_ahead":
        pred = TokenAhead(L, E)
    else:
        raise MoerunError(f"predictor {name!r} needs a routing trace (moerun profile) to fit on")
    return PrefetchDriver(net, store, pred, factor)
