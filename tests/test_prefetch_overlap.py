"""Prefetch that overlaps compute (issue 37, item 1): the store's accounting of hidden and
stalled read time, a prefetch in flight never read twice, demand reads before speculative
ones, prefetches that never evict what the token still needs, held and replaced hints, and
the `lookahead` driver on a tiny model (outputs unchanged; a prompt's pass reads each
needed expert once)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from test_expert_store import expert_bytes, make_store, resident, touch, wait_until


class SlowReads:
    """Wraps a store's `_read`: each read takes at least `delay` s; logs (key, start, end)."""

    def __init__(self, store, delay: float):
        self.store, self.delay, self.log = store, delay, []
        self._lock = threading.Lock()
        self._orig = store._read
        store._read = self

    def __call__(self, ent, buf):
        t0 = time.perf_counter()
        out = self._orig(ent, buf)
        time.sleep(self.delay)
        with self._lock:
            self.log.append((ent.key, t0, time.perf_counter()))
        return out

    def keys(self):
        with self._lock:
            return [k for k, _, _ in self.log]


def loading(store, key) -> bool:
    return store.entries[key].host_state == 1


def test_prefetch_in_time_is_hidden_and_counted_once(tmp_path):
    with make_store(tmp_path, ram_budget=8 * expert_bytes()) as s:
        slow = SlowReads(s, 0.05)
        touch(s, 0, [0])  # step 1: a demand miss
        s.prefetch(1, [4, 5], priority=1.0)
        wait_until(lambda: resident(s, 1) == {4, 5})
        touch(s, 1, [4, 5, 6])  # 4, 5 in time; 6 a demand miss
        st = s.stats()
        assert st["requests"] == 4 and st["demand_misses"] == 2 and st["tiers"]["host"]["hits"] == 2
        assert st["prefetch_issued"] == 2 and st["prefetch_used"] == 2 and st["prefetch_late"] == 0
        assert st["prefetch_reads"] == 2 and st["prefetch_reads_used"] == 2 and st["prefetch_read_precision"] == 1.0
        assert st["tiers"]["disk"]["reads"] == 4 and st["tiers"]["disk"]["bytes_read"] == 4 * expert_bytes()
        assert sorted(slow.keys()) == [(0, 0), (1, 4), (1, 5), (1, 6)]
        spans = {k: t1 - t0 for k, t0, t1 in slow.log}
        # hidden: the two prefetch reads; stalled: the two demand reads (each read's own time)
        assert st["read_hidden_s"] == pytest.approx(spans[(1, 4)] + spans[(1, 5)], rel=0.2)
        assert st["read_stalled_s"] == pytest.approx(spans[(0, 0)] + spans[(1, 6)], rel=0.2)
        assert 0.3 < st["expert_wait_hidden_fraction"] < 0.7


def test_prefetch_in_flight_is_waited_for_not_read_twice(tmp_path):
    with make_store(tmp_path, ram_budget=8 * expert_bytes()) as s:
        slow = SlowReads(s, 0.4)
        touch(s, 0, [0])
        s.prefetch(1, [3])
        wait_until(lambda: loading(s, (1, 3)))
        time.sleep(0.1)  # the prefetch has been reading ~0.1 s when the layer asks
        t0 = time.perf_counter()
        touch(s, 1, [3])
        st = s.stats()
        assert slow.keys().count((1, 3)) == 1 and st["tiers"]["disk"]["reads"] == 2
        assert st["prefetch_used"] == 1 and st["prefetch_late"] == 1 and st["prefetch_reads_used"] == 1
        assert st["demand_misses"] == 1  # expert 0 only: the late prefetch is not a second miss
        # the late read is split at the moment it was asked for: hidden before, stalled after
        (_, r0, r1), = [x for x in slow.log if x[0] == (1, 3)]
        demand0 = next(t1 - t0_ for k, t0_, t1 in slow.log if k == (0, 0))
        assert st["read_hidden_s"] == pytest.approx(t0 - r0, abs=0.08)
        assert st["read_stalled_s"] == pytest.approx(demand0 + (r1 - t0), abs=0.08)


def test_queued_prefetch_is_taken_over_by_the_demand(tmp_path):
    # one disk worker busy with a slow read: the second prefetch is still queued when asked for
    with make_store(tmp_path, ram_budget=8 * expert_bytes(), disk_workers=1) as s:
        slow = SlowReads(s, 0.3)
        touch(s, 0, [0])
        s.prefetch(1, [1, 2], priority=1.0)
        wait_until(lambda: loading(s, (1, 1)))
        touch(s, 1, [2])
        st = s.stats()
        assert slow.keys().count((1, 2)) == 1
        assert st["prefetch_used"] == 1 and st["prefetch_late"] == 1
        assert st["prefetch_reads_used"] == 0  # the demand read it itself
        wait_until(lambda: resident(s, 1) == {1, 2})
        assert s.stats()["tiers"]["disk"]["reads"] == 3


def test_demand_first_within_a_step(tmp_path):
    with make_store(tmp_path, layers=3, experts=8, ram_budget="100%", disk_workers=2) as s:
        s.evict_all()
        slow = SlowReads(s, 0.08)
        touch(s, 0, [0])  # step 1
        s.prefetch(2, list(range(8)), priority=0.0)  # speculative reads for layer 2
        wait_until(lambda: any(loading(s, (2, e)) for e in range(8)))
        t_get = time.perf_counter()
        touch(s, 1, [1, 2, 3, 4])
        demand_end = max(t1 for k, _, t1 in slow.log if k[0] == 1)
        started_during = [t0 for k, t0, _ in slow.log if k[0] == 2 and t_get < t0 < demand_end - 1e-3]
        assert started_during == [], "a speculative read started while a demand miss waited"
        wait_until(lambda: resident(s, 2) == set(range(8)))  # and the prefetches went on after


def test_held_hints_wait_for_the_layers_misses(tmp_path):
    with make_store(tmp_path, layers=2, experts=8, ram_budget="100%", disk_workers=2) as s:
        s.evict_all()
        slow = SlowReads(s, 0.03)
        touch(s, 0, [0])  # step 1
        s.prefetch(1, [4, 5, 6], for_step=s.step, hold=True)
        time.sleep(0.1)
        assert slow.keys() == [(0, 0)]  # held: nothing read yet
        touch(s, 1, [1, 2])  # its misses first, then the held hints are queued
        wait_until(lambda: resident(s, 1) >= {4, 5, 6})
        order = slow.keys()
        assert order.index((1, 1)) < order.index((1, 4)) and order.index((1, 2)) < order.index((1, 4))


def test_replaced_hints_are_withdrawn_before_their_read(tmp_path):
    with make_store(tmp_path, layers=2, experts=8, ram_budget="100%") as s:
        s.evict_all()
        slow = SlowReads(s, 0.0)
        touch(s, 0, [0])
        s.prefetch(1, [4, 5], hold=True)
        s.prefetch(1, [5, 6], hold=True, replace=True)
        s.get(1, [])  # a get with no misses: the held hints are queued
        wait_until(lambda: resident(s, 1) == {5, 6})
        time.sleep(0.05)
        st = s.stats()
        assert st["prefetch_cancelled"] == 1 and st["prefetch_issued"] == 3 and st["prefetch_reads"] == 2
        assert (1, 4) not in slow.keys()


def test_prefetch_never_evicts_what_the_token_still_needs(tmp_path):
    with make_store(tmp_path, layers=2, experts=8, ram_budget=3 * expert_bytes()) as s:
        touch(s, 0, [0])  # step 1; resident {0}
        s.prefetch(1, [4, 5])
        wait_until(lambda: resident(s, 1) == {4, 5})
        s.prefetch(1, [6])  # room only by evicting (0, 0): used, not wanted
        wait_until(lambda: resident(s, 1) == {4, 5, 6})
        assert resident(s, 0) == set()
        s.prefetch(1, [7])  # room only by evicting a prefetched expert not used yet: refused
        wait_until(lambda: s.stats()["prefetch_dropped"] == 1)
        assert resident(s, 1) == {4, 5, 6}
        st = s.stats()
        assert st["prefetch_no_room"] == 1 and st["prefetch_wasted"] == 0
        assert st["tiers"]["host"]["peak_bytes"] <= 3 * expert_bytes()
        touch(s, 1, [4, 5, 7])  # a demand may evict (6, prefetched but not asked for)
        st = s.stats()
        assert st["prefetch_used"] == 2 and st["demand_misses"] == 2


# -- the lookahead driver on a tiny model ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import moerun

    torch.manual_seed(0)
    cfg = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=16, num_experts_per_tok=2,
               norm_topk_prob=True)
    path = tmp_path_factory.mktemp("tiny_lookahead")
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg, experts_implementation="eager")).eval().save_pretrained(path)
    plain = moerun.load(path, dtype="float32", threads=1)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    greedy = plain.generate_ids([ids[0, :6].tolist()], max_tokens=10, temperature=0.0)
    return path, ids, plain.forward(ids), greedy


@pytest.mark.parametrize("budget", ["100%", "40%"])
def test_lookahead_keeps_outputs_and_prefetches(tiny_model, budget):
    from moerun.experts import StoreOptions, load
    from moerun.experts.predict import attach_predictor

    path, ids, logits, greedy = tiny_model
    llm = load(path, dtype="float32", threads=1, options=StoreOptions(ram_budget=budget))
    try:
        llm.store.evict_all()
        drv = attach_predictor(llm.net, llm.store, "lookahead", factor=1.0)
        assert drv.depths == (1, 2)
        assert torch.equal(llm.forward(ids), logits)
        llm.store.reset_stats()
        assert llm.generate_ids([ids[0, :6].tolist()], max_tokens=10, temperature=0.0) == greedy
        st = llm.store.stats()
        assert st["prefetch_issued"] > 0 and st["prefetch_used"] > 0
        assert st["tiers"]["host"]["peak_bytes"] <= st["tiers"]["host"]["budget_bytes"]
        # every expert use is a hit, a demand miss or a prefetch used (late ones wait, not re-read)
        assert st["requests"] == st["tiers"]["host"]["hits"] + st["demand_misses"] + st["prefetch_late"]
        drv.close()
    finally:
        llm.store.close()


def test_a_prompt_reads_each_needed_expert_once(tiny_model):
    """A prompt's pass asks each layer for the union of its rows' experts once; with lookahead
    the next layer's union is read ahead; either way no expert is read twice in the pass."""
    from collections import Counter

    from moerun.experts import StoreOptions, load
    from moerun.experts.predict import attach_predictor

    path, ids, logits, _ = tiny_model
    for predictor in (None, "lookahead"):
        llm = load(path, dtype="float32", threads=1, options=StoreOptions(ram_budget="100%"))
        try:
            if predictor:
                attach_predictor(llm.net, llm.store, predictor, factor=1.0)
            llm.store.evict_all()
            llm.store.reset_stats()
            slow = SlowReads(llm.store, 0.0)
            out = llm.forward(ids)
            assert torch.equal(out, logits)
            wait_until(lambda: llm.store.disk_mover.pending() == 0)
            time.sleep(0.05)
            reads = Counter(slow.keys())
            assert reads and max(reads.values()) == 1, reads
            st = llm.store.stats()
            used = {(l, e) for l, row in llm.store.routing.items() for e, c in enumerate(row) if c}
            assert used <= set(reads)
            assert st["requests"] == len(used)  # one request per layer and needed expert
            if predictor is None:
                assert set(reads) == used and st["tiers"]["disk"]["bytes_read"] == sum(
                    llm.store.entries[k].nbytes for k in used)
            else:
                assert st["prefetch_used"] > 0
        finally:
            llm.store.close()


# -- the routing-trace replay's mapping (benchmarks/bigger_than_ram.py) ----------------------------


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bigger_than_ram.py"
    spec = importlib.util.spec_from_file_location("bigger_than_ram", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_mapping_onto_more_layers_and_experts():
    import numpy as np

    rng = np.random.default_rng(0)
    Ld, Ed, Kd = 8, 32, 4
    ids = np.stack([np.stack([rng.choice(Ed, Kd, replace=False) for _ in range(Ld)]) for _ in range(6)])
    ids[3] = ids[1]  # a token routed as an earlier one
    out = _bench().map_trace(ids, 40, 256, 8)
    assert out.shape == (6, 40, 8) and out.min() >= 0 and out.max() < 256
    for n in range(6):
        for l in range(40):
            row = out[n, l].tolist()
            assert len(set(row)) == 8
            assert set(x % Ed for x in row) <= set(ids[n, l % Ld].tolist())  # the trace's experts of its layer
    assert (out[3] == out[1]).all()  # reuse carries over
    assert not (out[2] == out[1]).all()
    used = {int(x) for x in out[:, :8].reshape(-1)}
    assert max(used) >= Ed  # spread past the first Ed experts


def test_replay_refuses_a_missing_trace(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bigger_than_ram.py"
    p = subprocess.run([sys.executable, str(script), "-m", str(f), "--rows", "", "--routing-trace",
                        str(tmp_path / "none.npz")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [f"bigger_than_ram: error: routing trace {tmp_path / 'none.npz'} is not a file"]


def test_late_queued_prefetches_are_read_by_every_worker(tmp_path):
    """A layer's misses whose prefetches are still queued are read by the disk workers as
    demand reads, at once, not one after another by the caller."""
    with make_store(tmp_path, layers=2, experts=8, ram_budget="100%", disk_workers=4) as s:
        s.evict_all()
        slow = SlowReads(s, 0.1)
        touch(s, 0, [0])  # step 1
        s.prefetch(1, [1, 2, 3, 4], hold=True)  # held: still queued when the layer asks
        threads = set()
        orig = slow.__call__

        def read(ent, buf):
            threads.add(threading.current_thread().name)
            return orig(ent, buf)
        s._read = read
        touch(s, 1, [1, 2, 3, 4])
        st = s.stats()
        assert st["prefetch_used"] == 4 and st["prefetch_late"] == 4 and st["prefetch_reads"] == 0
        assert sorted(k for k in slow.keys() if k[0] == 1) == [(1, 1), (1, 2), (1, 3), (1, 4)]
        assert len(threads) >= 3, threads  # the caller and the workers, not the caller alone
        spans = [(t0, t1) for k, t0, t1 in slow.log if k[0] == 1]
        assert max(t0 for t0, _ in spans) < min(t1 for _, t1 in spans)  # all four in flight at once


def test_lookahead_predicts_from_the_nearest_router_and_the_last_token():
    import numpy as np

    from moerun.experts.predict import Lookahead, evaluate
    from moerun.experts.profile import Trace

    L, E, K = 4, 8, 2
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(40)])
    ids[:, 0] = [0, 1]
    truth = np.zeros((40, L, E), dtype=np.float16)
    np.put_along_axis(truth, ids.astype(np.int64), 1.0, axis=-1)
    ahead = np.zeros((2, 40, L, E), dtype=np.float16)
    ahead[0, :, :-1] = truth[:, 1:]  # router l+1 at layer l: exact
    ahead[1, :, :-2] = np.roll(truth[:, 2:], 1, axis=-1)  # router l+2 at layer l: always wrong
    tr = Trace.from_ids(ids, E, seq=np.repeat([0, 1], 20), ahead=ahead)
    res = evaluate(tr, ("lookahead", "layer_ahead2"))
    assert res["lookahead"]["1.0"]["recall"] == 1.0  # layer l+1's signal replaces l+2's a layer later
    assert res["layer_ahead2"]["1.0"]["recall"] < 0.7
    p = Lookahead(L, E)
    p.begin_token()
    p.observe(0, [0, 1], {1: truth[0, 1], 2: ahead[1, 0, 0]})
    assert set(p.predict(2, K)) == set(np.flatnonzero(ahead[1, 0, 0]))  # before layer 1: the l+2 guess
    p.observe(1, ids[0, 1], {1: truth[0, 2], 2: truth[0, 3]})
    assert set(p.predict(2, K)) == set(ids[0, 2]) and set(p.predict(3, K)) == set(ids[0, 3])
    assert set(p.next_token(0, K)) == {0, 1}  # the next token's layer 0: this token's choice


@pytest.mark.parametrize("depth", [1, 2])
def test_spec_inflight_keeps_that_many_prefetch_reads_beside_a_demand(tmp_path, depth):
    """StoreOptions.spec_inflight: while a layer reads its demand misses, up to that many
    prefetch reads are in flight beside them (the disk's queue kept deep), never more; the
    demand's own reads still start at once (demand jobs go first to every free worker)."""
    with make_store(tmp_path, layers=3, experts=8, ram_budget="100%", disk_workers=4,
                    spec_inflight=depth) as s:
        s.evict_all()
        slow = SlowReads(s, 0.15)
        touch(s, 0, [0])  # step 1
        s.prefetch(2, [0], priority=0.0)  # one speculative read for layer 2 in flight
        wait_until(lambda: loading(s, (2, 0)))

        def hint_while_demanding():  # the rest of layer 2's hints arrive while layer 1 reads
            wait_until(lambda: s._demanding > 0)
            s.prefetch(2, list(range(1, 8)), priority=0.0)
        th = threading.Thread(target=hint_while_demanding)
        th.start()
        t_get = time.perf_counter()
        touch(s, 1, [1, 2, 3, 4, 5, 6])  # two waves of demand reads (the caller and 3 free workers)
        t_end = time.perf_counter()
        th.join()
        log = list(slow.log)
        demand = sorted(t0 for k, t0, _ in log if k[0] == 1)
        assert len(demand) == 6 and demand[2] < t_get + 0.1  # the first wave at once, not behind prefetches
        spec = [(t0, t1) for k, t0, t1 in log if k[0] == 2]
        spec += [(s.entries[(2, e)].t_read, float("inf")) for e in range(8) if loading(s, (2, e))]

        def in_flight(t):
            return sum(1 for t0, t1 in spec if t0 <= t < t1)
        # sample the demand's span: prefetch reads beside it, at most `depth` (the one that started
        # before the get may finish, and another take its place)
        samples = [in_flight(t_get + (t_end - t_get) * i / 20) for i in range(1, 20)]
        assert max(samples) <= depth, samples
        assert any(t_get < t0 < t_end - 0.02 for t0, _ in spec), "no prefetch read started beside the demand"
        wait_until(lambda: resident(s, 2) == set(range(8)))


def test_reader_queue_figures(tmp_path):
    """The direct reader's queue figures: busy time and the integral of reads in flight."""
    with make_store(tmp_path, layers=2, experts=8, ram_budget="100%", disk_workers=4) as s:
        s.evict_all()
        r = s.reader
        if not hasattr(r, "busy_s"):
            pytest.skip("buffered reads (no O_DIRECT here)")
        b0, d0 = r.busy_s, r.depth_s
        touch(s, 0, [0, 1, 2, 3])
        snap = s.snapshot()
        assert r.inflight == 0
        assert snap["busy_s"] > b0 and snap["depth_s"] - d0 >= snap["busy_s"] - b0  # depth >= 1 while busy
        assert snap["preads"] == r.reads and snap["reads_disk"] == 4 and snap["full"] is False


def test_unused_prefetch_goes_first_once_its_step_passes(tmp_path):
    """A prefetched expert whose step passed without a get using it is moved to the front of
    the LRU order: the next miss evicts it, not an expert that was used before it came."""
    with make_store(tmp_path, layers=2, experts=8, ram_budget=4 * expert_bytes()) as s:
        touch(s, 0, [0, 1])  # step 1
        touch(s, 1, [2])
        s.prefetch(1, [5])  # for this step, whose layer 1 has passed: it will not be used
        wait_until(lambda: 5 in resident(s, 1))
        s.reset_stats()
        touch(s, 0, [0])  # step 2: (1, 5)'s step passed unused; (0, 1) is now the least recent
        assert s.stats()["prefetch_demoted"] == 1
        touch(s, 1, [3])  # a miss with the tier full: one eviction
        assert resident(s, 0) == {0, 1} and resident(s, 1) == {2, 3}
        st = s.stats()
        assert st["prefetch_wasted"] == 1 and st["tiers"]["host"]["evictions"] == 1
        assert st["cache_hit_rate"] == 0.5  # (0, 0) a hit of the cache's own; (1, 3) a miss


@pytest.mark.parametrize("prefault", [True, False])
def test_ram_tier_slots_made_at_load(tmp_path, prefault):
    """StoreOptions.prefault: a RAM tier smaller than the experts has its slots allocated (one
    mapping, pages touched) when the store is made, so filling it allocates nothing more;
    without it, slots are allocated one by one as experts arrive. Outputs are the same bytes."""
    n = expert_bytes()
    with make_store(tmp_path, layers=2, experts=8, ram_budget=5 * n, prefault=prefault) as s:
        assert s.pool.allocated == (5 * n if prefault else 0)
        assert (s.prefault_s > 0) == prefault
        w = {e: [t.clone() for t in ws] for e, ws in touch(s, 0, [0, 1, 2]).items()}
        touch(s, 1, [3, 4, 5, 6])  # past the budget: evictions reuse slots
        assert s.pool.allocated == 5 * n and s.stats()["tiers"]["host"]["used_bytes"] <= 5 * n
    with make_store(tmp_path, layers=2, experts=8, ram_budget="100%") as full:
        assert full.pool.allocated == 16 * n  # every expert preloaded: no reserve
        for e, ws in touch(full, 0, [0, 1, 2]).items():
            assert all(torch.equal(a, b) for a, b in zip(ws, w[e]))


def test_steady_window_of_a_decode(tmp_path):
    """bigger_than_ram's per-token marks and steady window, on a real store: each token's
    figures are the differences of the marks around it, and the window sums the tokens after
    the first N (tok/s, hit rates, reads, the tier full from the first token that began full)."""
    b = _bench()
    n = expert_bytes()
    with make_store(tmp_path, layers=2, experts=8, ram_budget=3 * n) as s:
        series, prev = [], b.token_mark(s)
        for ids in ([0, 1], [0, 2], [0, 2], [3, 4]):  # one layer-0 get per "token"
            touch(s, 0, ids)
            now = b.token_mark(s)
            series.append(b.token_delta(prev, now))
            prev = now
        assert [t["requests"] for t in series] == [2, 2, 2, 2]
        assert [t["hits_cached"] for t in series] == [0, 1, 2, 0]
        assert [t["reads"] for t in series] == [2, 1, 0, 2]
        assert [t["full_at_start"] for t in series] == [False, False, True, True]
        st = b.steady(series, 2)
        assert st["tokens"] == 2 and st["hit_rate"] == st["cache_hit_rate"] == 0.5
        assert st["expert_reads_per_token"] == 1.0 and st["full_from"] == 2
        assert st["tok_s"] == pytest.approx(2 / (series[2]["s"] + series[3]["s"]))
        assert b.steady(series, 4) is None
