"""Continuous batching: one worker thread owns the model and a fixed set of cache slots.

A request takes a free slot, is prefilled alone (one pass over its prompt into its slot),
then joins the running batch; every step decodes all live slots in one `net(...)` call, so
concurrent requests share each layer's expert reads. Requests join and leave only between
steps. The asyncio side submits requests and reads their events through thread-safe
hand-offs (`loop.call_soon_threadsafe` into an `asyncio.Queue` per request).

With `speculative="mtp"` requests run one at a time instead, each from its prompt to its
end through the MTP speculative loop (engine/speculative.py, which keeps its own caches);
the others wait in the queue. That is the single-user mode speculation pays in: drafts
win where one stream leaves the cores idle, while a batch already fills them.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ..layers.cache import Cache
from ..engine.generate import Sequence, run_plans
from ..engine.sampling import SamplingParams, sample
from ..errors import MoerunError
from ..engine.speculative import SpeculativeStats, check_options, new_draft_length, run_speculative

# B live slots in a decode step, V vocabulary

log = logging.getLogger("moerun.server")
DEFAULT_MAX_LEN = 8192  # tokens per slot unless asked (a 32k-context model x 16 slots is a lot of KV)


class Overloaded(Exception):
    """Every slot is busy and the waiting queue is full."""


class ShuttingDown(Exception):
    """The server has stopped taking requests (it is draining before it exits)."""


SHUTDOWN = "the server is shutting down"


@dataclass
class Event:
    """What the worker tells a request: a text piece, the end, or a failure."""

    kind: str  # "piece" | "done" | "error"
    text: str = ""
    # an error's kind: "request" (this request could not run: the client's to fix),
    # "shutdown" (cut by the server's shutdown), "server" (generation failed)
    reason: str = "server"
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    decoder: object | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    id: int = 0
    ignore_eos: bool = False
    next_token: int | None = None  # sampled, not yet run through the net
    prefilled: int = 0  # prompt tokens already in the cache
    seq: Sequence | None = None
    slot: int | None = None
    sampled: int = 0  # tokens sampled, the final EOS included
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    checked_at: float = field(default_factory=time.monotonic)  # last look at the client's connection

    def emit(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the event loop has closed (server shutting down)
            self.cancelled = True


class Scheduler:
    """Owns `llm.net` and a `Cache` of `max_concurrency` slots, each `max_len` tokens long."""

    def __init__(self, llm, max_concurrency: int = 4, max_queue: int = 64, max_len: int | None = None, metrics=None,
                 prefill_budget: int = 512, speculative: str | None = None, draft_tokens: int | str = 1,
                 draft_vocab: int | None = None):
        if max_concurrency < 1:
            raise MoerunError("max_concurrency must be at least 1")
        if max_queue < 0:
            raise MoerunError("max_queue must be >= 0")
        self.speculative, self.draft_tokens, self._chooser = speculative, draft_tokens, None
        self.draft_vocab = draft_vocab
        if speculative is not None:

            self.draft_tokens = check_options(llm.net, speculative, draft_tokens, draft_vocab)
            max_concurrency = 1  # one request at a time (module doc)
            if self.draft_tokens == "auto":
                self._chooser = new_draft_length(llm.net)  # learns across requests
        self.llm = llm
        self.net = llm.net
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        # every slot holds max_len tokens of KV for every layer, allocated up front
        self.max_len = min(llm.context_length, max_len or DEFAULT_MAX_LEN)
        self.eos_ids = llm.eos_ids()
        self.metrics = metrics
        self.prefill_budget = prefill_budget
        # the speculative loop keeps its own caches, sized per request
        self.cache = (None if speculative is not None
                      else Cache(self.net.cache_spec(), max_concurrency, self.max_len, llm.dtype, llm.kv_dtype))
        # the decode program, built once for the server's life for every batch width it will run
        # (`generate.run_plans`): nothing adds hooks to a served model or replaces its weights
        self.plans = run_plans(self.net, self.cache, range(1, max_concurrency + 1))
        self.free = list(range(max_concurrency - 1, -1, -1))  # pop() hands out slot 0 first
        self.live: list[Request] = []  # decoding
        self.prefilling: collections.deque[Request] = collections.deque()  # holding a slot, prompt partly in
        self.inbox: queue.Queue[Request | None] = queue.Queue()
        self.waiting: collections.deque[Request] = collections.deque()  # worker side
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet given a slot (queue depth)
        self._running = 0
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self.admitting = True  # False once draining: submit refuses, running requests go on
        self._abort: str | None = None  # set by abort(): the worker fails everything it holds
        self.steps = 0
        self.batch_rows = 0  # sum of batch sizes over decode steps
        self._thread = threading.Thread(target=self._worker, name="moerun-scheduler", daemon=True)
        self._thread.start()

    # -- asyncio side ---------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._pending

    @property
    def running(self) -> int:
        return self._running

    def submit(self, prompt_ids: list[int], params: SamplingParams, decoder=None, ignore_eos: bool = False) -> Request:
        """Queue a request (from the event loop's thread); raises Overloaded past the queue."""
        with self._lock:
            if not self.admitting:
                raise ShuttingDown(SHUTDOWN)
            if self._running + self._pending >= self.max_concurrency + self.max_queue:
                raise Overloaded(
                    f"the server is busy: {self._running} requests running and {self._pending} waiting "
                    f"(max_concurrency {self.max_concurrency}, max_queue {self.max_queue})"
                )
            self._pending += 1
        loop = asyncio.get_running_loop()
        req = Request(list(prompt_ids), params, decoder, loop, asyncio.Queue(), id=next(self._ids),
                      ignore_eos=ignore_eos)
        self.inbox.put(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (client gone); its slot is freed before the next step."""
        req.cancelled = True
        self.inbox.put(None)  # wake the worker if it is idle

    def stop_admitting(self) -> None:
        """Refuse new requests from now on (ShuttingDown); those already in go on. Without the
        lock: a signal handler calls it, maybe while its own thread holds the lock in submit."""
        self.admitting = False

    def abort(self, reason: str = SHUTDOWN) -> None:
        """End every request held, running or waiting, with an error event (the worker does
        it between steps); the scheduler itself goes on."""
        self._abort = reason
        self.inbox.put(None)

    def close(self) -> None:
        """Stop the worker; requests still running or waiting get an error event."""
        self.stop_admitting()
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            return  # stuck in a long forward pass; it is a daemon thread
        self._drain_inbox(block=False)
        self._fail_all(SHUTDOWN, "shutdown")

    def _fail_all(self, text: str, reason: str) -> None:
        for req in list(self.live) + list(self.prefilling):
            self._finish(req, error=text, reason=reason)
        while self.waiting:
            req = self.waiting.popleft()
            with self._lock:
                self._pending -= 1
            if self.metrics is not None:
                self.metrics.finished(req)
            req.emit(Event("error", text=text, reason=reason))

    def check(self) -> None:
        """The slot books balance (tests call it when the server is idle): every slot is free
        or held by a running request, and none is free twice."""
        with self._lock:
            running = self._running
        assert len(self.free) + running == self.max_concurrency, (self.free, running, self.max_concurrency)
        assert len(set(self.free)) == len(self.free), self.free

    # -- worker thread --------------------------------------------------------
    def _worker(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    self._drain_inbox(block=not (self.live or self.waiting or self.prefilling))
                    if self._abort is not None:
                        reason, self._abort = self._abort, None
                        self._fail_all(reason, "shutdown")
                        continue
                    if self.speculative is not None:
                        self._run_speculative()
                        continue
                    self._admit()
                    if self.live:
                        self._step()
                except Exception as e:  # noqa: BLE001 - a bug outside any one request's work:
                    # fail what is held, free its slots, keep the worker alive
                    log.exception("scheduler step failed")
                    for req in list(self.live) + list(self.prefilling):
                        self._finish(req, error=f"generation failed: {e}")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if item is not None:
                    self.waiting.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self) -> None:
        """Prefill: continue prompts already holding a slot, then give free slots to waiting
        requests. At most `prefill_budget` prompt tokens per step (always one chunk at least),
        so a long prompt or a burst of arrivals stalls the running streams for a bounded time:
        a long prompt goes in over several steps, in chunks, between decode steps."""
        spent = 0
        while spent == 0 or spent < self.prefill_budget:
            if self.prefilling:
                req = self.prefilling[0]
            elif self.waiting and self.free:
                req = self.waiting.popleft()
                if not self._assign(req):
                    continue
            else:
                return
            if req.cancelled:
                self._finish(req)
                continue
            n = min(len(req.prompt_ids) - req.prefilled, max(self.prefill_budget - spent, 1))
            spent += n
            try:
                t0 = time.perf_counter()
                ids = torch.tensor([req.prompt_ids[req.prefilled : req.prefilled + n]], dtype=torch.long)  # [1, n]
                logits = self.net(ids, self.cache, torch.tensor([req.slot]), last_only=True, **self.plans)[0, -1]
                if self.metrics is not None:
                    self.metrics.prefill(n, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
                self._finish(req, error=f"prefill failed: {e}")
                continue
            req.prefilled += n
            if req.prefilled < len(req.prompt_ids):
                continue  # more chunks to go: it stays first in `prefilling`
            self.prefilling.remove(req)
            if req.params.max_tokens == 0:
                req.seq.finish_reason = "length"
                self._finish(req)
                continue
            self.live.append(req)
            if self._take(req, logits) and self.metrics is not None:
                self.metrics.generated(1)

    def _assign(self, req: Request) -> bool:
        """Give a waiting request a free slot; False if it was cancelled while waiting, or its
        sequence could not be made (it is answered with the error alone; it held no slot)."""
        with self._lock:
            self._pending -= 1
        if req.cancelled:
            if self.metrics is not None:
                self.metrics.finished(req)
            return False
        try:
            req.seq = Sequence(req.prompt_ids, req.params, decoder=req.decoder)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            log.warning("request refused at admission: %s", e)
            if self.metrics is not None:
                self.metrics.finished(req)
            req.emit(Event("error", text=f"the request could not start: {e}", reason="request"))
            return False
        with self._lock:
            self._running += 1
        req.slot = self.free.pop()
        if self.cache is not None:
            self.cache.reset(req.slot)
        self.prefilling.append(req)
        return True

    def _take(self, req: Request, logits: torch.Tensor) -> bool:
        """Sample req's next token from logits [V], stream its text, finish it if it is done.
        Returns whether a token was sampled; the token waits in `req.next_token` otherwise."""
        s = req.seq
        try:
            tok = int(sample(logits[None], s.params, [s.history()], s.uniforms)[0])
            piece = s.accept(tok, set() if req.ignore_eos else self.eos_ids)
        except Exception as e:  # noqa: BLE001
            self._finish(req, error=f"sampling failed: {e}")
            return False
        req.sampled += 1
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
            if self.metrics is not None:
                self.metrics.first_token(req.first_token_at - req.submitted)
        if piece:
            req.emit(Event("piece", text=piece))
        if s.finished or len(s.prompt_ids) + len(s.out_ids) >= self.max_len:
            if not s.finished:
                s.finish_reason = "length"
            self._finish(req)
        else:
            req.next_token = tok
        return True

    def _step(self) -> None:
        """One decode step: every live slot's newest token through the net together, then
        each slot samples its next token; the finished and the cancelled leave."""
        for req in [r for r in self.live if r.cancelled]:
            self._finish(req)
        batch = list(self.live)
        if not batch:
            return
        slots = torch.tensor([r.slot for r in batch])
        ids = torch.tensor([[r.next_token] for r in batch], dtype=torch.long)  # [B, 1]
        try:
            logits = self.net(ids, self.cache, slots, last_only=True, **self.plans)[:, -1]  # [B, V]
        except Exception as e:  # noqa: BLE001 - find the row(s) it was, fail only them
            log.warning("a decode step of %d rows failed (%s); each row goes on alone", len(batch), e)
            self._step_alone(batch, e)
            return
        self.steps += 1
        self.batch_rows += len(batch)
        if self.metrics is not None:
            self.metrics.decode_step(len(batch))
        n = sum(self._take(req, logits[i]) for i, req in enumerate(batch))
        if self.metrics is not None:
            self.metrics.generated(n)

    def _step_alone(self, batch: list[Request], error: Exception) -> None:
        """After a failed decode step, each row on its own: its slot is reset and its tokens so
        far (prompt and output, the step's token last) are prefilled again, since the failed
        pass may have left part of its work in the cache (a recurrent state updated by some
        layers and not others). A row that fails alone gets the error; the others go on."""
        if len(batch) == 1:
            self._finish(batch[0], error=f"decode failed: {error}")
            return
        for req in batch:
            tokens = req.prompt_ids + req.seq.out_ids  # out_ids[-1] is the step's token
            try:
                self.cache.reset(req.slot)
                ids = torch.tensor([tokens], dtype=torch.long)
                logits = self.net(ids, self.cache, torch.tensor([req.slot]), last_only=True, **self.plans)[0, -1]
            except Exception as e:  # noqa: BLE001
                self._finish(req, error=f"decode failed: {e}")
                continue
            if self._take(req, logits) and self.metrics is not None:
                self.metrics.generated(1)

    def _run_speculative(self) -> None:
        """The next waiting request, from its prompt to its end, through the speculative loop;
        text streams as drafts are accepted, and it stops early when the client goes."""

        while self.waiting and self.free:
            req = self.waiting.popleft()
            if not self._assign(req):
                continue
            self.prefilling.remove(req)
            if req.cancelled:
                self._finish(req)
                continue
            seq = req.seq  # its max_tokens fits max_len (the app caps it)
            self.live.append(req)
            stats = SpeculativeStats()
            steps = run_speculative(self.net, [seq], set() if req.ignore_eos else self.eos_ids, self.llm.dtype, stats,
                                    self.draft_tokens, chooser=self._chooser, kv_dtype=self.llm.kv_dtype,
                                    draft_vocab=self.draft_vocab)
            counted = 0
            try:
                for _, piece in steps:
                    if req.first_token_at is None:
                        req.first_token_at = time.perf_counter()
                        if self.metrics is not None:
                            self.metrics.prefill(len(req.prompt_ids), stats.prefill_s)
                            self.metrics.first_token(req.first_token_at - req.submitted)
                    req.emit(Event("piece", text=piece))
                    if self.metrics is not None:
                        self.metrics.generated(len(seq.out_ids) - counted)
                    counted = len(seq.out_ids)
                    self._drain_inbox(block=False)  # arrivals queue; a cancel wakes nothing here
                    if req.cancelled or self._stop.is_set() or self._abort is not None:
                        break
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
                steps.close()
                self._finish(req, error=f"generation failed: {e}")
                continue
            steps.close()
            req.sampled = len(seq.out_ids)
            if self._abort is not None and not seq.finished:
                self._finish(req, error=self._abort, reason="shutdown")
                continue
            if self.metrics is not None:
                self.metrics.generated(req.sampled - counted)
                self.metrics.speculative(stats)
            if not seq.finished and not req.cancelled:
                seq.finish_reason = seq.finish_reason or "length"
            self._finish(req)

    def _finish(self, req: Request, error: str | None = None, reason: str = "server") -> None:
        if req in self.live:
            self.live.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req.slot is not None:
            if self.cache is not None:
                self.cache.reset(req.slot)
            self.free.append(req.slot)
            req.slot = None
            with self._lock:
                self._running -= 1
        if self.metrics is not None:
            self.metrics.finished(req)
        if error is not None:
            req.emit(Event("error", text=error, reason=reason))
            return
        seq = req.seq
        req.emit(Event(
            "done",
            finish_reason="cancelled" if req.cancelled and not seq.finished else seq.finish_reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=req.sampled,
        ))
