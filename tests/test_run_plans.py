"""A run's decode program (`engine.generate.run_plans`, `layers.stack.prepare`): built when the
run starts, for the widths it names, before any pass; no decode pass decides anything again
(the halves' plans are made once, by the build) or runs the modules to make it; the same bits
as the modules one by one; and a hook added between two runs seen by the second."""

import pytest
import torch

import moerun
from moerun import kernels
from moerun.engine.generate import run_plans
from moerun.layers import moe as moe_layer
from moerun.layers import stack
from moerun.layers.cache import Cache

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


def passes(net, cache, plans):
    """A prefill, 4 decode steps and a 3-token pass (a verification pass) on slot 1 of 2 ->
    every pass's logits."""
    g = torch.Generator().manual_seed(0)
    V = net.args.vocab_size
    slot = torch.tensor([1])
    out = [net(torch.randint(0, V, (1, 7), generator=g), cache, slot, **plans)]
    for T in (1, 1, 1, 1, 3):
        out.append(net(torch.randint(0, V, (1, T), generator=g), cache, slot, **plans))
    return out


@pytest.mark.parametrize("arch,dtype", [("qwen3_5_moe", "bfloat16"), ("qwen3_5_moe", "float32"),
                                        ("qwen3_moe", "float32")])
def test_the_program_is_built_when_the_run_starts(arch, dtype, qwen35_path, qwen3_path, monkeypatch):
    llm = moerun.load(qwen35_path if arch == "qwen3_5_moe" else qwen3_path, dtype=dtype, threads=2)
    net = llm.net
    checks = []
    real = moe_layer.moe_fusable
    monkeypatch.setattr(moe_layer, "moe_fusable", lambda *a: checks.append(a[0].shape[:2]) or real(*a))
    layers = len(net.model.layers)
    with torch.inference_mode():
        want = passes(net, Cache(net.cache_spec(), 2, 32, llm.dtype), {})  # no program: the modules
        assert len(checks) == 6 * layers  # every pass checks every MoE half
        checks.clear()
        cache = Cache(net.cache_spec(), 2, 32, llm.dtype)
        plans = run_plans(net, cache, (1, 2), (1, 3))
        # built: a stack for each of 1 and 2 rows of 1 and 3 tokens, each MoE half planned once per shape
        built = [k[1] for k, v in plans["plans"].items() if isinstance(k, tuple) and k[0] == "stack"]
        assert sorted(tuple(s[:2]) for s in built) == [(1, 1), (1, 3), (2, 1), (2, 3)]
        assert all(type(v) is tuple for k, v in plans["plans"].items() if isinstance(k, tuple) and k[0] == "stack")
        assert len(checks) == 4 * layers
        checks.clear()
        got = passes(net, cache, plans)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # the passes decided nothing again: only the 7-token prompt's modules checked their halves
    assert checks == [(1, 7)] * layers
    assert stack.decode_path(plans["plans"]) == {"native_stack_passes": 5, "module_passes": 0, "why": None}


def test_a_shape_the_run_did_not_name_builds_before_its_pass(qwen3_path, monkeypatch):
    """A pass shape outside the widths named at the start: its stack is built by that pass
    before it runs, which then takes it (no pass of the modules to make it)."""
    llm = moerun.load(qwen3_path, dtype="float32", threads=1)
    net = llm.net
    modules = []
    layer0 = net.model.layers[0]
    with torch.inference_mode():
        cache = Cache(net.cache_spec(), 1, 32, llm.dtype)
        plans = run_plans(net, cache, (1,))
        real = type(layer0).forward
        monkeypatch.setattr(type(layer0), "forward", lambda self, *a, **k: modules.append(a[0].shape[1]) or real(self, *a, **k))
        net(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache, **plans)
        assert modules == [7] * len(net.model.layers)  # the prompt: the modules
        modules.clear()
        net(torch.tensor([[8, 9]]), cache, **plans)  # two tokens: not prepared
        net(torch.tensor([[10]]), cache, **plans)
    assert modules == []
    assert stack.decode_path(plans["plans"])["native_stack_passes"] == 2


def test_generate_builds_its_program_before_the_first_step(qwen3_path, monkeypatch):
    """`generate`'s run: every decode step takes the stack, the first one included."""
    llm = moerun.load(qwen3_path, dtype="float32", threads=1)
    built = []
    real = stack._build
    monkeypatch.setattr(stack, "_build", lambda layers, x, *a: built.append(tuple(x.shape)) or real(layers, x, *a))
    llm.generate_ids([[5, 9, 17, 2, 8, 11, 4], [3, 4, 6, 7, 1, 2]], max_tokens=5, temperature=0.0)  # prompts: modules
    path = llm.last_stats.decode_path
    assert built == [(1, 1, net_h(llm)), (2, 1, net_h(llm))]  # widths 1 and 2, at the start
    assert path["module_passes"] == 0 and path["native_stack_passes"] == 4, path


def net_h(llm) -> int:
    return llm.net.model.embed_tokens.weight.shape[1]


def test_a_hook_added_between_runs_is_seen(qwen35_path):
    """The program belongs to one run: a forward hook on a router added after a run has
    built its program runs in the next run (whose layers then leave the fused call)."""
    llm = moerun.load(qwen35_path, dtype="bfloat16", threads=2)
    first = llm.generate_ids([[5, 9, 17]], max_tokens=6, temperature=0.0)
    seen = []
    handle = llm.net.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, o: seen.append(1))
    try:
        again = llm.generate_ids([[5, 9, 17]], max_tokens=6, temperature=0.0)
    finally:
        handle.remove()
    assert again == first and len(seen) == 6  # the prompt's pass and 5 decode steps
