"""Execution where it lives: the wait-or-run-on-CPU cost model on hand-made figures, the
store's `--execute` modes (where experts run, the accounting adding up, outputs bit-identical
to the plain model), and bad `--execute` input."""

from __future__ import annotations

import json

import pytest
import torch

from moerun.errors import MoerunError
from moerun.experts.emulated import LinkSpec
from moerun.experts.placement import CPU, DEVICE, CostModel, CpuSpeed, DeviceModel, Miss
from moerun.experts.store import StoreOptions
from test_bad_input import assert_one_line_error, moerun, tiny  # noqa: F401 (tiny is a fixture)
from test_expert_store import expert_bytes, make_store, resident, tiny_model, touch, wait_until  # noqa: F401

MB = 10**6
EXPERT = 9_437_184  # one Qwen3-30B-A3B expert in bf16: 3 x 768 x 2048 x 2 bytes


def cpu_at(gbps: float, gflops: float = 200.0) -> CpuSpeed:
    """A CPU that streams weights at `gbps` and does `gflops` (bf16: one flop per weight byte per token)."""
    return CpuSpeed(1 / (gbps * 1e9), 1 / (gflops * 1e9))


def model(link: LinkSpec, cpu: CpuSpeed) -> CostModel:
    return CostModel(link, cpu, itemsize=2)


# -- the cost model on hand-made figures ---------------------------------------------------------


def test_one_token_on_a_slow_link_runs_on_the_cpu():
    slow = LinkSpec(5.0, 10.0)  # 1.9 ms for the expert; the CPU reads it in 0.31 ms
    assert model(slow, cpu_at(30)).plan([Miss(EXPERT, 1)]) == [CPU]


def test_prefill_moves_the_expert():
    slow = LinkSpec(5.0, 10.0)
    # 512 tokens: 24 ms on the CPU, 1.9 ms over the link + 0.07 ms on the device
    assert model(slow, cpu_at(30)).plan([Miss(EXPERT, 512)]) == [DEVICE]
    # and with a fast link even one token waits when the CPU is slow (bf16 on this AVX2 machine)
    assert model(LinkSpec(25.0, 10.0), cpu_at(2)).plan([Miss(EXPERT, 1)]) == [DEVICE]


def test_an_expert_nearly_landed_waits_and_one_behind_it_does_not():
    m = model(LinkSpec(5.0, 10.0), cpu_at(30))
    # 50 us left on the transfer in flight: it is that expert's, so it waits; another one
    # would queue behind it and take 1.9 ms more, so it runs on the CPU
    assert m.plan([Miss(EXPERT, 1, in_flight=True), Miss(EXPERT, 1)], link_free_s=50e-6) == [DEVICE, CPU]
    assert m.plan([Miss(EXPERT, 1)], link_free_s=50e-6) == [CPU]


def test_misses_queue_on_the_link_and_on_the_cpu():
    # link 0.39 ms per expert, CPU 0.94 ms: two transfers finish before the first CPU expert,
    # the third would land at 1.18 ms > 0.94 ms, the fourth again beats the CPU's 1.89 ms
    m = model(LinkSpec(25.0, 10.0), cpu_at(10))
    assert m.plan([Miss(EXPERT, 1)] * 4) == [DEVICE, DEVICE, CPU, DEVICE]


def test_device_model_is_bandwidth_bound_at_one_token_and_compute_bound_at_many():
    d = DeviceModel()
    one, many = d.seconds(1, EXPERT, 2), d.seconds(4096, EXPERT, 2)
    assert one == pytest.approx(d.launch_us * 1e-6 + EXPERT / (d.gbps * 1e9))
    assert many == pytest.approx(d.launch_us * 1e-6 + 4096 * EXPERT / (d.tflops * 1e12))


def test_cpu_speed_follows_measurements():
    truth = cpu_at(8, 40)
    est = cpu_at(100, 1000)  # a wrong start, as a noisy calibration would give
    for _ in range(100):
        for n in (1, 64):
            est.observe(n, EXPERT, truth.seconds(n, EXPERT))
    for n in (1, 16, 512):
        assert est.seconds(n, EXPERT) == pytest.approx(truth.seconds(n, EXPERT), rel=0.05)


def test_calibration_measures_something_plausible():
    cpu = CpuSpeed.calibrate(256, 128, torch.float32, reps=2)
    nbytes = 3 * 256 * 128 * 4
    assert 0 < cpu.seconds(1, nbytes) < cpu.seconds(64, nbytes) < 1.0


# -- the store's --execute modes -------------------------------------------------------------------


def adds_up(st) -> bool:
    """Every expert asked for was a device hit, waited for the link, or ran on the CPU."""
    return st["requests"] == st["tiers"]["device"]["hits"] + st["link_waits"] + st["cpu_executed"]


def test_execute_cpu_never_waits_and_moves_in_the_background(tmp_path):
    from test_expert_store import write_experts

    tensors = write_experts(tmp_path / "ckpt")
    b = expert_bytes()
    with make_store(tmp_path, ram_budget="100%", vram_budget=4 * b, emulate_link="pcie4", execute="cpu") as s:
        where = {}
        w = s.get(0, [1, 2], where=where)
        s.release(0, [1, 2])
        assert where == {1: CPU, 2: CPU}
        assert torch.equal(w[2][0], tensors["model.layers.0.mlp.experts.2.gate_proj.weight"])
        st = s.stats()
        assert st["cpu_executed"] == 2 and st["link_waits"] == 0 and st["link_bytes_avoided"] == 2 * b
        assert st["background_moves"] == 2 and adds_up(st)
        wait_until(lambda: resident(s, 0, "device") == {1, 2})  # the background moves landed
        where = {}
        s.get(0, [1, 3], where=where)  # the next step
        s.release(0, [1, 3])
        assert where == {1: DEVICE, 3: CPU}
        st = s.stats()
        assert st["tiers"]["device"]["hits"] == 1 and st["cpu_executed"] == 3 and adds_up(st)


def test_execute_device_waits(tmp_path):
    with make_store(tmp_path, ram_budget="100%", vram_budget=4 * expert_bytes(), emulate_link="pcie4") as s:
        where = {}
        s.get(0, [1, 2], where=where)
        s.release(0, [1, 2])
        assert where == {1: DEVICE, 2: DEVICE}
        st = s.stats()
        assert st["execute"] == "device" and st["link_waits"] == 2 and st["cpu_executed"] == 0 and adds_up(st)
        assert resident(s, 0, "device") == {1, 2}


def test_auto_follows_the_cost_model(tmp_path):
    b = expert_bytes()
    with make_store(tmp_path, ram_budget="100%", vram_budget=8 * b, emulate_link="0.001,0", execute="auto") as s:
        # 1.5 ms per expert over this link: a CPU at 10 GB/s (0.15 us) runs it, one at 1 MB/s (1.5 ms) does not
        s.cost.cpu = CpuSpeed(1e-10, 0.0)
        where = {}
        touch(s, 0, [0])
        s.get(1, [1], where=where)
        s.release(1, [1])
        s.cost.cpu = CpuSpeed(1e-5, 0.0)  # 15 ms per expert
        wait_until(lambda: s.link.current is None and s.link_mover.pending() == 0)
        touch(s, 0, [2])
        s.get(1, [3, 4], where=where, counts={3: 1, 4: 1})
        s.release(1, [3, 4])
        assert where == {1: CPU, 3: DEVICE, 4: DEVICE}
        st = s.stats()
        assert st["cpu_executed"] == 2 and st["link_waits"] == 3 and adds_up(st)  # 0, 1 on the CPU; 2, 3, 4 waited


def test_auto_waits_for_the_expert_in_flight(tmp_path):
    # 5 kB/s: 0.31 s per 1.5 kB expert; the CPU takes 0.4 s. Expert 1 is in flight (at most
    # 0.31 s left): wait. Expert 2 would queue behind it (more than 0.31 s + the rest): CPU.
    b = expert_bytes()
    with make_store(tmp_path, ram_budget="100%", vram_budget=8 * b, emulate_link="0.000005,0", execute="auto") as s:
        s.cost.cpu = CpuSpeed(0.4 / b, 0.0)
        s.advance()  # step 1
        s.prefetch(1, [1], priority=1.0)
        wait_until(lambda: s.link.current == (1, 1), timeout=5)
        where = {}
        s.get(1, [1, 2], where=where)
        s.release(1, [1, 2])
        assert where == {1: DEVICE, 2: CPU}
        st = s.stats()
        assert st["prefetch_late"] == 1 and st["cpu_executed"] == 1 and adds_up(st)


@pytest.mark.parametrize("execute", ["device", "cpu", "auto"])
def test_accounting_adds_up_under_a_random_mix(tmp_path, execute):
    b = expert_bytes()
    with make_store(tmp_path, ram_budget=8 * b + 7, vram_budget=3 * b + 1, emulate_link="2,5", execute=execute,
                    pin_hot=1) as s:
        g = torch.Generator().manual_seed(0)
        for step in range(60):
            for layer in (0, 1):
                ids = torch.randperm(8, generator=g)[:2].tolist()
                s.prefetch(1 - layer, torch.randperm(8, generator=g)[:3].tolist(), priority=float(step))
                where = {}
                assert set(s.get(layer, ids, n_tokens=int(1 + step % 3 * 100), where=where)) == set(ids) == set(where)
                s.release(layer, ids)
        st = s.stats()
        assert adds_up(st), st
        assert st["tiers"]["device"]["peak_bytes"] <= st["tiers"]["device"]["budget_bytes"]
        if execute == "cpu":
            assert st["link_waits"] == 0 and st["cpu_executed"] > 0
        if execute == "device":
            assert st["cpu_executed"] == 0 and st["link_waits"] > 0


def test_bad_execute_values(tmp_path):
    with pytest.raises(MoerunError, match="--execute must be one of"):
        StoreOptions(execute="gpu")
    with pytest.raises(MoerunError, match="needs a device tier"):
        make_store(tmp_path, ram_budget="50%", execute="cpu")


# -- whole models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("execute", ["cpu", "auto"])
def test_outputs_bit_identical_whatever_runs_where(tiny_model, execute):
    from moerun.experts import StoreOptions as Opts
    from moerun.experts import load

    path, ids, logits, greedy = tiny_model
    llm = load(path, dtype="float32", threads=1,
               options=Opts(ram_budget="60%", vram_budget="25%", emulate_link="pcie4", execute=execute))
    try:
        if execute == "auto":
            # a CPU quicker than the link for one token (12 us against 20 us) and slower for
            # more, held fixed (no learning from measurements): both paths run
            llm.store.cost.cpu = CpuSpeed(0.0, 2e-9)
            llm.store.cost.cpu.alpha = 0.0
        assert torch.equal(llm.forward(ids), logits)
        assert llm.generate_ids([ids[0, :5].tolist(), ids[1, :3].tolist()], max_tokens=8, temperature=0.0) == greedy
        st = llm.store.stats()
        assert adds_up(st) and st["cpu_executed"] > 0 and st["cpu_exec_s"] > 0
        if execute == "auto":
            assert st["link_waits"] > 0 and st["device_exec_s"] > 0 and st["device_exec_modelled_s"] > 0
    finally:
        llm.store.close()


def test_cli_reports_where_misses_ran(tiny):  # noqa: F811
    flags = ("--threads", "1", "--vram-budget", "25%", "--emulate-link", "pcie4")
    r = moerun("bench", "-m", tiny, "--json", "--prompt-tokens", "8", "--gen-tokens", "4", *flags, "--execute", "cpu")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["execute"] == "cpu" and out["cpu_executed"] > 0 and out["link_waits"] == 0 and out["cpu_exec_s"] > 0
    r = moerun("generate", "-m", tiny, "def", "--max-tokens", "3", "--stats", *flags, "--execute", "auto")
    assert r.returncode == 0, r.stderr
    assert "execute auto:" in r.stderr and "MODELLED device compute" in r.stderr


def test_cli_bad_execute(tiny):  # noqa: F811
    assert_one_line_error(moerun("generate", "-m", tiny, "x", "--execute", "gpu"), "--execute")
    assert_one_line_error(moerun("generate", "-m", tiny, "x", "--execute", "cpu", "--ram-budget", "50%"),
                          "needs a device tier")
