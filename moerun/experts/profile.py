"""Routing traces: which experts every token used at every MoE layer, in one compact file.

A trace is recorded with forward pre-hooks on the model's routed-expert modules (the call
`experts(x, ids, weights)`) and on each MoE block's router (`gate`), so model files never
change. Each token sequence (a held-out document, or a prompt plus its greedy
continuation) is run as one teacher-forced pass without a cache: a token's routing depends
only on its context, so this is the routing that decoding the same text would produce,
and one pass records every position at once.

File format (`.npz`, numpy only; N tokens, L MoE layers, K experts per token, E experts,
C MTP candidates, H hidden, D layer-ahead distances):

    ids        int16   [N, L, K]   selected experts, in the router's top-k order
    weights    float16 [N, L, K]   their (renormalised, where the model does) weights
    tokens     int32   [N]         the input token at each position
    seq, pos   int32   [N]         sequence index and position in it
    meta       JSON string         model, geometry, expert bytes, what was recorded, timings
  optional:
    logits     float16 [N, L, E]   router logits (`logits=True`)
    ahead      float16 [D, N, L, E] router of layer l+d applied to layer l's router input
                                   (the `layer_ahead` predictor's scores; zero where l+d >= L)
    mtp_route  float16 [N, L, E]   the `mtp` predictor's expert scores for token n, made by
                                   the MTP head at position n-2 (see `mtp_route_scores`)
    mtp_hidden float16 [N, H]      the MTP head's final normed state that predicts token n
    mtp_cand   int32   [N, C]      its top-C candidates for token n, mtp_prob float16 [N, C]
    mtp_valid  bool    [N]         False for the first two positions of a sequence
    token_route float16 [N, L, E]  the same routing approximation applied to the token at
                                   position n itself (the `token` predictor: known when its
                                   forward pass starts; and the `mtp_oracle` diagnostic)

Plots (`plot_trace`): expert-use heatmap per layer, rank-frequency per layer (log-log),
hit rate vs cache size for LRU, LFU, a static hot set and LRU + pinned hot set, replayed
on the trace with the expert store's own policy classes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import MoerunError
from ..layers.routes import observe_routes
from .policy import LFU, LRU, PinnedHotSet

# N tokens, L MoE layers, K experts per token, E experts, C MTP candidates, H hidden

FORMAT = "moerun-trace-1"


@dataclass
class Trace:
    ids: np.ndarray
    weights: np.ndarray
    tokens: np.ndarray
    seq: np.ndarray
    pos: np.ndarray
    meta: dict
    logits: np.ndarray | None = None
    ahead: np.ndarray | None = None
    mtp_route: np.ndarray | None = None
    mtp_hidden: np.ndarray | None = None
    mtp_cand: np.ndarray | None = None
    mtp_prob: np.ndarray | None = None
    mtp_valid: np.ndarray | None = None
    token_route: np.ndarray | None = None
    OPTIONAL = ("logits", "ahead", "mtp_route", "mtp_hidden", "mtp_cand", "mtp_prob", "mtp_valid", "token_route")

    @classmethod
    def from_ids(cls, ids, num_experts: int, seq=None, **optional) -> "Trace":
        """A trace from expert ids [N, L, K] alone (weights uniform): hand-made traces for tests
        and for routing recorded elsewhere."""
        ids = np.asarray(ids, dtype=np.int16)
        N, L, K = ids.shape
        seq = np.zeros(N, dtype=np.int32) if seq is None else np.asarray(seq, dtype=np.int32)
        pos = np.zeros(N, dtype=np.int32)
        for s in np.unique(seq):
            pos[seq == s] = np.arange((seq == s).sum())
        meta = {"num_experts": int(num_experts), "top_k": K, "moe_layers": list(range(L)), "tokens": N,
                "ahead": 0 if optional.get("ahead") is None else int(np.asarray(optional["ahead"]).shape[0])}
        return cls(ids=ids, weights=np.full((N, L, K), 1.0 / K, dtype=np.float16), tokens=np.zeros(N, dtype=np.int32),
                   seq=seq, pos=pos, meta=meta, **optional)

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    def counts(self) -> np.ndarray:
        """[L, E] uses of each expert."""
        L, E = self.num_layers, self.num_experts
        out = np.zeros((L, E), dtype=np.int64)
        for l in range(L):
            out[l] = np.bincount(self.ids[:, l].reshape(-1).astype(np.int64), minlength=E)[:E]
        return out

    def select(self, mask: np.ndarray) -> "Trace":
        """The tokens where `mask` [N] is True (whole sequences, for a fit/eval split)."""
        kw = {k: getattr(self, k)[mask] for k in ("ids", "weights", "tokens", "seq", "pos")}
        for k in self.OPTIONAL:
            v = getattr(self, k)
            if v is not None:
                kw[k] = v[:, mask] if k == "ahead" else v[mask]
        return Trace(meta=dict(self.meta), **kw)

    def split(self, fit_fraction: float = 0.5) -> tuple["Trace", "Trace"]:
        """(fit, eval): the first sequences holding ~fit_fraction of the tokens, the rest.
        A single sequence is cut by position instead."""
        seqs = np.unique(self.seq)
        if len(seqs) >= 2:
            sizes = np.array([(self.seq == s).sum() for s in seqs])
            cut = int(np.searchsorted(np.cumsum(sizes), fit_fraction * self.num_tokens)) + 1
            cut = min(max(cut, 1), len(seqs) - 1)
            fit = np.isin(self.seq, seqs[:cut])
        else:
            fit = np.arange(self.num_tokens) < int(fit_fraction * self.num_tokens)
        return self.select(fit), self.select(~fit)

    def save(self, path) -> Path:
        path = Path(path)
        if not path.parent.is_dir():
            raise MoerunError(f"cannot write trace {path}: directory {path.parent} does not exist")
        arrays = {k: getattr(self, k) for k in ("ids", "weights", "tokens", "seq", "pos")}
        arrays.update({k: getattr(self, k) for k in self.OPTIONAL if getattr(self, k) is not None})
        meta = {**self.meta, "format": FORMAT}
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **arrays)
        tmp.replace(path)  # nothing half-written under the real name
        return path

    @classmethod
    def load(cls, path) -> "Trace":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                d = {k: z[k] for k in z.files}
        except FileNotFoundError:
            raise MoerunError(f"trace {path} does not exist") from None
        except Exception as e:  # zipfile / pickle / value errors on a corrupt file
            raise MoerunError(f"cannot read trace {path}: {e}") from None
        if "meta" not in d or "ids" not in d:
            raise MoerunError(f"{path} is not a moerun routing trace (no meta/ids)")
        meta = json.loads(str(d.pop("meta")))
        if meta.get("format") != FORMAT:
            raise MoerunError(f"{path}: unknown trace format {meta.get('format')!r} (expected {FORMAT})")
        return cls(meta=meta, **d)


# -- recording -------------------------------------------------------------------------------


def moe_blocks(net) -> list[tuple[str, torch.nn.Module]]:
    """The trunk's MoE blocks in layer order: modules with a `gate` router beside `experts`
    (the MTP head's blocks are left out)."""
    out = []
    for name, mod in net.named_modules():
        if name.startswith("mtp") or ".mtp." in name:
            continue
        if isinstance(getattr(mod, "gate", None), torch.nn.Linear) and hasattr(mod, "experts"):
            out.append((name, mod))
    return out


def _layer_index(name: str, fallback: int) -> int:
    import re

    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    return int(m.group(1)) if m else fallback


class RoutingRecorder:
    """Forward pre-hooks on every trunk MoE block's `experts` (ids, weights) and, when
    `router_inputs`, on its `gate` (the hidden state the router reads). Use as a context
    manager; `take()` returns and clears what was recorded since the last call."""

    def __init__(self, net, router_inputs: bool = False):
        self.blocks = moe_blocks(net)
        if not self.blocks:
            raise MoerunError("this model has no routed-expert MoE blocks to trace")
        self.layers = [_layer_index(n, i) for i, (n, _) in enumerate(self.blocks)]
        self.router_inputs = router_inputs
        self.enabled = True
        self._handles = []
        self._reset()

    def _reset(self):
        L = len(self.blocks)
        self.ids = [[] for _ in range(L)]
        self.weights = [[] for _ in range(L)]
        self.inputs = [[] for _ in range(L)]

    def __enter__(self):
        # route observers, not forward hooks: the passes stay on the native path
        for i, (_, blk) in enumerate(self.blocks):
            self._handles.append(observe_routes(blk.experts, self._observer(i)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _observer(self, i):
        def observe(h, ids, weights):
            if self.enabled:
                self.ids[i].append(ids.detach().to(torch.int16).cpu())
                self.weights[i].append(weights.detach().to(torch.float16).cpu())
                if self.router_inputs:  # the router's input: the experts' (the normed hidden state)
                    self.inputs[i].append(h.detach().reshape(-1, h.shape[-1]).float().cpu())
        return observe

    def take(self):
        """(ids [N, L, K], weights [N, L, K], router inputs list[L] of [N, H] or None)."""
        ids = torch.stack([torch.cat(x) for x in self.ids], dim=1)
        w = torch.stack([torch.cat(x) for x in self.weights], dim=1)
        inputs = [torch.cat(x) for x in self.inputs] if self.router_inputs else None
        self._reset()
        return ids, w, inputs


def mtp_route_scores(net, blocks, cand: torch.Tensor, prob: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
    """The `mtp` predictor's scores: cand, prob [N, C] (the MTP head's top-C candidates for
    the next token and their probabilities) -> [N, L, E].

    The approximation: a candidate has no hidden state at layer l until it has run
    layers 0..l-1, so its router input at every layer is taken to be its *input
    embedding*, normed by that layer's `post_attention_layernorm` (the norm that feeds the
    router). Each candidate's routing probabilities are averaged with weights equal to the
    head's probabilities, renormalised over the C candidates.
    """
    emb = net.model.embed_tokens(cand) if emb is None else emb  # [N, C, H]
    p = (prob / prob.sum(-1, keepdim=True).clamp_min(1e-9)).float()
    out = []
    for name, blk in blocks:
        layer = net.get_submodule(name.rsplit(".mlp", 1)[0]) if ".mlp" in name else None
        norm = getattr(layer, "post_attention_layernorm", None)
        u = norm(emb) if norm is not None else emb
        probs = blk.gate(u).float().softmax(-1)  # [N, C, E]
        out.append((probs * p[..., None]).sum(1))
    return torch.stack(out, dim=1)


def _ahead_scores(blocks, inputs: list[torch.Tensor], D: int) -> torch.Tensor:
    """[D, N, L, E]: router of layer l+d (d = 1..D) applied to layer l's router input."""
    L = len(blocks)
    N = inputs[0].shape[0]
    E = blocks[0][1].gate.out_features
    out = torch.zeros(D, N, L, E)
    for d in range(1, D + 1):
        for l in range(L - d):
            g = blocks[l + d][1].gate
            out[d - 1, :, l] = g(inputs[l].to(g.weight.dtype)).float()
    return out


def record_sequence(net, recorder: RoutingRecorder, ids: list[int], start: int = 0, *, logits: bool = False,
                    ahead: int = 0, mtp_candidates: int = 0, token_route: bool = True) -> dict:
    """One teacher-forced pass over `ids`; returns the arrays for positions >= start, plus the
    time spent on the predictors' model-side work (µs per token)."""
    T = len(ids)
    x = torch.tensor([ids], dtype=torch.long)
    timing = {}
    with torch.inference_mode():
        recorder.enabled = True
        t0 = time.perf_counter()
        _, hidden = net(x, return_hidden=True)
        timing["forward_us"] = (time.perf_counter() - t0) * 1e6 / T
        rid, rw, inputs = recorder.take()
        recorder.enabled = False  # the routers run again below; that is not routing
        out = {"ids": rid[start:], "weights": rw[start:]}
        blocks = recorder.blocks
        if logits:
            out["logits"] = torch.stack([blk.gate(inputs[l].to(blk.gate.weight.dtype)).float()
                                         for l, (_, blk) in enumerate(blocks)], dim=1)[start:]
        if ahead:
            t0 = time.perf_counter()
            out["ahead"] = _ahead_scores(blocks, inputs, ahead)[:, start:]
            timing["ahead_us"] = (time.perf_counter() - t0) * 1e6 / T
        if mtp_candidates:
            L = len(blocks)
            E = blocks[0][1].gate.out_features
            C = mtp_candidates
            H = hidden.shape[-1]
            route = torch.zeros(T, L, E)
            mh = torch.zeros(T, H)
            cand = torch.zeros(T, C, dtype=torch.long)
            prob = torch.zeros(T, C)
            valid = torch.zeros(T, dtype=torch.bool)
            if T >= 3:
                captured = {}
                hk = net.mtp.norm.register_forward_hook(lambda m, a, o: captured.__setitem__("h", o))
                try:
                    t0 = time.perf_counter()
                    # the head at position t reads hidden[t] and token t+1, and predicts token t+2
                    lg = net.mtp_logits(hidden[:, : T - 2], x[:, 1 : T - 1])[0].float()  # [T-2, vocab]
                    timing["mtp_head_us"] = (time.perf_counter() - t0) * 1e6 / (T - 2)
                    pr, cd = lg.softmax(-1).topk(C, dim=-1)
                    t0 = time.perf_counter()
                    r = mtp_route_scores(net, blocks, cd, pr)
                    timing["mtp_route_us"] = (time.perf_counter() - t0) * 1e6 / (T - 2)
                finally:
                    hk.remove()
                route[2:], cand[2:], prob[2:], valid[2:] = r, cd, pr, True
                mh[2:] = captured["h"][0].float()
            out.update(mtp_route=route[start:], mtp_hidden=mh[start:], mtp_cand=cand[start:],
                       mtp_prob=prob[start:], mtp_valid=valid[start:])
        if token_route:
            out["token_route"] = mtp_route_scores(net, blocks, x[0, :, None], torch.ones(T, 1))[start:]
    recorder.enabled = True
    return {"arrays": out, "timing": timing}


def record_trace(llm, sequences: list[list[int]], starts: list[int] | None = None, *, logits: bool = False,
                 ahead: int = 2, mtp_candidates: int = 8, token_route: bool = True,
                 extra_meta: dict | None = None) -> Trace:
    """Record a trace over token sequences (routing of positions >= starts[i] of each)."""
    net = llm.net
    if mtp_candidates and not getattr(net, "has_mtp", False):
        mtp_candidates = 0  # no MTP head: the mtp predictors have nothing to read
    starts = starts or [0] * len(sequences)
    parts, timings = [], []
    with RoutingRecorder(net, router_inputs=bool(logits or ahead)) as rec:
        L = len(rec.blocks)
        if ahead >= L:
            ahead = max(L - 1, 0)
        for i, (ids, s) in enumerate(zip(sequences, starts)):
            if len(ids) - s <= 0:
                continue
            r = record_sequence(net, rec, ids, s, logits=logits, ahead=ahead, mtp_candidates=mtp_candidates,
                                token_route=token_route)
            n = len(ids) - s
            r["arrays"]["seq"] = torch.full((n,), i, dtype=torch.int32)
            r["arrays"]["pos"] = torch.arange(s, len(ids), dtype=torch.int32)
            r["arrays"]["tokens"] = torch.tensor(ids[s:], dtype=torch.int32)
            parts.append(r["arrays"])
            timings.append((n, r["timing"]))
        layers = rec.layers
        blk = rec.blocks[0][1]
    if not parts:
        raise MoerunError("nothing to trace: every sequence is empty")
    cat = {k: torch.cat([p[k] for p in parts], dim=1 if k == "ahead" else 0) for k in parts[0]}
    half = {"weights", "logits", "ahead", "mtp_route", "mtp_hidden", "mtp_prob", "token_route"}
    arrays = {}
    for k, v in cat.items():
        if k in half:
            arrays[k] = v.to(torch.float16).numpy()
        elif k == "ids":
            arrays[k] = v.to(torch.int16).numpy()
        elif k == "mtp_valid":
            arrays[k] = v.numpy().astype(bool)
        else:
            arrays[k] = v.to(torch.int32).numpy()
    ntok = sum(n for n, _ in timings)
    timing = {}
    for key in {k for _, t in timings for k in t}:
        num = sum(n * t[key] for n, t in timings if key in t)
        den = sum(n for n, t in timings if key in t)
        timing[key] = num / max(den, 1)
    E, I, H = blk.experts.num_experts, None, blk.gate.in_features
    gp = getattr(blk.experts, "gate_proj", None)
    I = int(gp.shape[1]) if gp is not None else int(getattr(blk.experts, "inter", 0))
    args = llm.args
    meta = {
        "model": str(getattr(llm, "path", "")),
        "model_type": args.model_type,
        "num_experts": int(E),
        "top_k": int(args.num_experts_per_tok),
        "moe_layers": layers,
        "num_hidden_layers": int(args.num_hidden_layers),
        "hidden_size": int(H),
        "moe_intermediate_size": I,
        "expert_params": 3 * H * I,
        "tokens": ntok,
        "sequences": len(parts),
        "ahead": int(ahead),
        "mtp_candidates": int(mtp_candidates),
        "timing_us_per_token": timing,
        **(extra_meta or {}),
    }
    return Trace(meta=meta, **arrays)


# -- inputs -------------------------------------------------------------------------------------


def read_prompts(path) -> list[str]:
    """Prompts: a `.jsonl` file of {"text": ...} (or {"prompt": ...}) objects, or a text file
    with one prompt per line (blank lines skipped)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise MoerunError(f"cannot read prompts {path}: {e.strerror}") from None
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise MoerunError(f"{path}:{i}: not JSON ({e.msg})") from None
            t = d.get("text", d.get("prompt")) if isinstance(d, dict) else d
            if not isinstance(t, str):
                raise MoerunError(f"{path}:{i}: expected an object with a 'text' string")
            out.append(t)
        return out
    return [line for line in text.splitlines() if line.strip()]


def profile(model: str | None, prompts: str, output: str, *, mode: str = "generate", max_tokens: int = 64,
            max_sequences: int | None = None, max_total_tokens: int | None = None, logits: bool = False,
            ahead: int = 2, mtp_candidates: int = 8, threads: int | None = None, plots: str | None = None,
            check_weights: bool = False) -> dict:
    """`moerun profile [-m PATH] --prompts FILE -o TRACE`.

    mode "generate": each prompt is continued greedily for `max_tokens` tokens and the
    routing of the generated tokens is recorded. mode "text": each prompt/document is
    teacher-forced (its first `max_tokens` tokens) and every position is recorded (the
    held-out-text traces). Returns a summary dict (and writes PNG plots when `plots` names
    a directory)."""
    import moerun

    if mode not in ("generate", "text"):
        raise MoerunError(f"unknown profile mode {mode!r}; choose generate or text")
    llm = moerun.load(model, threads=threads, check_weights=check_weights)
    texts = read_prompts(prompts)[:max_sequences]
    if not texts:
        raise MoerunError(f"{prompts} holds no prompts")
    seqs, starts, total = [], [], 0
    for t in texts:
        ids = llm.encode_prompt(t)
        if mode == "text":
            ids = ids[:max_tokens]
            start = 0
        else:
            ids = ids[: max(llm.context_length - max_tokens - 1, 1)]
            out = llm.generate_ids([ids], max_tokens=max_tokens, temperature=0.0)[0]
            start = len(ids)
            ids = ids + out
        if len(ids) - start <= 0:
            continue
        seqs.append(ids)
        starts.append(start)
        total += len(ids) - start
        if max_total_tokens and total >= max_total_tokens:
            break
    t0 = time.perf_counter()
    trace = record_trace(llm, seqs, starts, logits=logits, ahead=ahead, mtp_candidates=mtp_candidates,
                         extra_meta={"mode": mode, "prompts": str(prompts)})
    trace.save(output)
    summary = summarize(trace)
    summary["record_s"] = time.perf_counter() - t0
    summary["trace"] = str(output)
    if plots:
        summary["plots"] = plot_trace(trace, plots)
    return summary


# -- analysis -------------------------------------------------------------------------------------


def summarize(trace: Trace) -> dict:
    """Skew figures per trace: share of uses covered by the top 10% experts of each layer,
    a power-law slope fitted to the rank-frequency curve, MTP top-C next-token accuracy."""
    c = trace.counts()
    L, E = c.shape
    top = max(1, int(round(0.1 * E)))
    srt = -np.sort(-c, axis=1)
    cover = (srt[:, :top].sum(1) / np.maximum(srt.sum(1), 1)).tolist()
    slopes = []
    for l in range(L):
        y = srt[l][srt[l] > 0].astype(float)
        if len(y) >= 3:
            x = np.arange(1, len(y) + 1)
            slopes.append(float(np.polyfit(np.log(x), np.log(y), 1)[0]))
    out = {
        "tokens": trace.num_tokens, "layers": L, "experts": E, "top_k": trace.top_k,
        "top10pct_share_per_layer": [round(v, 4) for v in cover],
        "top10pct_share_mean": float(np.mean(cover)),
        "uniform_top10pct_share": top / E,
        "rank_frequency_slope_mean": float(np.mean(slopes)) if slopes else None,
    }
    if trace.mtp_cand is not None:
        v = trace.mtp_valid.astype(bool)
        hit = (trace.mtp_cand[v] == trace.tokens[v, None]).any(1)
        top1 = trace.mtp_cand[v, 0] == trace.tokens[v]
        out["mtp_next_token_top1"] = float(top1.mean()) if v.any() else None
        out[f"mtp_next_token_top{trace.mtp_cand.shape[1]}"] = float(hit.mean()) if v.any() else None
    return out


def replay_cache(trace: Trace, capacity: int, policy: str = "lru", pinned_fraction: float = 0.5,
                 counts: np.ndarray | None = None) -> float:
    """Hit rate of one device cache of `capacity` experts (all layers together) replayed on
    the trace with the store's policy classes. `policy`: lru, lfu, static (the `capacity`
    most used experts, never changed: a pure hot set), lru_pinned (LRU whose
    `pinned_fraction` of the capacity holds the most used experts). The hot set is taken
    from `counts` (default: the trace's own counts, an optimistic oracle)."""

    counts = trace.counts() if counts is None else counts
    L = trace.num_layers
    order = np.dstack(np.unravel_index(np.argsort(-counts, axis=None, kind="stable"), counts.shape))[0]
    hot = [tuple(int(v) for v in k) for k in order]
    if policy == "static":
        resident = set(hot[:capacity])
        hits = sum((l, int(e)) in resident for n in range(trace.num_tokens) for l in range(L) for e in trace.ids[n, l])
        return hits / max(trace.ids.size, 1)
    if policy == "lru":
        pol = LRU()
    elif policy == "lfu":
        pol = LFU()
    elif policy == "lru_pinned":
        pol = PinnedHotSet(LRU(), hot[: int(pinned_fraction * capacity)])
    else:
        raise MoerunError(f"unknown cache policy {policy!r}")
    pinned = getattr(pol, "pinned", set())
    resident: set = set()
    for k in pinned:
        resident.add(k)
        pol.inserted(k)
    hits = 0
    ids = trace.ids
    for n in range(trace.num_tokens):
        for l in range(L):
            need = {(l, int(e)) for e in ids[n, l]}
            for k in need:
                if k in resident:
                    hits += 1
                    pol.accessed(k)
                    continue
                if isinstance(pol, LFU) or isinstance(getattr(pol, "base", None), LFU):
                    pol.accessed(k)  # the store counts every access, resident or not
                if len(resident) >= capacity:
                    v = pol.victims(1, lambda x: x not in need)
                    if not v:
                        continue  # nothing evictable: served from a transient buffer
                    resident.discard(v[0])
                    pol.removed(v[0])
                resident.add(k)
                pol.inserted(k)
    return hits / max(ids.size, 1)


def hit_rate_curves(trace: Trace, fractions=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0),
                    policies=("lru", "lfu", "static", "lru_pinned")) -> dict:
    total = trace.num_layers * trace.num_experts
    out = {}
    for p in policies:
        out[p] = {f: replay_cache(trace, max(1, int(round(f * total))), p) for f in fractions}
    return out


def plot_trace(trace: Trace, out_dir, curves: dict | None = None) -> list[str]:
    """Write heatmap.png, rank_frequency.png, hit_rate.png into `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    c = trace.counts()
    L, E = c.shape
    share = c / np.maximum(c.sum(1, keepdims=True), 1)
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, E / 6), max(3, L / 2.5)))
    im = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(f"share of uses per expert ({trace.num_tokens} tokens; uniform = {1 / E:.3f})")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    paths.append(str(out_dir / "heatmap.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    ranks = np.arange(1, E + 1)
    for l in range(L):
        y = -np.sort(-share[l])
        ax.loglog(ranks[y > 0], y[y > 0], lw=1, alpha=0.8, label=f"layer {l}" if L <= 12 else None)
    ax.loglog(ranks, np.full(E, 1 / E), "k--", lw=1, label="uniform")
    ax.set_xlabel("rank of expert")
    ax.set_ylabel("share of uses")
    ax.set_title("rank-frequency per layer (a power law is a straight line)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(str(out_dir / "rank_frequency.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    curves = curves if curves is not None else hit_rate_curves(trace)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for p, pts in curves.items():
        xs = sorted(pts)
        label = {"static": "static hot set (oracle: the trace's own counts)",
                 "lru_pinned": "LRU + pinned hot half (oracle counts)"}.get(p, p.upper())
        ax.plot([100 * x for x in xs], [pts[x] for x in xs], marker="o", label=label)
    ax.set_xlabel("cache size (% of all routed experts)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.02)
    ax.set_title("hit rate vs cache size, replayed on the trace")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(str(out_dir / "hit_rate.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
