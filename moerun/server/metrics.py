"""Prometheus figures of one server: requests, tokens, throughput, queue, expert store."""

from __future__ import annotations

import collections
import re
import threading
import time

from prometheus_client import CollectorRegistry, disable_created_metrics, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """One registry per server (tests start several servers in one process)."""

    def __init__(self, llm, scheduler_ref=lambda: None, window_s: float = 10.0):
        disable_created_metrics()  # the *_created series only repeat the start time
        self.registry = r = CollectorRegistry()
        self.requests = Counter("moerun_requests", "HTTP API requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("moerun_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("moerun_generation_tokens", "Tokens generated", registry=r)
        self.decode_steps = Counter("moerun_decode_steps", "Batched decode steps", registry=r)
        self.cancelled = Counter("moerun_cancelled_requests", "Generations stopped because the client went away", registry=r)
        self.ttft = Histogram("moerun_time_to_first_token_seconds", "Submit to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_seconds = Counter("moerun_prefill_seconds", "Time spent in prefill passes", registry=r)
        self.batch = Histogram("moerun_decode_batch_size", "Live slots per decode step",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.drafts = Counter("moerun_draft_tokens", "Speculative drafts checked by the model", registry=r)
        self.accepted = Counter("moerun_accepted_draft_tokens", "Speculative drafts the model accepted", registry=r)
        self.verify_steps = Counter("moerun_verification_steps", "Speculative verification passes", registry=r)
        self._sched = scheduler_ref
        self.queue_depth = Gauge("moerun_queue_depth", "Requests waiting for a slot", registry=r)
        self.queue_depth.set_function(lambda: getattr(self._sched(), "queue_depth", 0))
        self.running = Gauge("moerun_running_requests", "Requests holding a cache slot", registry=r)
        self.running.set_function(lambda: getattr(self._sched(), "running", 0))
        self.tok_s = Gauge("moerun_generation_tokens_per_second", f"Tokens generated per second over the last {window_s:g} s", registry=r)
        self.tok_s.set_function(self._rate)
        self._window_s = window_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        r.register(_ExpertStoreCollector(llm))

    # called from the scheduler thread
    def prefill(self, n_tokens: int, seconds: float) -> None:
        self.prompt_tokens.inc(n_tokens)
        self.prefill_seconds.inc(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def generated(self, n: int) -> None:
        if n:
            self.generation_tokens.inc(n)
            with self._lock:
                self._recent.append((time.monotonic(), n))

    def decode_step(self, batch: int) -> None:
        self.decode_steps.inc()
        self.batch.observe(batch)

    def speculative(self, stats) -> None:
        """One request's speculative figures (`SpeculativeStats`)."""
        self.drafts.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.verify_steps.inc(stats.verify_steps)

    def finished(self, req) -> None:
        if req.cancelled:
            self.cancelled.inc()

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window_s:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self._window_s

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ExpertStoreCollector:
    """Exports every numeric value of the model's expert store's `stats()` (when it has one)."""

    def __init__(self, llm):
        self.llm = llm

    def collect(self):
        # `expert_store` by convention; `store` is what moerun.experts.attach.load() sets
        store = getattr(self.llm, "expert_store", None) or getattr(self.llm, "store", None)
        if store is None or not hasattr(store, "stats"):
            return
        try:
            stats = store.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because of the store
            return
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = "moerun_expert_store_" + re.sub(r"[^a-zA-Z0-9_]", "_", str(key))
            g = GaugeMetricFamily(name, f"expert store: {key}")
            g.add_metric([], float(value))
            yield g
