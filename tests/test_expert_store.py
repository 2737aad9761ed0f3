"""The tiered expert store: policies on hand-made access sequences, budgets (the store's
count and the process's resident memory), prefetch and its cancellation, bad files, thread
shutdown, and outputs bit-identical to the plain model whatever the tiers hold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from moerun.errors import MoerunError
from moerun.experts.policy import LFU, LRU, PinnedHotSet, PredictionAware, make_policy
from moerun.experts.store import ExpertStore, LayerExperts, StoreOptions, expert_pieces, parse_budget
from moerun.loaders.safetensors import Checkpoint

ROOT = Path(__file__).resolve().parent.parent


# -- helpers -----------------------------------------------------------------------------------


def write_experts(path: Path, layers=2, experts=8, hidden=16, inter=8, dtype=torch.float32, seed=0, skip=()):
    """A safetensors file holding only per-expert tensors, HF names; returns the tensors."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for l in range(layers):
        for e in range(experts):
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                name = f"model.layers.{l}.mlp.experts.{e}.{proj}.weight"
                if name not in skip:
                    tensors[name] = torch.randn(shape, generator=g).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def layer_specs(path: Path, layers=2, experts=8, hidden=16, inter=8):
    names = Checkpoint(path).tensors
    return [
        LayerExperts(l, experts, hidden, inter, expert_pieces(names, f"model.layers.{l}.mlp.experts", experts, hidden, inter))
        for l in range(layers)
    ]


def expert_bytes(hidden=16, inter=8, itemsize=4):
    return 3 * hidden * inter * itemsize


def make_store(tmp_path, layers=2, experts=8, top_k=2, **opts) -> ExpertStore:
    d = tmp_path / "ckpt"
    if not (d / "model.safetensors").exists():
        write_experts(d, layers, experts)
    return ExpertStore(layer_specs(d, layers, experts), torch.float32, StoreOptions(**opts), top_k=top_k)


def touch(store, layer, ids):
    w = store.get(layer, ids)
    store.release(layer, ids)
    return w


def resident(store, layer=0, tier="host"):
    attr = "host_state" if tier == "host" else "dev_state"
    return {e for (l, e), ent in store.entries.items() if l == layer and getattr(ent, attr) == 2}


def wait_until(cond, timeout=20.0):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise AssertionError("timed out")
        time.sleep(0.005)


# -- parsing and policies -----------------------------------------------------------------------


def test_parse_budget():
    assert parse_budget(None, 1000) is None
    assert parse_budget("30%", 1000) == 300
    assert parse_budget("4GiB", 0) == 4 * 2**30
    assert parse_budget("4G", 0) == 4 * 2**30
    assert parse_budget("1.5GB", 0) == 1_500_000_000
    assert parse_budget("512mib", 0) == 512 * 2**20
    assert parse_budget(1234, 0) == 1234
    for bad in ("lots", "12parsecs", "150%", "-3"):
        with pytest.raises(MoerunError):
            parse_budget(bad, 1000)


def test_policies_alone():
    every = lambda k: True  # noqa: E731
    lru = LRU()
    for k in "abcd":
        lru.inserted(k)
    lru.accessed("a")
    assert lru.victims(2, every) == ["b", "c"]
    assert lru.victims(2, lambda k: k != "b") == ["c", "d"]

    lfu = LFU()
    for k, n in (("a", 3), ("b", 1), ("c", 2)):
        lfu.inserted(k)
        for _ in range(n):
            lfu.accessed(k)
    assert lfu.victims(3, every) == ["b", "c", "a"]
    lfu.removed("b")
    assert lfu.victims(1, every) == ["c"]  # victims() alone evicts nothing
    assert lfu.victims(1, every) == ["c"]

    pinned = PinnedHotSet(LRU(), pinned={"a"})
    for k in "abc":
        pinned.inserted(k)
    assert pinned.victims(3, every) == ["b", "c"]

    wanted = {"b": 1}
    pa = PredictionAware(LRU(), wanted)
    for k in "abc":
        pa.inserted(k)
    assert pa.victims(3, every) == ["a", "c"]
    with pytest.raises(MoerunError):
        make_policy("fifo", {})


# -- eviction on hand-made access sequences ------------------------------------------------------


def test_lru_evicts_least_recent(tmp_path):
    with make_store(tmp_path, ram_budget=3 * expert_bytes()) as s:
        for e in (0, 1, 2, 0, 3):
            touch(s, 0, [e])
        assert resident(s) == {0, 2, 3}
        touch(s, 0, [4])
        assert resident(s) == {0, 3, 4}
        st = s.stats()
        assert st["requests"] == 6 and st["tiers"]["host"]["hits"] == 1 and st["demand_misses"] == 5
        assert st["tiers"]["host"]["evictions"] == 2


def test_lfu_evicts_least_frequent(tmp_path):
    with make_store(tmp_path, ram_budget=3 * expert_bytes(), cache_policy="lfu") as s:
        for e in (0, 0, 0, 1, 2, 2):
            touch(s, 0, [e])
        touch(s, 0, [3])  # 1 was used once: it goes, although 0 is older
        assert resident(s) == {0, 2, 3}
        touch(s, 0, [1])  # 1 (now 2 uses) in; 3 (1 use) out
        assert resident(s) == {0, 1, 2}


@pytest.mark.parametrize("policy", ["lru", "lfu", "prediction"])
def test_pinned_hot_set_never_evicted(tmp_path, policy):
    profile = {0: [0, 9, 0, 5, 0, 0, 0, 0], 1: [0] * 8}
    b = expert_bytes()
    with make_store(tmp_path, ram_budget=6 * b, top_k=1, cache_policy=policy, pin_hot=2, profile=profile) as s:
        assert s.pinned == {(0, 1), (0, 3)}
        assert {1, 3} <= resident(s)
        g = torch.Generator().manual_seed(1)
        for _ in range(60):
            touch(s, int(torch.randint(0, 2, (), generator=g)), torch.randint(0, 8, (1,), generator=g).tolist())
            assert {1, 3} <= resident(s)
        touch(s, 0, [1, 3])
        assert s.stats()["tiers"]["host"]["peak_bytes"] <= 6 * b


def test_evict_all_leaves_the_pinned_and_starts_cold(tmp_path):
    """evict_all empties the tier but for the pinned set; the next use reads from disk again."""
    profile = {0: [0, 9, 0, 5, 0, 0, 0, 0], 1: [0] * 8}
    b = expert_bytes()
    with make_store(tmp_path, ram_budget=6 * b, top_k=1, pin_hot=2, profile=profile) as s:
        touch(s, 0, [0, 2, 4])
        assert {0, 1, 2, 3, 4} <= resident(s)
        reads = s.stats()["tiers"]["disk"]["reads"]
        evictions = s.tiers["host"].evictions
        assert s.evict_all() == 3 and resident(s) == {1, 3}
        assert s.tiers["host"].evictions == evictions  # not counted
        touch(s, 0, [0, 1])
        assert s.stats()["tiers"]["disk"]["reads"] > reads and {0, 1, 3} <= resident(s)


def test_pin_hot_from_the_prompt_routing(tmp_path):
    # no profile: the routing seen in the first pass picks the pinned set
    with make_store(tmp_path, ram_budget=6 * expert_bytes(), top_k=1, pin_hot=1) as s:
        touch(s, 0, [5])
        touch(s, 1, [2])
        assert s.pinned == set()
        touch(s, 0, [4])  # the next pass starts: pin
        assert s.pinned == {(0, 5), (1, 2)}


def test_prediction_aware_keeps_wanted(tmp_path):
    for policy, survivor in (("lru", False), ("prediction", True)):
        sub = tmp_path / policy
        with make_store(sub, layers=1, ram_budget=3 * expert_bytes(), cache_policy=policy) as s:
            for e in (0, 1, 2):
                touch(s, 0, [e])
            s.prefetch(0, [0], for_step=s.step + 1)  # resident: nothing moves, but the next pass wants it
            touch(s, 0, [3])
            assert (0 in resident(s)) is survivor
            assert (1 in resident(s)) is not survivor


@pytest.mark.parametrize("policy", ["lru", "lfu", "prediction", "prediction-lfu"])
@pytest.mark.parametrize("device", [False, True])
def test_budgets_never_exceeded(tmp_path, policy, device):
    b = expert_bytes()
    opts = dict(ram_budget=5 * b + 7, cache_policy=policy, pin_hot=1)
    if device:
        # the emulated device lives in RAM (inclusive), so RAM holds it and then some
        opts.update(ram_budget=8 * b + 7, vram_budget=3 * b + 1, emulate_link="1000,0")
    with make_store(tmp_path, layers=2, top_k=2, **opts) as s:
        g = torch.Generator().manual_seed(0)
        for step in range(80):
            for layer in (0, 1):
                ids = torch.randperm(8, generator=g)[:2].tolist()
                s.prefetch(1 - layer, torch.randperm(8, generator=g)[:3].tolist(), priority=float(step))
                w = s.get(layer, ids)
                assert set(w) == set(ids)
                s.release(layer, ids)
        st = s.stats()
        for name, t in st["tiers"].items():
            if "budget_bytes" in t:
                assert t["peak_bytes"] <= t["budget_bytes"], name
                assert t["used_bytes"] == t["resident_experts"] * b
        assert s.pool.allocated <= s.tiers["host"].budget
        if not policy.startswith("prediction"):  # wanted experts may leave a demand no room: transient
            assert st["transient_loads"] == 0
        assert st["prefetch_used"] + st["demand_misses"] + st["tiers"][s.compute]["hits"] >= st["requests"]


def test_store_weights_are_the_checkpoint(tmp_path):
    tensors = write_experts(tmp_path / "ckpt")
    with make_store(tmp_path, ram_budget=2 * expert_bytes()) as s:
        for layer, e in ((0, 3), (1, 7), (0, 0)):
            g, u, d = touch(s, layer, [e])[e]
            p = f"model.layers.{layer}.mlp.experts.{e}."
            assert torch.equal(g, tensors[p + "gate_proj.weight"])
            assert torch.equal(u, tensors[p + "up_proj.weight"])
            assert torch.equal(d, tensors[p + "down_proj.weight"])


def test_transient_when_a_layer_does_not_fit(tmp_path):
    tensors = write_experts(tmp_path / "ckpt")
    with make_store(tmp_path, ram_budget=1 * expert_bytes()) as s:
        w = touch(s, 0, [1, 2, 3])
        assert torch.equal(w[3][0], tensors["model.layers.0.mlp.experts.3.gate_proj.weight"])
        st = s.stats()
        assert st["transient_loads"] == 2 and st["tiers"]["host"]["peak_bytes"] <= expert_bytes()


# -- prefetch ------------------------------------------------------------------------------------


def test_prefetch_then_hit(tmp_path):
    with make_store(tmp_path, ram_budget=8 * expert_bytes()) as s:
        touch(s, 0, [0])  # step 1
        s.prefetch(1, [4, 5, 6], priority=1.0)
        wait_until(lambda: resident(s, 1) == {4, 5, 6})
        touch(s, 1, [4, 5])
        st = s.stats()
        assert st["prefetch_issued"] == 3 and st["prefetch_used"] == 2 and st["prefetch_late"] == 0
        assert st["prefetch_precision"] == pytest.approx(2 / 3)
        assert st["prefetch_recall"] == pytest.approx(2 / 3)  # 2 prefetched, 1 demand miss (expert 0)
        assert st["tiers"]["host"]["hits"] == 2


def test_prefetch_to_emulated_device(tmp_path):
    with make_store(tmp_path, ram_budget="100%", vram_budget=4 * expert_bytes(), emulate_link="pcie4") as s:
        assert s.emulated and "emulated" in s.stats()["link"]
        touch(s, 0, [0])
        s.prefetch(1, [1, 2])
        wait_until(lambda: resident(s, 1, "device") == {1, 2})
        touch(s, 1, [1, 2, 3])
        st = s.stats()
        assert st["tiers"]["device"]["hits"] == 2 and st["demand_misses"] == 2  # 0 and 3
        assert st["tiers"]["host"]["hits"] == 2  # everything is in RAM: device misses hit the host
        assert st["tiers"]["device"]["emulated"] is True


def test_stale_prefetches_dropped_and_demand_jumps_queue(tmp_path):
    # a link so slow that the queue cannot drain: 10 kB/s, 0.15 s per 1.5 kB expert
    b = expert_bytes()
    with make_store(tmp_path, ram_budget="100%", vram_budget="100%", emulate_link="0.00001,0") as s:
        # vram 100% preloads the device: evict by hand to make room for the test
        with s._cv:
            for ent in list(s.entries.values()):
                s._evict("device", ent)
        touch(s, 0, [0])  # step 1
        s.prefetch(1, list(range(8)), priority=0.0)
        time.sleep(0.05)
        t0 = time.perf_counter()
        touch(s, 1, [7])  # queued behind a transfer: the demand goes next, ahead of the queue
        waited = time.perf_counter() - t0
        assert waited < 1.0, waited  # the transfer in flight, then its own (0.3 s), not 8 transfers
        touch(s, 0, [1])  # step 2: the rest of the prefetches are stale
        wait_until(lambda: s.link_mover.pending() == 0)
        wait_until(lambda: not any(e.dev_state == 1 for e in s.entries.values()))
        st = s.stats()
        assert st["prefetch_dropped"] >= 4, st
        assert st["prefetch_used"] == 1 and st["prefetch_late"] == 1
        assert st["tiers"]["device"]["transfers"] <= 5
        assert st["tiers"]["device"]["bytes"] <= 5 * b


# -- bad files, shutdown --------------------------------------------------------------------------


def test_truncated_expert_is_a_clear_error(tmp_path):
    write_experts(tmp_path / "ckpt")
    with make_store(tmp_path, ram_budget=2 * expert_bytes()) as s:
        f = tmp_path / "ckpt" / "model.safetensors"
        os.truncate(f, f.stat().st_size - 100)  # the last expert of the last layer is cut short
        s.prefetch(1, [7])
        wait_until(lambda: s.stats()["prefetch_errors"] == 1)
        assert "model.layers.1.mlp.experts.7" in s.last_error
        t0 = time.perf_counter()
        with pytest.raises(MoerunError, match=r"model\.layers\.1\.mlp\.experts\.7\.\w+_proj\.weight.*truncated"):
            s.get(1, [7])
        assert time.perf_counter() - t0 < 5
        touch(s, 1, [0])  # others still work, and nothing is left held
        assert all(e.in_use == 0 for e in s.entries.values())


def test_missing_expert_tensor_is_a_clear_error(tmp_path):
    missing = "model.layers.1.mlp.experts.5.up_proj.weight"
    write_experts(tmp_path / "ckpt", skip={missing})
    with pytest.raises(MoerunError, match=missing.replace(".", r"\.")):
        layer_specs(tmp_path / "ckpt")


def test_threads_stop_on_close(tmp_path):
    before = set(threading.enumerate())
    s = make_store(tmp_path, ram_budget=4 * expert_bytes(), vram_budget=2 * expert_bytes(), emulate_link="0.01,1000")
    s.prefetch(0, list(range(8)))
    s.close()
    assert not s.threads_alive()
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("moerun-")]
    with pytest.raises(MoerunError, match="closed"):
        s.get(0, [1])


def test_an_interrupted_link_transfer_frees_the_link(monkeypatch):
    # Ctrl-C (any exception) in a transfer must leave the link free: a caller that catches it
    # (chat, the server) would otherwise wait forever on its next transfer
    from moerun.experts.emulated import EmulatedLink, parse_link

    link = EmulatedLink(parse_link("1000,1"))
    real = link.spec.__class__.seconds

    def interrupted(self, nbytes):
        monkeypatch.setattr(link.spec.__class__, "seconds", real)  # only the first transfer
        raise KeyboardInterrupt

    monkeypatch.setattr(link.spec.__class__, "seconds", interrupted)
    with pytest.raises(KeyboardInterrupt):
        link.fetch((), 1000, demand=True)
    done = []
    t = threading.Thread(target=lambda: done.append(link.fetch((), 1000, demand=True)), daemon=True)
    t.start()
    t.join(5)
    assert done == [()] and link.transfers == 2


def _run(code: str, timeout=120, **kw):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **kw)


CHILD = """
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from test_expert_store import make_store, expert_bytes
    from pathlib import Path
    s = make_store(Path({tmp!r}), ram_budget=4 * expert_bytes(), vram_budget=2 * expert_bytes(),
                   emulate_link="0.001,1000")
    s.prefetch(0, list(range(8)))
    print("ready", flush=True)
    {tail}
"""


def test_interpreter_exit_and_ctrl_c_do_not_hang(tmp_path):
    write_experts(tmp_path / "ckpt")
    # 1. exit with prefetches in flight and no close(): the interpreter must not wait on them
    t0 = time.time()
    r = _run(CHILD.format(tests=str(ROOT / "tests"), tmp=str(tmp_path), tail="sys.exit(0)"), timeout=120)
    assert r.returncode == 0, r.stderr
    # 2. Ctrl-C while the main thread waits on a demand transfer behind a slow link
    # (a child still alive after 40 s writes every thread's stack to stderr, shown on failure).
    # The child turns Ctrl-C into KeyboardInterrupt as an interactive Python does: started from
    # a background shell job, it would inherit SIGINT ignored, and Python keeps it so.
    code = CHILD.format(tests=str(ROOT / "tests"), tmp=str(tmp_path), tail="""
    import faulthandler, signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.dump_traceback_later(40)
    while True:
        s.get(1, [0, 1, 2]); s.release(1, [0, 1, 2])
    """)
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    t1 = time.time()
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"the child did not exit within 60 s of Ctrl-C; its stderr:\n{err[-6000:]}")
    assert "KeyboardInterrupt" in err
    assert time.time() - t1 < 30
    assert p.returncode != 0


# -- resident memory (subprocess, psutil) ---------------------------------------------------------

RSS_CHILD = """
    import gc, json, sys, psutil, torch
    sys.path.insert(0, {tests!r})
    from test_expert_store import layer_specs
    from moerun.experts.store import ExpertStore, StoreOptions
    from pathlib import Path
    torch.set_num_threads(1)
    proc = psutil.Process()
    specs = layer_specs(Path({ckpt!r}), {layers}, {experts}, {hidden}, {inter})
    gc.collect()
    base = proc.memory_info().rss
    s = ExpertStore(specs, torch.float32, StoreOptions(ram_budget={budget!r}), top_k=2)
    peak = proc.memory_info().rss
    g = torch.Generator().manual_seed(0)
    for step in range(150):
        for layer in range({layers}):
            ids = torch.randperm({experts}, generator=g)[:2].tolist()
            s.get(layer, ids); s.release(layer, ids)
        peak = max(peak, proc.memory_info().rss)
    print(json.dumps(dict(growth=peak - base, budget=s.tiers["host"].budget, total=s.total_bytes,
                          disk=s.stats()["tiers"]["disk"]["bytes_read"])))
    s.close()
"""


def test_ram_budget_holds_in_resident_memory(tmp_path):
    import json

    dims = dict(layers=4, experts=32, hidden=256, inter=512)  # 1.5 MiB per expert, 192 MiB in all
    write_experts(tmp_path / "ckpt", **dims)

    def growth(budget):
        r = _run(RSS_CHILD.format(tests=str(ROOT / "tests"), ckpt=str(tmp_path / "ckpt"), budget=budget, **dims), timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    limited = growth("25%")
    assert limited["disk"] > limited["total"]  # it really streamed: more bytes read than the experts hold
    assert limited["growth"] < limited["budget"] + 24 * 2**20, limited
    everything = growth(None)  # the control: the same measure sees all experts when they are all in RAM
    assert everything["growth"] > 0.9 * everything["total"], everything


# -- outputs bit-identical to the plain model ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import moerun

    torch.manual_seed(0)
    cfg = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True, mlp_only_layers=[1])
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg, experts_implementation="eager")).eval().save_pretrained(path)
    plain = moerun.load(path, dtype="float32", threads=1)  # one thread: fast on a shared machine
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = plain.forward(ids)
    greedy = plain.generate_ids([ids[0, :5].tolist(), ids[1, :3].tolist()], max_tokens=8, temperature=0.0)
    return path, ids, logits, greedy


def _hint_next_layer(llm):
    """A stand-in predictor: each MoE layer hints the next one with its own choice."""
    from moerun.experts import StoreExperts

    mods = sorted((m for m in llm.net.modules() if isinstance(m, StoreExperts)), key=lambda m: m.layer)
    for m, nxt in zip(mods, mods[1:] + mods[:1]):
        def forward(x, ids, weights, m=m, nxt=nxt, f=m.forward):
            step = m.store.step + (nxt.layer <= m.layer)
            m.store.prefetch(nxt.layer, ids.unique().tolist(), priority=1.0, for_step=step)
            return f(x, ids, weights)
        m.forward = forward


@pytest.mark.parametrize("opts, hint", [
    (dict(), False),
    (dict(ram_budget="30%"), True),  # less than a layer's worth: streaming and transient loads
    (dict(ram_budget="50%", cache_policy="lfu", pin_hot=2), False),
    (dict(ram_budget="60%", cache_policy="prediction", pin_hot_fraction=0.25), True),
    (dict(vram_budget="25%", emulate_link="pcie4"), True),
    (dict(ram_budget="75%", vram_budget="50%", emulate_link="25,10", cache_policy="prediction-lfu", pin_hot=1), True),
])
def test_outputs_bit_identical_whatever_the_tiers(tiny_model, opts, hint):
    from moerun.experts import StoreOptions, load

    path, ids, logits, greedy = tiny_model
    llm = load(path, dtype="float32", threads=1, options=StoreOptions(**opts))
    try:
        if hint:
            _hint_next_layer(llm)
        assert torch.equal(llm.forward(ids), logits)
        assert llm.generate_ids([ids[0, :5].tolist(), ids[1, :3].tolist()], max_tokens=8, temperature=0.0) == greedy
        st = llm.store.stats()
        assert st["requests"] > 0 and st["tokens"] > 0
        for t in st["tiers"].values():
            assert t.get("peak_bytes", 0) <= t.get("budget_bytes", 0) or "budget_bytes" not in t
        if hint:
            assert st["prefetch_issued"] > 0
    finally:
        llm.store.close()


def test_attach_store_to_a_loaded_model(tiny_model):
    import moerun
    from moerun.experts import StoreOptions, attach_store
    from moerun.layers.moe import Experts

    path, ids, logits, _ = tiny_model
    llm = moerun.load(path, dtype="float32", threads=1)
    with attach_store(llm.net, path, StoreOptions(ram_budget="40%")) as store:
        assert not any(isinstance(m, Experts) for m in llm.net.modules())
        assert torch.equal(llm.forward(ids), logits)
        assert store.stats()["tiers"]["disk"]["reads"] > 0


def _page_cache_fraction(path: Path) -> float:
    """Share of a file's pages in the page cache (mincore on a mapping we never touch)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        buf = ctypes.c_char.from_buffer(mm)
        n = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * n)()
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) == 0
        del buf
        return sum(v & 1 for v in vec) / n
    finally:
        mm.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_streaming_leaves_no_page_cache(tmp_path):
    dims = dict(layers=2, experts=8, hidden=128, inter=256)  # 384 KiB per expert
    write_experts(tmp_path / "ckpt", **dims)
    f = tmp_path / "ckpt" / "model.safetensors"
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)  # dirty pages cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    for drop, check in ((True, lambda x: x < 0.1), (False, lambda x: x > 0.8)):
        specs = layer_specs(tmp_path / "ckpt", **dims)
        with ExpertStore(specs, torch.float32, StoreOptions(ram_budget="25%", drop_page_cache=drop), top_k=2) as s:
            for layer in range(2):
                for e in range(8):
                    touch(s, layer, [e])
            frac = _page_cache_fraction(f)
            assert check(frac), (drop, frac)


def test_pinned_set_from_a_routing_trace(tmp_path):
    import numpy as np

    from moerun.experts.profile import Trace

    ids = np.zeros((10, 2, 2), dtype=np.int16)
    ids[:, 0] = (6, 2)
    ids[:, 1] = (1, 4)
    path = Trace.from_ids(ids, num_experts=8).save(tmp_path / "trace.npz")
    with make_store(tmp_path, ram_budget=8 * expert_bytes(), top_k=1, pin_hot=2, profile=str(path)) as s:
        assert s.pinned == {(0, 6), (0, 2), (1, 1), (1, 4)}


@pytest.mark.skipif(not (ROOT / "moerun" / "demo_model" / "config.json").is_file(), reason="no bundled demo model")
def test_demo_model_with_mtp_head_bit_identical():
    # qwen3_5_moe: its MTP head has an experts module of its own, `mtp.layers.0`, which
    # must not share a store layer with the trunk's `model.layers.0`
    import moerun
    from moerun.experts import StoreExperts, StoreOptions, load

    path = ROOT / "moerun" / "demo_model"
    plain = moerun.load(path, threads=1)
    ids = torch.randint(0, plain.args.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    llm = load(path, threads=1, options=StoreOptions(ram_budget="25%", vram_budget="20%", emulate_link="pcie4"))
    try:
        layers = [m.layer for m in llm.net.modules() if isinstance(m, StoreExperts)]
        assert len(layers) == len(set(layers))
        assert torch.equal(llm.forward(ids), plain.forward(ids))
        prompt = ids[0].tolist()
        assert llm.generate_ids([prompt], max_tokens=6, temperature=0.0) == plain.generate_ids(
            [prompt], max_tokens=6, temperature=0.0)
    finally:
        llm.store.close()


def _stack_passes(monkeypatch) -> list:
    """Count the decode passes that ran as one native call over the layer stack."""
    from moerun.layers import stack

    ran, inner = [], stack.stack_run

    def counted(*a, **k):
        y = inner(*a, **k)
        ran.append(y is not None)
        return y

    monkeypatch.setattr(stack, "stack_run", counted)
    return ran


@pytest.fixture(scope="module")
def tiny_sparse(tmp_path_factory):
    """A tiny Qwen3-MoE whose every layer is sparse (the native stack needs a MoE half in
    each), with its resident greedy tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import moerun

    torch.manual_seed(1)
    cfg = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True)
    path = tmp_path_factory.mktemp("tiny_sparse")
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg, experts_implementation="eager")).eval().save_pretrained(path)
    plain = moerun.load(path, dtype="float32", threads=1)
    prompts = [[5, 17, 3, 88, 41], [60, 2, 9]]
    return path, prompts, [plain.generate_ids([p], max_tokens=8, temperature=0.0)[0] for p in prompts]


# (demand misses are left out: one whose disk read a worker has just finished counts as a hit
# or not by when the pass asks, on either path)
_COUNTS = ("requests", "hits_host", "hits_device", "bytes_disk", "bytes_link", "reads_disk", "tokens", "steps")


@pytest.mark.parametrize("opts", [dict(ram_budget="100%"), dict(ram_budget="30%"),
                                  dict(vram_budget="25%", emulate_link="pcie4")])
def test_store_experts_take_the_native_stack(tiny_sparse, monkeypatch, opts):
    """A decode pass reads the store's experts where they lie, inside the native stack (an
    `ExpertViews.source`): the same tokens as resident experts, and the same accounting as
    the modules' path, which a no-op forward pre-hook on the experts forces."""
    from moerun.experts import StoreExperts, StoreOptions, load

    path, prompts, greedy = tiny_sparse
    ran = _stack_passes(monkeypatch)
    stats = []
    for hooked in (False, True):
        llm = load(path, dtype="float32", threads=1, options=StoreOptions(**opts))
        try:
            if hooked:
                for m in llm.net.modules():
                    if isinstance(m, StoreExperts):
                        m.register_forward_pre_hook(lambda *_: None)
            ran.clear()
            one = [llm.generate_ids([p], max_tokens=8, temperature=0.0)[0] for p in prompts]
            assert one == greedy
            assert any(ran) != hooked  # the stack runs, unless hooks send the pass to the modules
            assert llm.generate_ids(prompts, max_tokens=8, temperature=0.0) == greedy  # a batch: moe_block per layer
            assert all(e.in_use == 0 for e in llm.store.entries.values())  # every pass handed its experts back
            st = llm.store.stats()
            stats.append({k: st[k] for k in _COUNTS if k in st})
        finally:
            llm.store.close()
    assert stats[0] == stats[1] and stats[0]["requests"] > 0


def test_route_observers_keep_the_native_stack(tiny_sparse, monkeypatch):
    """A route observer (`layers.routes.observe_routes`, what predictors and profilers use)
    is called by the native stack between layers with the (h, ids, weights) the experts'
    modules are handed, bit for bit, on every path (the stack, one call per layer in a batch,
    the modules for a prompt); the tokens do not change; once removed it is called no more."""
    import moerun
    from moerun.layers.routes import observe_routes
    from moerun.experts.profile import moe_blocks

    path, prompts, greedy = tiny_sparse
    ran = _stack_passes(monkeypatch)
    seen = {}
    for how in ("observer", "hook"):
        llm = moerun.load(path, dtype="float32", threads=1)
        calls, handles = seen.setdefault(how, []), []
        for i, (_, blk) in enumerate(moe_blocks(llm.net)):
            if how == "observer":
                handles.append(observe_routes(blk.experts, lambda h, ids, w, i=i: calls.append((i, h, ids, w))))
            else:  # a forward pre-hook: the modules' own arguments (the stack steps aside)
                blk.experts.register_forward_pre_hook(lambda m, args, i=i: calls.append((i, *args)))
        ran.clear()
        assert llm.generate_ids(prompts[:1], max_tokens=8, temperature=0.0)[0] == greedy[0]
        assert any(ran) == (how == "observer")
        assert llm.generate_ids(prompts, max_tokens=4, temperature=0.0) == [g[:4] for g in greedy]  # a batch
        if how == "observer":
            n = len(calls)
            for h in handles:
                h.remove()
            ran.clear()
            assert llm.generate_ids(prompts[:1], max_tokens=8, temperature=0.0)[0] == greedy[0]
            assert len(calls) == n and any(ran)
    obs, hooks = seen["observer"], seen["hook"]
    assert len(obs) == len(hooks) > 2 * 8
    for (i, h, ids, w), (j, h2, ids2, w2) in zip(obs, hooks):
        assert i == j and torch.equal(ids, ids2) and torch.equal(w, w2)
        assert torch.equal(h.reshape(h2.shape), h2)


def test_a_native_op_inside_an_observer_is_an_error_not_a_hang(tiny_sparse):
    """A route observer runs inside the native pass, which holds the native ops' lock: a
    native op it calls would wait for itself. It is refused with an error, and the model
    then runs as before."""
    import moerun
    from moerun import kernels
    from moerun.experts.profile import moe_blocks
    from moerun.layers.routes import observe_routes

    path, prompts, greedy = tiny_sparse
    llm = moerun.load(path, dtype="float32", threads=1)
    blk = moe_blocks(llm.net)[0][1]
    handle = observe_routes(blk.experts, lambda h, ids, w: kernels.rms_norm(h, torch.ones(h.shape[-1]), 1e-6))
    with pytest.raises(RuntimeError, match="called from inside another"):
        llm.generate_ids(prompts[:1], max_tokens=8, temperature=0.0)
    handle.remove()
    assert llm.generate_ids(prompts[:1], max_tokens=8, temperature=0.0)[0] == greedy[0]


def test_a_predictor_keeps_the_native_stack(tiny_sparse, monkeypatch):
    """With a prefetch predictor attached, decode passes still run as one native call over
    the stack (it watches through route observers), it issues prefetches, and the tokens are
    those of resident experts."""
    from moerun.experts import StoreOptions, load
    from moerun.experts.predict import attach_predictor

    path, prompts, greedy = tiny_sparse
    ran = _stack_passes(monkeypatch)
    llm = load(path, dtype="float32", threads=1, options=StoreOptions(ram_budget="40%"))
    try:
        llm.predictor = attach_predictor(llm.net, llm.store, "layer_ahead1")
        ran.clear()
        assert llm.generate_ids(prompts[:1], max_tokens=8, temperature=0.0)[0] == greedy[0]
        stats = llm.store.stats()
    finally:
        llm.store.close()
    assert any(ran)
    assert stats["prefetch_issued"] > 0


def test_an_expert_source_that_fails_releases_its_experts(tiny_sparse, monkeypatch):
    """A store that fails inside a native pass (here: its get raises) surfaces the error, and
    the experts a pass held are handed back: the next pass runs."""
    from moerun.experts import StoreOptions, load

    path, prompts, greedy = tiny_sparse
    llm = load(path, dtype="float32", threads=1, options=StoreOptions(ram_budget="100%"))
    try:
        get, calls = llm.store.get, []

        def flaky(*a, **k):
            calls.append(1)
            if len(calls) == 12:
                raise MoerunError("disk went away")
            return get(*a, **k)

        monkeypatch.setattr(llm.store, "get", flaky)
        with pytest.raises(MoerunError, match="disk went away"):
            llm.generate_ids(prompts[:1], max_tokens=8, temperature=0.0)
        assert all(e.in_use == 0 for e in llm.store.entries.values())
        assert llm.generate_ids(prompts[:1], max_tokens=8, temperature=0.0) == greedy[:1]
    finally:
        llm.store.close()
