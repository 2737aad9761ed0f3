"""A discrete-event model of decoding a MoE model on a CPU + GPU box, replayed on a routing trace.

What is modelled, per decode token (batch 1):

    GPU   for each layer: the dense part (attention or DeltaNet, shared expert, router) reads
          its weights from VRAM, then the routed experts run once all are resident; then the
          LM head. Time = bytes / (VRAM bandwidth x efficiency) + a fixed overhead per layer
          (kernel launches, synchronisation) and per token (sampling).
    link  one serial host->device copy engine: a transfer takes latency + bytes / bandwidth;
          a demand transfer goes before queued prefetches but waits for the one in flight
          (DMA is not preempted). Prefetches are served earliest-needed first.
    cache the experts the VRAM left over holds (a share of all experts), with the expert
          store's own policy classes (LRU, pinned hot set, prediction-aware).
    CPU   (policy `static_hot_cpu` only) a missing expert runs on the CPU at RAM bandwidth instead
          of crossing the link, in parallel with the GPU's resident experts.

Mapping a trace onto a target geometry (the trace model is usually smaller):
  - target layer j replays trace layer floor(j * L_trace / L_target); each target layer is its
    own set of cache entries;
  - one trace expert selection stands for K_target / K_trace target experts: its bytes and its
    transfer count (latencies) scale by that ratio, so bytes and transfers per token are the
    target's exactly;
  - the cache holds the same *share* of all experts as the target's VRAM would
    (capacity = share x L_target x E_trace entries);
  - predictions come from the trace's predictors (accuracy measured on the trace model) and
    are issued at their lead counted in *target* layers (layer_ahead d: d target layers
    before use; mtp: at the start of the previous token; temporal: after the previous
    token's router at that layer).
So skew, reuse and predictability are the trace model's; bytes, counts and timing are the
target's.

Policies: on_demand (no expert cache: every used expert crosses the link), lru, lru_pinned
(LRU whose pinned part holds the 10% most used experts of the fit half of the trace),
static_hot_cpu (the most used experts that fit stay
in VRAM, the CPU runs every other expert: the llama.cpp / KTransformers split), one `pred:<name>` per predictor
(LRU that keeps wanted experts, plus that predictor's prefetches at 1x budget), all_resident
(every expert in VRAM: the ceiling). The trace's first half fits the predictors and hot set;
the second half is replayed, its first `warmup` share not counted (caches start cold).
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, fields, replace

import numpy as np

from ..errors import MoerunError
from ..experts.emulated import parse_link
from ..experts.policy import LRU, PinnedHotSet, PredictionAware
from ..experts.predict import PREFETCHERS, evaluate
from ..experts.profile import Trace, record_trace

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    link_gbps: float  # effective host->device GB/s
    link_latency_us: float  # per transfer
    vram_gb: float
    vram_gbps: float  # nominal VRAM bandwidth
    gpu_efficiency: float = 0.8  # share of nominal bandwidth a decode GEMV reaches
    layer_overhead_us: float = 60.0  # kernel launches + syncs per layer at batch 1
    token_overhead_us: float = 150.0  # sampling, host round trip
    reserve_gb: float = 1.5  # CUDA context, KV cache / recurrent state, activations
    cpu_gbps: float = 60.0  # RAM bandwidth the CPU's expert kernels reach (cpu_miss)
    cpu_expert_overhead_us: float = 20.0  # hand-off of one layer's misses to the CPU and back


LINKS = {"pcie4": (25.0, 10.0), "pcie5": (50.0, 10.0), "pcie3": (12.0, 10.0)}  # as emulated.PRESETS
GPUS = {"rtx4090": (24.0, 1008.0), "h100": (80.0, 3350.0), "rtx3090": (24.0, 936.0), "l4": (24.0, 300.0)}
HARDWARE = {f"{l}+{g}": (l, g) for l in LINKS for g in GPUS}


def hardware(name: str = "pcie4+rtx4090", **overrides) -> Hardware:
    """`pcie4+rtx4090`, `pcie5+h100`, ... (link + GPU); any field overridable."""
    key = name.lower().replace(" ", "")
    if key not in HARDWARE:
        raise MoerunError(f"unknown hardware {name!r}; presets: {', '.join(sorted(HARDWARE))} (LINK+GPU)")
    l, g = HARDWARE[key]
    hw = Hardware(key, *LINKS[l], *GPUS[g])
    return replace(hw, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    experts: int
    top_k: int
    expert_bytes: float  # one routed expert (gate, up, down) at the stored precision
    dense_bytes_per_layer: float  # attention / DeltaNet + shared expert + router, read per token
    head_bytes: float  # LM head (read per token); the embedding row is negligible
    resident_bytes: float  # everything that is not a routed expert (dense layers, head, embeddings)


def _geom(name, layers, experts, top_k, hidden, inter, dense_params_per_layer, vocab, bpw=4.5, tied=False):
    b = bpw / 8
    head = vocab * hidden * b
    emb = 0 if tied else vocab * hidden * b
    return Geometry(name, layers, experts, top_k, 3 * hidden * inter * b, dense_params_per_layer * b, head,
                    layers * dense_params_per_layer * b + head + emb)


# dense params per layer (not routed experts) from the public configs:
# Qwen3.6-35B-A3B: 30 DeltaNet layers (qkv 2048x8192, z 2048x4096, out 4096x2048 ...) ~33.7M and
#   10 gated-attention layers (q+gate 2048x8192, k/v 2048x512, o 4096x2048) ~27.3M -> mean 32.1M,
#   + shared expert 3x2048x512 + router 2048x256 -> 35.8M
# Qwen3-30B-A3B: q 2048x4096, k/v 2048x512, o 4096x2048 -> 18.9M + router 0.26M
# Mixtral 8x7B: q 4096x4096, k/v 4096x1024, o 4096x4096 -> 41.9M + router
SPECS = {  # name -> (layers, experts, top_k, hidden, expert width, dense params per layer, vocab)
    "qwen3.6-35b-a3b": (40, 256, 8, 2048, 512, 35.8e6, 248320),
    "qwen3-30b-a3b": (48, 128, 8, 2048, 768, 19.2e6, 151936),
    "mixtral-8x7b": (32, 8, 2, 4096, 14336, 42.0e6, 32000),
}
GEOMETRIES = {k: _geom(f"{k} (4.5 bpw)", *v) for k, v in SPECS.items()}


def geometry(name: str = "qwen3.6-35b-a3b", bits: float | None = None) -> Geometry:
    """A preset at 4.5 bits per weight (4-bit with group scales), or at `bits` (8.5 for 8-bit, 16)."""
    if name not in SPECS:
        raise MoerunError(f"unknown model geometry {name!r}; presets: {', '.join(SPECS)}")
    if bits is None:
        return GEOMETRIES[name]
    return _geom(f"{name} ({bits:g} bpw)", *SPECS[name], bpw=bits)


def cache_share(hw: Hardware, geo: Geometry, vram_gb: float | None = None) -> float:
    """Share of all routed experts the VRAM left after the resident weights and reserve holds."""
    vram = hw.vram_gb if vram_gb is None else vram_gb
    free = vram * GB - geo.resident_bytes - hw.reserve_gb * GB
    total = geo.layers * geo.experts * geo.expert_bytes
    return float(min(max(free / total, 0.0), 1.0))


# -- the event model ------------------------------------------------------------------------------


@dataclass
class Job:
    key: tuple
    need: tuple  # (token, layer): earlier-needed goes first
    issue: float


class Sim:
    """One policy's state: the device's expert cache (keys are (target layer, trace expert)),
    the link's prefetch queues and the time counters; `run_policy` drives it."""

    def __init__(self, hw: Hardware, geo: Geometry, trace_layers: int, trace_experts: int, trace_k: int,
                 capacity: int, policy, pinned=(), cpu_miss: bool = False):
        self.hw, self.geo = hw, geo
        self.Lt, self.Et = trace_layers, trace_experts
        self.m = geo.top_k / trace_k  # target experts per trace selection
        bw_link = hw.link_gbps * GB
        self.unit_transfer = self.m * (hw.link_latency_us * 1e-6 + geo.expert_bytes / bw_link)
        vram = hw.vram_gbps * GB * hw.gpu_efficiency
        self.dense_t = hw.layer_overhead_us * 1e-6 + geo.dense_bytes_per_layer / vram
        self.unit_compute = self.m * geo.expert_bytes / vram
        self.head_t = hw.token_overhead_us * 1e-6 + geo.head_bytes / vram
        self.unit_cpu = self.m * geo.expert_bytes / (hw.cpu_gbps * GB)
        self.capacity = capacity
        self.policy = policy
        self.cpu_miss = cpu_miss
        self.resident: dict[tuple, float] = {}  # key -> time it is (or will be) on the device
        for k in pinned:
            self.resident[k] = 0.0
            policy.inserted(k)
        self.pending: list = []  # prefetches not yet issued to the link: (issue time, seq, Job)
        self.ready: list = []  # issued, waiting for the link: (need, seq, Job)
        self.queued: dict[tuple, Job] = {}
        self.seq = 0
        self.link_free = 0.0
        self.in_use: set = set()
        self.c = {"compute_s": 0.0, "transfer_s": 0.0, "stall_s": 0.0, "hits": 0, "requests": 0, "transfers": 0,
                  "prefetch_issued": 0, "prefetch_dropped": 0, "cpu_s": 0.0}

    def _make_room(self, now) -> bool:
        if self.capacity <= 0:
            return False
        while len(self.resident) >= self.capacity:
            v = self.policy.victims(1, lambda k: k not in self.in_use and self.resident.get(k, math.inf) <= now)
            if not v:
                return False
            del self.resident[v[0]]
            self.policy.removed(v[0])
        return True

    def prefetch(self, keys, need, now):
        for k in keys:
            if k in self.resident or k in self.queued:
                continue
            j = Job(k, need, now)
            self.queued[k] = j
            self.seq += 1
            heapq.heappush(self.pending, (now, self.seq, j))
            self.c["prefetch_issued"] += 1

    def advance_link(self, until, pos):
        """Start the queued prefetches the link reaches before `until`: among those issued by
        the time the link is free, the earliest needed; hints whose use (token, layer) is
        already past `pos` are dropped, as the store drops stale hints."""
        while self.link_free < until and (self.pending or self.ready):
            if not self.ready and self.pending[0][0] > self.link_free:
                self.link_free = self.pending[0][0]
                if self.link_free >= until:
                    return
            while self.pending and self.pending[0][0] <= self.link_free:
                _, sq, j = heapq.heappop(self.pending)
                heapq.heappush(self.ready, (j.need, sq, j))
            job = heapq.heappop(self.ready)[2]
            if self.queued.get(job.key) is not job:
                continue
            del self.queued[job.key]
            if job.need < pos:
                self.c["prefetch_dropped"] += 1
                continue
            start = self.link_free
            if not self._make_room(start):
                self.c["prefetch_dropped"] += 1
                continue
            self.link_free = start + self.unit_transfer
            self.c["transfer_s"] += self.unit_transfer
            self.c["transfers"] += 1
            self.resident[job.key] = self.link_free
            self.policy.inserted(job.key)

    def layer(self, t, keys, pos) -> float:
        """Run one layer's experts from time t (router done); returns the time they finish."""
        self.advance_link(t, pos)
        self.in_use = set(keys)
        wait = t
        misses = []
        for k in keys:
            self.c["requests"] += 1
            self.queued.pop(k, None)  # a queued prefetch for it is taken over by the demand
            if k in self.resident:
                self.policy.accessed(k)
                ready = self.resident[k]
                if ready <= t:
                    self.c["hits"] += 1
                wait = max(wait, ready)
            else:
                misses.append(k)
        if self.cpu_miss and misses:  # the CPU runs what the GPU does not hold, in parallel
            cpu = self.hw.cpu_expert_overhead_us * 1e-6 + len(misses) * self.unit_cpu
            self.c["cpu_s"] += cpu
            n_gpu = len(keys) - len(misses)
            gpu_done = wait + n_gpu * self.unit_compute
            done = max(gpu_done, t + cpu)
            self.c["stall_s"] += (wait - t) + (done - gpu_done)
            self.c["compute_s"] += n_gpu * self.unit_compute
            self.in_use = set()
            return done
        for k in misses:
            start = max(self.link_free, t)
            self.link_free = start + self.unit_transfer
            self.c["transfer_s"] += self.unit_transfer
            self.c["transfers"] += 1
            wait = max(wait, self.link_free)
            if self._make_room(start):
                self.resident[k] = self.link_free
                self.policy.inserted(k)
        self.c["stall_s"] += wait - t
        t = wait + len(keys) * self.unit_compute
        self.c["compute_s"] += len(keys) * self.unit_compute
        self.in_use = set()
        return t


def _target_layers(Lt: int, L: int) -> np.ndarray:
    return (np.arange(L) * Lt) // L


def run_policy(name: str, trace, hw: Hardware, geo: Geometry, share: float, *, predictions=None, predictor=None,
               pinned_share: float = 0.1, counts=None, warmup: float = 0.2, budget: int | None = None) -> dict:
    """Replay `trace` (the evaluation part) under one policy; returns
    {decode_tok_s, compute_s, transfer_s, stall_s, ...} over the counted tokens."""

    N, Lt, K = trace.num_tokens, trace.num_layers, trace.top_k
    Et = trace.num_experts
    L = geo.layers
    g = _target_layers(Lt, L)
    units = L * Et
    capacity = int(math.floor(share * units))
    pinned = []
    wanted: dict = {}
    if name == "all_resident":
        capacity = units
        pinned = [(j, e) for j in range(L) for e in range(Et)]
        policy = LRU()
    elif name == "on_demand":
        capacity = 0
        policy = LRU()
    elif name == "lru":
        policy = LRU()
    elif name in ("lru_pinned", "static_hot_cpu"):
        c = counts if counts is not None else trace.counts()
        per = sorted((-c[g[j], e], j, e) for j in range(L) for e in range(Et))
        if name == "lru_pinned":
            n_pin = min(int(round(pinned_share * units)), capacity // 2)
        else:
            n_pin = capacity
        pinned = [(j, e) for _, j, e in per[:n_pin]]
        policy = PinnedHotSet(LRU(), pinned)
    elif name.startswith("pred:"):
        policy = PredictionAware(LRU(), wanted)
    else:
        raise MoerunError(f"unknown policy {name!r}")
    sim = Sim(hw, geo, Lt, Et, K, capacity, policy, pinned, cpu_miss=(name == "static_hot_cpu"))

    # prefetch plan: issue point (token, target layer) -> [(need, keys)]
    plan: dict[tuple, list] = {}
    if predictions is not None:
        b = budget or K
        rows = predictions[:N, :, :b].tolist()
        for j in range(L):
            gj = int(g[j])
            dt, dl = predictor.lead(gj)
            issue_layer = -1 if dl == gj + 1 else max(j - dl, -1)
            for n in range(N):
                plan.setdefault((n - dt, issue_layer), []).append(((n, j), [(j, e) for e in rows[n][gj]]))

    expiry: list = []  # (need, key) of wanted keys, to forget hints whose use has passed

    def issue(n, j, now):
        for need, keys in plan.get((n, j), ()):
            for k in keys:
                if wanted.get(k, (-1, -1)) < need:
                    wanted[k] = need
                    heapq.heappush(expiry, (need, k))
            sim.prefetch(keys, need, now)

    used = trace.ids.tolist()
    gl = g.tolist()
    t = 0.0
    start_n = int(warmup * N)
    t_start, c_start = 0.0, None
    for n in range(N):
        if n == start_n:
            t_start, c_start = t, dict(sim.c)
        issue(n, -1, t)
        for j in range(L):
            t += sim.dense_t
            sim.c["compute_s"] += sim.dense_t
            issue(n, j, t)
            keys = [(j, e) for e in used[n][gl[j]]]
            if wanted:
                for k in keys:
                    if k in wanted and wanted[k] <= (n, j):
                        del wanted[k]
                while expiry and expiry[0][0] < (n, j):
                    need, k = heapq.heappop(expiry)
                    if wanted.get(k) == need:
                        del wanted[k]
            t = sim.layer(t, keys, (n, j))
        t += sim.head_t
        sim.c["compute_s"] += sim.head_t
    counted = N - start_n
    c0 = c_start or dict.fromkeys(sim.c, 0)
    c = {k: sim.c[k] - c0[k] for k in sim.c}
    dur = t - t_start
    return {
        "decode_tok_s": counted / dur if dur > 0 else 0.0,
        "compute_s": c["compute_s"], "transfer_s": c["transfer_s"], "stall_s": c["stall_s"],
        "ms_per_token": 1e3 * dur / max(counted, 1),
        "hit_rate": c["hits"] / max(c["requests"], 1),
        "transfers_per_token": c["transfers"] * sim.m / max(counted, 1),
        "prefetch_issued": c["prefetch_issued"], "prefetch_dropped": c["prefetch_dropped"],
        "tokens": counted,
    }


def simulate(trace, hardware_name: str = "pcie4+rtx4090", geometry_name: str = "qwen3.6-35b-a3b", *,
             vram_gb: float | None = None, link_gbps: float | None = None, link_latency_us: float | None = None,
             vram_gbps: float | None = None, bits: float | None = None, predictors=None, factor: float = 1.0, warmup: float = 0.2,
             max_tokens: int | None = 1000, as_json: bool = False, quiet: bool = False) -> dict:
    """`moerun simulate TRACE --hardware PRESET [--model-geometry PRESET] [--json]`.

    Returns {policy: {"decode_tok_s", "compute_s", "transfer_s", "stall_s", ...}} (plus
    "_setup" describing the run); prints JSON with as_json, else a table."""

    tr = trace if isinstance(trace, Trace) else Trace.load(trace)
    hw = hardware(hardware_name, vram_gb=vram_gb, link_gbps=link_gbps, link_latency_us=link_latency_us,
                  vram_gbps=vram_gbps)
    geo = geometry(geometry_name, bits)
    share = cache_share(hw, geo)
    if isinstance(predictors, str):  # the CLI's comma list
        predictors = [n.strip() for n in predictors.split(",") if n.strip()]
    names = tuple(predictors) if predictors else PREFETCHERS
    _, preds, ev, objs = evaluate(tr, names, factors=(factor,), return_predictions=True)
    if max_tokens and ev.num_tokens > max_tokens:  # the replay is pure Python: cap its length
        keep = np.arange(ev.num_tokens) < max_tokens
        ev = ev.select(keep)
        preds = {k: v[:max_tokens] for k, v in preds.items()}
    fit, _ = tr.split(0.5)
    counts = fit.counts()
    b = max(1, int(round(factor * tr.top_k)))
    out = {}
    for pol in ("on_demand", "lru", "lru_pinned", "static_hot_cpu"):
        out[pol] = run_policy(pol, ev, hw, geo, share, counts=counts, warmup=warmup)
    for name, p in preds.items():
        out[f"pred:{name}"] = run_policy("pred:" + name, ev, hw, geo, share, predictions=p, predictor=objs[name],
                                          warmup=warmup, budget=b)
    out["all_resident"] = run_policy("all_resident", ev, hw, geo, share, warmup=warmup)
    lo, hi = out["on_demand"]["decode_tok_s"], out["all_resident"]["decode_tok_s"]
    for r in out.values():  # where each policy lands: 0 = on demand, 1 = all resident
        r["position"] = (r["decode_tok_s"] - lo) / (hi - lo) if hi > lo else 1.0
    setup = {
        "hardware": {f.name: getattr(hw, f.name) for f in fields(hw)},
        "geometry": {f.name: getattr(geo, f.name) for f in fields(geo)},
        "expert_cache_share": share,
        "trace_tokens_replayed": ev.num_tokens,
        "trace_geometry": [tr.num_layers, tr.num_experts, tr.top_k],
        "prefetch_budget_factor": factor,
    }
    if as_json:
        print(json.dumps({**out, "_setup": setup}, indent=1))
    elif not quiet:
        print(format_table(out, setup))
    return {**out, "_setup": setup}


def format_table(out: dict, setup: dict) -> str:
    hw, geo = setup["hardware"], setup["geometry"]
    lines = [
        f"{geo['name']} on {hw['name']} ({hw['link_gbps']:g} GB/s, {hw['link_latency_us']:g} µs/transfer; "
        f"{hw['vram_gb']:g} GB VRAM at {hw['vram_gbps']:g} GB/s): experts cache share {setup['expert_cache_share']:.1%}",
        f"replayed {setup['trace_tokens_replayed']} trace tokens (trace L,E,K = {setup['trace_geometry']}); "
        f"times are over the counted tokens; position: 0 = on_demand, 1 = all_resident",
        "policy               tok/s   ms/tok  position  hit rate  transfers/tok  compute_s  transfer_s  stall_s",
    ]
    for name, r in out.items():
        if name.startswith("_"):
            continue
        lines.append(f"{name:<18} {r['decode_tok_s']:7.1f}  {r['ms_per_token']:7.2f}  {r.get('position', 0):8.2f}  "
                     f"{r['hit_rate']:8.3f}  "
                     f"{r['transfers_per_token']:13.1f}  {r['compute_s']:9.3f}  {r['transfer_s']:10.3f}  {r['stall_s']:7.3f}")
    return "\n".join(lines)


# -- validation against the expert store's emulated link ------------------------------------------


def validate_store(model: str, prompt_ids: list[int], *, link: str = "0.5,500", vram_share: float = 0.25,
                   tokens: int = 48, threads: int = 1, repeats: int = 1) -> dict:
    """Run the real expert store (emulated device, LRU) and the simulator on the same routing.

    1. all experts on the emulated device: decode time per token = the compute the simulator
       is given (per layer, no per-expert term: the experts' CPU time is inside it);
    2. `vram_share` of the experts on the device, LRU, misses over the emulated `link`:
       measured decode tok/s;
    3. the routing of exactly those tokens is traced, and the simulator replays it with the
       same link, budget and the calibrated compute.
    Returns {"measured_tok_s", "simulated_tok_s", "ratio", ...}. Both figures are EMULATED."""
    import moerun
    from moerun.experts import StoreOptions
    from moerun.experts import load as store_load


    def run(share):
        opts = StoreOptions(vram_budget=f"{100 * share:g}%", emulate_link=link, cache_policy="lru")
        llm = store_load(model, threads=threads, options=opts)
        try:
            best = None
            for _ in range(repeats):
                out = llm.generate_ids([prompt_ids], max_tokens=tokens, temperature=0.0)[0]
                s = llm.last_stats
                tok_s = s.decode_tok_s
                st = llm.store.stats()
                lk = llm.store.link
                st["link_busy_s"], st["link_modeled_s"], st["link_transfers"] = lk.busy_s, lk.modeled_s, lk.transfers
                if best is None or tok_s > best[0]:
                    best = (tok_s, out, st)
            return best
        finally:
            llm.store.close()

    full_tok_s, out, _ = run(1.0)
    part_tok_s, out2, st = run(vram_share)
    plain = moerun.load(model, threads=threads)
    ids = list(prompt_ids) + out2
    # the decode steps read the tokens after the first generated one
    # the prompt's routing warms the cache as the store's prefill did (token by token here,
    # one pass there); only the decode tokens are counted
    tr = record_trace(plain, [ids[:-1]], [0], ahead=0, mtp_candidates=0)
    spec = parse_link(link)
    L, E, K = tr.num_layers, tr.num_experts, tr.top_k
    ebytes = tr.meta["expert_params"] * torch_itemsize(plain.dtype)
    geo = Geometry("measured", L, E, K, ebytes, 0.0, 0.0, 0.0)
    hw = Hardware("emulated", spec.gbps, spec.latency_us, vram_gb=0.0, vram_gbps=math.inf, gpu_efficiency=1.0,
                  layer_overhead_us=1e6 / full_tok_s / L, token_overhead_us=0.0, reserve_gb=0.0)
    # the store's budget in bytes, rounded down to whole experts
    cap = int(vram_share * L * E * ebytes) // int(ebytes)
    res = run_policy("lru", tr, hw, geo, cap / (L * E), warmup=len(prompt_ids) / tr.num_tokens)
    sim = res["decode_tok_s"]
    # the same, with the per-transfer time the emulated link actually took on this machine
    achieved = st["link_busy_s"] / st["link_transfers"] if st["link_transfers"] else spec.seconds(int(ebytes))
    hw2 = replace(hw, link_gbps=math.inf, link_latency_us=achieved * 1e6)
    res2 = run_policy("lru", tr, hw2, geo, cap / (L * E), warmup=len(prompt_ids) / tr.num_tokens)
    return {
        "simulated_with_achieved_link_tok_s": res2["decode_tok_s"],
        "ratio_with_achieved_link": res2["decode_tok_s"] / part_tok_s if part_tok_s else None,
        "achieved_s_per_transfer": achieved, "modeled_s_per_transfer": spec.seconds(int(ebytes)),
        "link": spec.describe(), "vram_share": vram_share, "tokens": res["tokens"],
        "all_resident_measured_tok_s": full_tok_s,
        "measured_tok_s": part_tok_s, "simulated_tok_s": sim, "ratio": sim / part_tok_s if part_tok_s else None,
        # the emulated link's own accuracy: the time it held the link vs the time it should have
        "emulated_link_busy_over_modeled": st["link_busy_s"] / st["link_modeled_s"] if st["link_modeled_s"] else None,
        "store_tokens_incl_prompt": st["tokens"], "store_transfers": st["tiers"]["device"].get("transfers"),
        "measured_hit_rate": st["expert_hit_rate"], "simulated_hit_rate": res["hit_rate"],
        "measured_stall_s_per_token_incl_prompt": st["stall_s_per_token"],
        "simulated_stall_s_per_token": res["stall_s"] / max(res["tokens"], 1),
        "same_tokens": out == out2,
    }


def torch_itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
