"""A decode pass through the whole layer stack as its native calls in one loop
(`layers.stack.stack_run`), for one row or a batch's decode step: bit-identical to the
modules, and out of the way wherever they must run (a prompt, hooks, a layer without both
fused halves). A run's stack of each shape is built before its first pass of that shape:
no pass runs the modules to make it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moerun import kernels
from moerun.layers import stack

pytestmark = pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")

CFG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
           norm_topk_prob=True)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    def make(**over):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp("qwen3_stack")
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**CFG, **over}, experts_implementation="eager")).eval().save_pretrained(path)
        return path

    return make


def passes(net, dtype, plans, slot=1, keep_cache=False):
    """A prompt into slot 1 of a 2-slot cache, then one-token steps and passes of three (a
    verification pass), some for the last position's logits only, some with the final
    hidden state too (`stack.model_pass` makes both) -> every pass's outputs, the cache's
    lengths after each (and, `keep_cache`, the cache). Positions reach 22."""
    from moerun.layers.cache import Cache

    ids = torch.randint(0, CFG["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(3))
    cache = Cache(net.cache_spec(), 2, 32, dtype)
    s = torch.tensor([slot])
    kw = {} if plans is None else {"plans": plans}
    out = [net(ids[:, :8], cache, s, **kw)]
    for j, (i, T) in enumerate(((8, 1), (9, 1), (10, 1), (11, 3), (14, 1), (15, 3), (18, 1), (19, 3))):
        got = net(ids[:, i : i + T], cache, s, last_only=j % 2 == 1, return_hidden=j % 3 > 0, **kw)
        out.extend(got if isinstance(got, tuple) else [got])
        out.append(cache.lengths.clone())
    return (out, cache) if keep_cache else out


def counting(monkeypatch):
    ran = []
    real = stack.stack_run

    def counted(*a, **k):
        y = real(*a, **k)
        ran.append(y is not None)
        return y

    monkeypatch.setattr(stack, "stack_run", counted)
    return ran


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "int4"])
def test_stack_is_bit_identical_to_the_modules(qwen3_path, dtype, quant, monkeypatch):
    import moerun

    net = moerun.load(qwen3_path(), dtype=dtype, threads=1, quant=quant).net
    kv = net.model.embed_tokens.weight.dtype
    ran = counting(monkeypatch)
    whole = []  # passes `model_pass` ran (without an MTP head, it alone asks for the rope's numpy rows)
    from moerun.layers.rope import Rope

    real_rows = Rope.float_rows
    monkeypatch.setattr(Rope, "float_rows", lambda self, p, T, dtype: whole.append(T) or real_rows(self, p, T, dtype))
    with torch.inference_mode():
        want = passes(net, kv, None)
        assert not any(ran) and not whole  # no plans: the modules
        ran.clear()
        got = passes(net, kv, {})
    # the prefill (a long pass) runs the modules; every decode-sized pass the stack, the first
    # of each shape included, through `model_pass` (embedding, final norm and LM head native too)
    assert ran == [False] + [True] * 8
    assert whole == [1, 1, 1, 3, 1, 3, 1, 3]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_hooks_run_the_modules(qwen3_path, monkeypatch):
    import moerun
    from moerun.layers.cache import Cache

    net = moerun.load(qwen3_path(), dtype="float32", threads=1, quant="int4").net
    ran = counting(monkeypatch)
    seen = []
    ids = torch.randint(0, CFG["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(7))

    def steps(plans, hook_at=(), layer_hook=False):
        cache, s, out = Cache(net.cache_spec(), 1, 24, torch.float32), torch.tensor([0]), []
        kw = {} if plans is None else {"plans": plans}
        net(ids[:, :4], cache, s, **kw)
        for i in range(4, 12):
            hooks = []
            if i in hook_at:  # a pre-hook on one layer's experts during the run: the modules serve it
                hooks.append(net.model.layers[1].mlp.experts.register_forward_pre_hook(
                    lambda m, a: seen.append(a[1].shape)))
            out.append(net(ids[:, i : i + 1], cache, s, **kw))
            for h in hooks:
                h.remove()
        return out

    with torch.inference_mode():
        want = steps(None)
        ran.clear()
        got = steps({}, hook_at=(7, 8))
        assert ran == [True, True, True, True, False, False, True, True, True]  # (a 4-token prompt: the stack)
        assert len(seen) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
        # a forward hook on a layer: the stack is not built
        h = net.model.layers[0].register_forward_hook(lambda *a: seen.append("layer"))
        ran.clear()
        got = steps({})
        h.remove()
        assert not any(ran) and seen.count("layer") == 9
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def batch_steps(net, plans, dtype, seed: int = 11) -> list:
    """Rows of different lengths in slots 2, 0 and 3 of a 4-slot cache (prefilled one by
    one), then one-token batch steps of all three rows, of two of them (a row finished) and of
    one, some with the final hidden state too -> every step's outputs and the lengths."""
    from moerun.layers.cache import Cache

    g = torch.Generator().manual_seed(seed)
    cache = Cache(net.cache_spec(), 4, 40, dtype)
    kw = {} if plans is None else {"plans": plans}
    for slot, n in ((2, 5), (0, 9), (3, 2)):
        net(torch.randint(0, CFG["vocab_size"], (1, n), generator=g), cache, torch.tensor([slot]), **kw)
    out = []
    for j, rows in enumerate([(2, 0, 3)] * 4 + [(3, 2)] * 3 + [(0,)] * 2):
        ids = torch.randint(0, CFG["vocab_size"], (len(rows), 1), generator=g)
        got = net(ids, cache, torch.tensor(rows), last_only=j % 2 == 0, return_hidden=j % 3 == 1, **kw)
        out.extend(got if isinstance(got, tuple) else [got])
        out.append(cache.lengths.clone())
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "int4"])
def test_a_batch_step_takes_the_stack_bit_identical_to_the_modules(qwen3_path, dtype, quant, monkeypatch):
    """A batch's one-token steps, rows at scattered slots and positions, go through the stack
    (each width's first step too), giving the modules' bits."""
    import moerun

    net = moerun.load(qwen3_path(), dtype=dtype, threads=1, quant=quant).net
    kv = net.model.embed_tokens.weight.dtype
    ran = counting(monkeypatch)
    with torch.inference_mode():
        want = batch_steps(net, None, kv)
        assert not any(ran)
        ran.clear()
        plans = {}
        got = batch_steps(net, plans, kv)
    # three prefills (the 9-token one the modules, the 5- and 2-token ones a pass the stack
    # takes), then every step of every width the stack
    assert ran == [True, False, True] + [True] * 9
    assert stack.decode_path(plans)["native_stack_passes"] == 11
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "int4"])
def test_a_dense_layer_takes_the_stack(qwen3_path, dtype, quant, monkeypatch):
    """A layer whose MLP is dense (`mlp_only_layers`): its MLP half is one native call
    (`moe.mlp_residual`), the stack takes it (`NativeStack.add_mlp`), bit-identical to the modules,
    for one row and for a batch's steps."""
    import moerun

    net = moerun.load(qwen3_path(mlp_only_layers=[1]), dtype=dtype, threads=1, quant=quant).net
    kv = net.model.embed_tokens.weight.dtype
    ran = counting(monkeypatch)
    with torch.inference_mode():
        want = passes(net, kv, None)
        ran.clear()
        got = passes(net, kv, {})
        assert ran == [False] + [True] * 8
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))
        want = batch_steps(net, None, kv)
        plans = {}
        got = batch_steps(net, plans, kv)
    assert stack.decode_path(plans)["native_stack_passes"] == 11
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_dense_layer_with_hooks_runs_the_modules(qwen3_path, monkeypatch):
    """A forward hook on the dense MLP: the modules call it (the stack and the fused half step aside)."""
    import moerun

    net = moerun.load(qwen3_path(mlp_only_layers=[1]), dtype="float32", threads=1, quant="int4").net
    called = []
    net.model.layers[1].mlp.register_forward_hook(lambda *a: called.append(1))
    ran = counting(monkeypatch)
    with torch.inference_mode():
        passes(net, torch.float32, {})
    assert not any(ran) and len(called) == 9


@pytest.fixture(scope="module")
def qwen3_5_path(tmp_path_factory):
    from test_qwen3_5_moe import make_reference

    path = tmp_path_factory.mktemp("qwen3_5_stack")
    make_reference().save_pretrained(path)
    return path


def qwen3_5_passes(net, plans, slot: int, widths: tuple, seed: int, masks=()) -> tuple:
    """A prompt of 8 into `slot` of a 2-slot cache, then passes of `widths` tokens (every
    token's DeltaNet states kept, as verification keeps them) -> (every pass's logits, with the
    final hidden state where `masks`, the kept states, the route masks of each `masks` experts
    module per pass, the slot's final recurrent states)."""
    from moerun.layers.cache import Cache, RecurrentState

    kv = net.model.embed_tokens.weight.dtype
    n = 8 + sum(widths)
    ids = torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))
    cache = Cache(net.cache_spec(), 2, n + 8, kv)
    rec = [layer for layer in cache.layers if isinstance(layer, RecurrentState)]
    for layer in rec:
        layer.positions = {}
    s = torch.tensor([slot])
    kw = {} if plans is None else {"plans": plans}
    out, kept, seen = [net(ids[:, :8], cache, s, **kw)], [], []
    i = 8
    for T in widths:
        for e in masks:
            e.routes_seen = np.zeros(e.num_experts + 1, dtype=np.uint8)
        got = net(ids[:, i : i + T], cache, s, return_hidden=bool(masks), **kw)
        out += list(got) if masks else [got]
        kept += [t.clone() for layer in rec for t in layer.positions.values()]
        seen += [e.__dict__.pop("routes_seen").copy() for e in masks]
        i += T
    states = [layer.tensors[name][slot].clone() for layer in rec for name in ("conv", "recurrent")]
    return out, kept, seen, states


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "int4"])
@pytest.mark.parametrize("slot", [0, 1])
def test_qwen3_5_stack_keeps_logits_and_states(qwen3_5_path, dtype, quant, slot, monkeypatch):
    """Gated DeltaNet and attention halves: the same logits, recurrent states and per-token
    states kept for a rollback (passes of three) as the modules, in slot 0 (whose states the
    modules update as views) and slot 1 (which they gather and write back)."""
    import moerun

    net = moerun.load(qwen3_5_path, dtype=dtype, threads=1, quant=quant).net
    ran = counting(monkeypatch)

    def run(plans):
        return qwen3_5_passes(net, plans, slot, (1, 3, 1, 3, 1, 3, 1), seed=4)

    with torch.inference_mode():
        want = run(None)
        ran.clear()
        got = run({})
    assert ran == [False] + [True] * 7
    for a, b in zip(got, want):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_bad_token_id_is_an_error_in_the_native_pass_too(qwen3_path):
    """Once the stack runs a decode pass end to end (`model_pass`), a token id outside the
    vocabulary is still nn.Embedding's IndexError (a negative one is not wrapped round by
    numpy's indexing), and the cache does not move."""
    import moerun
    from moerun.layers.cache import Cache

    net = moerun.load(qwen3_path(), dtype="bfloat16", threads=1).net
    cache, s, plans = Cache(net.cache_spec(), 1, 16, torch.bfloat16), torch.tensor([0]), {}
    with torch.inference_mode():
        net(torch.tensor([[1, 2, 3]]), cache, s, plans=plans)
        for t in (4, 5, 6):  # each pass native end to end (the stack built before the first)
            net(torch.tensor([[t]]), cache, s, plans=plans)
        for bad in (-1, CFG["vocab_size"]):
            with pytest.raises(IndexError):
                net(torch.tensor([[bad]]), cache, s, plans=plans)
            assert int(cache.lengths[0]) == 6


def test_native_stack_refuses_bad_arguments(qwen3_path):
    """`NativeStack.run` checks what a pass brings (activations, rope rows, position, the
    kept states and route masks): one clear ValueError each, nothing run."""
    import numpy as np

    import moerun
    from moerun.layers.cache import Cache

    net = moerun.load(qwen3_path(), dtype="float32", threads=1, quant="int4").net
    cache, s, plans = Cache(net.cache_spec(), 1, 16, torch.float32), torch.tensor([0]), {}
    with torch.inference_mode():
        net(torch.tensor([[1, 2, 3]]), cache, s, plans=plans)
        for t in range(2):  # one-token passes: the stack, built before the first
            net(torch.tensor([[4 + t]]), cache, s, plans=plans)
    native, experts, *_ = next(v for k, v in plans.items() if isinstance(k, tuple) and k[0] == "stack"
                               and tuple(k[1][:2]) == (1, 1))
    H = CFG["hidden_size"]
    x, a, b = (np.zeros((1, 1, H), dtype=np.float32) for _ in range(3))
    rope = net.model.rope.float_rows(6, 1, torch.float32)
    seen = [np.zeros(0, dtype=np.uint8)] * len(experts)
    slot, pos = np.array([0]), np.array([6])
    native.run(x, a, b, *rope, slot, pos, [], [], seen)  # as a pass makes it: runs
    native.run(x, a, b, *rope, slot, pos, [], [], [])  # (no route masks at all: the same)

    def bad(match, **change):
        args = dict(x=x, a=a, b=b, cos=rope[0], sin=rope[1], slots=slot, pos=pos, conv_every=[], S_every=[], seen=seen)
        args.update(change)
        with pytest.raises(ValueError, match=match):
            native.run(**args)

    bad("x, a, b", x=np.zeros((1, 2, H), dtype=np.float32))
    bad("x, a, b", b=np.zeros((1, 1, H), dtype=np.float64))
    bad("cos, sin", cos=np.zeros((2, rope[0].shape[1]), dtype=np.float32))
    bad("position outside the cache", pos=np.array([16]))
    bad("a slot outside the cache", slots=np.array([1]))
    bad("slots, pos", slots=np.array([0, 0]))
    bad("slots, pos", pos=np.array([6], dtype=np.int32))
    bad("seen: one per layer", seen=seen[:1])
    bad("seen", seen=[np.zeros(3, dtype=np.uint8)] * len(experts))
    bad("conv_every, S_every", conv_every=[np.zeros(1, dtype=np.float32)])


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None), ("float32", "int4")])
def test_stack_on_two_threads_with_route_masks_is_bit_identical_to_the_modules(qwen3_5_path, dtype, quant):
    """On two threads, passes of 1 to 4 tokens through the stack give the same logits, hidden
    states, recurrent states, per-token states kept for a rollback and route masks as the
    modules."""
    import moerun

    net = moerun.load(qwen3_5_path, dtype=dtype, threads=2, quant=quant).net
    torch.set_num_threads(2)
    experts = [layer.mlp.experts for layer in net.model.layers]

    def run(plans):
        return qwen3_5_passes(net, plans, 1, (1, 2, 4, 2, 4, 3, 2, 1, 4), seed=5, masks=experts)

    try:
        with torch.inference_mode():
            want, got = run(None), run({})
    finally:
        torch.set_num_threads(1)
    for a, c in zip(got, want, strict=True):
        assert len(a) == len(c)
        assert all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, c))


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None), ("float32", "int4")])
def test_a_qwen3_5_batch_step_takes_the_stack_bit_identical_to_the_modules(qwen3_5_path, dtype, quant, monkeypatch):
    """Gated DeltaNet rows at scattered slots: the stack reads and writes each row's states at
    its slot in place, where the modules gather and scatter them; the same logits, hidden
    states and final states."""
    import moerun
    from moerun.layers.cache import RecurrentState

    net = moerun.load(qwen3_5_path, dtype=dtype, threads=1, quant=quant).net
    kv = net.model.embed_tokens.weight.dtype
    ran = counting(monkeypatch)
    states = []
    real_steps = batch_steps

    def run(plans):
        from moerun.layers.cache import Cache

        made = []
        real_init = Cache.__init__

        def keep(self, *a, **k):
            real_init(self, *a, **k)
            made.append(self)

        monkeypatch.setattr(Cache, "__init__", keep)
        out = real_steps(net, plans, kv, seed=12)
        monkeypatch.setattr(Cache, "__init__", real_init)
        states.append([t.clone() for layer in made[0].layers if isinstance(layer, RecurrentState)
                       for t in layer.tensors.values()])
        return out

    with torch.inference_mode():
        want = run(None)
        ran.clear()
        got = run({})
    assert ran == [True, False, True] + [True] * 9
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert len(states[0]) > 0 and all(torch.equal(a, b) for a, b in zip(*states, strict=True))


def verify_passes(net, plans, dtype, rows=((2, 5), (0, 9)), T: int = 3, n: int = 3, seed: int = 13) -> list:
    """Rows prefilled one by one at their slots of a 4-slot cache, then `n` passes of T tokens
    each for all of them together (a batch's verification passes) -> each pass's logits,
    hidden states and the lengths; with one row, that row alone."""
    from moerun.layers.cache import Cache

    g = torch.Generator().manual_seed(seed)
    prompts = {slot: torch.randint(0, CFG["vocab_size"], (1, k), generator=g) for slot, k in ((2, 5), (0, 9))}
    steps = torch.randint(0, CFG["vocab_size"], (2, n * T), generator=g)
    cache = Cache(net.cache_spec(), 4, 40, dtype)
    kw = {} if plans is None else {"plans": plans}
    slots = [slot for slot, _ in rows]
    for slot in slots:
        net(prompts[slot], cache, torch.tensor([slot]), **kw)
    ids = steps[[0 if s == 2 else 1 for s in slots]]
    out = []
    for j in range(n):
        logits, hidden = net(ids[:, j * T : (j + 1) * T], cache, torch.tensor(slots), return_hidden=True, **kw)
        out += [logits, hidden, cache.lengths[slots].clone()]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_verification_pass_takes_the_stack_and_gives_each_row_its_own_bits(qwen3_path, dtype, monkeypatch):
    """Rows of three tokens each (a batch's verification pass): through the stack, the first
    pass of the shape too, the modules' bits, and each row's logits those it gets alone."""
    import moerun

    net = moerun.load(qwen3_path(), dtype=dtype, threads=1, quant="int4").net
    kv = net.model.embed_tokens.weight.dtype
    ran = counting(monkeypatch)
    with torch.inference_mode():
        want = verify_passes(net, None, kv)
        ran.clear()
        got = verify_passes(net, {}, kv)
        assert ran == [True, False, True, True, True]  # (the 5-token prompt fits a pass: the stack)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))
        for r, row in enumerate(((2, 5), (0, 9))):
            alone = verify_passes(net, {}, kv, rows=(row,))
            for j in range(3):
                assert torch.equal(alone[3 * j][0], got[3 * j][r]) and torch.equal(alone[3 * j + 1][0], got[3 * j + 1][r])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_qwen3_5_batch_verification_pass_keeps_each_rows_states(qwen3_5_path, dtype, monkeypatch):
    """A batch's verification passes on Gated DeltaNet layers: the stack keeps every row's
    state after each token (what a rollback restores) and each row's logits, as the row alone."""
    import moerun
    from moerun.layers.cache import RecurrentState

    net = moerun.load(qwen3_5_path, dtype=dtype, threads=1).net
    kv = net.model.embed_tokens.weight.dtype
    ran = counting(monkeypatch)
    kept = []
    real_keep = RecurrentState.keep_every
    monkeypatch.setattr(RecurrentState, "keep_every",
                        lambda self, **st: kept.append({k: v.clone() for k, v in st.items()}) or real_keep(self, **st))
    with torch.inference_mode():
        got = verify_passes(net, {}, kv)
        assert ran[-2:] == [True, True]
        nd = sum(isinstance(m, type(net.model.layers[0].linear_attn)) for m in net.modules())
        batch_kept = kept[-3 * nd :]  # the three verification passes' (a state per DeltaNet layer each)
        assert nd > 0 and len(batch_kept) == 3 * nd
        for r, row in enumerate(((2, 5), (0, 9))):
            kept.clear()
            alone = verify_passes(net, {}, kv, rows=(row,))
            for j in range(3):
                assert torch.equal(alone[3 * j][0], got[3 * j][r])
            for a, b in zip(kept[-3 * nd :], batch_kept, strict=True):
                assert set(a) == {"conv", "recurrent"} and all(torch.equal(a[k][0], b[k][r]) for k in a)


def test_info_says_how_decode_steps_run(qwen3_path, capsys):
    """`moerun info` runs a few decode steps and says whether they took the native stack,
    and if not which piece kept them off it."""
    import json

    from moerun.cli import main

    def info(path, *flags):
        assert main(["info", "-m", str(path), "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["decode_path"]

    assert info(qwen3_path(), "--quant", "int4")["native_stack_passes"] > 0
    assert info(qwen3_path(mlp_only_layers=[1]), "--quant", "int4")["native_stack_passes"] > 0  # a dense half too
    int8 = info(qwen3_path(), "--kv-cache", "int8")
    assert int8["native_stack_passes"] == 0 and "attention half" in int8["why"]
    assert main(["info", "-m", str(qwen3_path()), "--kv-cache", "int8"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("decode path"))
    assert "the layers' modules" in line and "attention half" in line
