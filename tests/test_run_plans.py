"""A generation run's layer checks made once (`kernels.run_plan`, `Model.forward(..., plans=)`):
the same bits as checking at every call, each check made once per layer and pass shape in a
run, and a hook added between two runs seen by the second."""

import pytest
import torch

import moerun
from moerun import kernels
from moerun.layers.cache import Cache
from moerun.engine.generate import run_plans
from moerun.layers import moe as moe_layer

pytestmark = pytest.mark.skipif(not kernels.native(), reason="native extension not built")


@pytest.fixture(scope="module")
def qwen35_path(tmp_path_factory):
    from test_speculative import build_qwen

    return build_qwen(tmp_path_factory.mktemp("qwen35_plans"), vocab_size=300)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    from conftest import make_tiny_model

    path = tmp_path_factory.mktemp("qwen3_plans")
    make_tiny_model(path)
    return path


def test_run_plan_makes_once_per_owner_and_key():
    made = []
    owner, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    plans = {}
    for o, k in ((owner, 1), (owner, 1), (owner, 2), (other, 1), (owner, 2)):
        kernels.run_plan(plans, o, k, lambda o=o, k=k: made.append((o, k)) or len(made))
    assert made == [(owner, 1), (owner, 2), (other, 1)]
    assert kernels.run_plan(plans, owner, 2, lambda: 99) == 2
    assert kernels.run_plan(None, owner, 1, lambda: 7) == 7  # no run: made at every call


def passes(net, dtype, plans):
    """A prefill, 4 decode steps and a 3-token pass (a verification pass) on slot 1 of 2 ->
    every pass's logits."""
    g = torch.Generator().manual_seed(0)
    V = net.args.vocab_size
    cache = Cache(net.cache_spec(), 2, 32, dtype)
    slot = torch.tensor([1])
    out = [net(torch.randint(0, V, (1, 7), generator=g), cache, slot, **plans)]
    for T in (1, 1, 1, 1, 3):
        out.append(net(torch.randint(0, V, (1, T), generator=g), cache, slot, **plans))
    return out


@pytest.mark.parametrize("arch,dtype", [("qwen3_5_moe", "bfloat16"), ("qwen3_5_moe", "float32"),
                                        ("qwen3_moe", "float32")])
def test_a_run_with_plans_gives_the_same_bits(arch, dtype, qwen35_path, qwen3_path, monkeypatch):
    llm = moerun.load(qwen35_path if arch == "qwen3_5_moe" else qwen3_path, dtype=dtype, threads=2)
    net = llm.net
    checks = []
    real = moe_layer.moe_fusable
    monkeypatch.setattr(moe_layer, "moe_fusable", lambda *a: checks.append(1) or real(*a))
    with torch.inference_mode():
        want = passes(net, llm.dtype, {})
        n_plain = len(checks)
        checks.clear()
        plans = run_plans(net)
        got = passes(net, llm.dtype, plans)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    layers = len(net.model.layers)
    assert n_plain == 6 * layers  # without plans: every pass checks every MoE half
    assert len(checks) == 3 * layers  # with them: once per pass shape (7, 1 and 3 tokens)
    assert any(v is not None for k, v in plans["plans"].items() if k[0] is net.model.layers[0].mlp)


def test_a_hook_added_between_runs_is_seen(qwen35_path):
    """The plans belong to one run: a forward hook on a router added after a run has made
    its plans runs in the next run (whose layers then leave the fused call)."""
    llm = moerun.load(qwen35_path, dtype="bfloat16", threads=2)
    first = llm.generate_ids([[5, 9, 17]], max_tokens=6, temperature=0.0)
    seen = []
    handle = llm.net.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, o: seen.append(1))
    try:
        again = llm.generate_ids([[5, 9, 17]], max_tokens=6, temperature=0.0)
    finally:
        handle.remove()
    assert again == first and len(seen) == 6  # the prompt's pass and 5 decode steps
