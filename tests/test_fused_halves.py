"""The fused halves of a decoder layer, each one native call in decode: the MoE half
(`layers.moe.moe_residual`, `kernels.moe_block_run`) and Qwen3.5's linear-attention half
(`GatedDeltaNet.residual`, `kernels.deltanet_block`). Bit-identical to the modules one by
one, hooks still served, fallbacks where they cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moerun import kernels
from moerun.layers import moe
from moerun.layers.moe import Experts, GatedMLP, moe_residual, softmax_topk
from moerun.layers.norm import RMSNorm
from moerun.layers.quantized import QuantizedExperts, QuantizedLinear

pytestmark = pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
NATIVE = [i for i in kernels.available_isas() if i != "torch"]


class Block(nn.Module):
    """A softmax top-k MoE block as the model files write one (Qwen3, and Qwen3.5 / Qwen2-MoE
    with `shared`)."""

    def __init__(self, H, E, I, K, renorm, shared):
        super().__init__()
        self.top_k, self.norm_topk_prob = K, renorm
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = Experts(E, H, I)
        if shared:
            self.shared_expert = GatedMLP(H, 2 * I)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        weights, ids = softmax_topk(self.gate, h, self.top_k, self.norm_topk_prob)
        out = self.experts(h, ids, weights)
        if hasattr(self, "shared_expert"):
            out = out + self.shared_expert.gated(h, self.shared_expert_gate)
        return out.view_as(x)


def make(dtype, experts="float", shared=True, shared_fmt=None, renorm=True, zero_centered=True, H=96, E=8, I=48, K=3,
         seed=0):
    torch.manual_seed(seed)
    block = Block(H, E, I, K, renorm, shared)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    norm = RMSNorm(H, 1e-6, zero_centered=zero_centered)
    with torch.no_grad():
        norm.weight.normal_(0 if zero_centered else 1, 0.1)
    norm, block = norm.to(dtype), block.to(dtype)
    if experts != "float":
        block.experts = QuantizedExperts.from_experts(block.experts, experts)
    if shared and shared_fmt:
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(block.shared_expert, name, QuantizedLinear.from_linear(getattr(block.shared_expert, name), shared_fmt))
    return norm, block


def run(x, norm, block, fused: bool, monkeypatch, op: str = "moe_block_run", fusable: str = "moe_fusable"):
    """moe_residual with the fusion allowed or not -> (output, how many fused calls ran).
    `op`/`fusable`: the fused op counted and the check that allows it (a dense MLP's:
    "mlp_block_run", "mlp_fusable")."""
    calls = []
    real = getattr(kernels, op)

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(kernels, op, counted)
        if not fused:
            m.setattr(moe, fusable, lambda *a: None)
        with torch.inference_mode():
            return moe_residual(x, norm, block), len(calls)


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,shared,shared_fmt", [("float", True, None), ("float", False, None),
                                                        ("int4", True, "int8"), ("int8", False, None),
                                                        ("int4", True, None)])
@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 2), (1, 16), "last"])
def test_fused_block_is_bit_identical(isa, dtype, experts, shared, shared_fmt, shape, monkeypatch):
    norm, block = make(dtype, experts, shared, shared_fmt)
    check_fused_bits(isa, dtype, shape, norm, block, monkeypatch)


def check_fused_bits(isa, dtype, shape, norm, block, monkeypatch, *dense):
    """`run` of an input of `shape` ((rows, tokens), or "last": the last position of 2 rows of
    3, an MTP catch-up call, not contiguous) with the fusion off, then on: one fused call, the
    same bits. `dense`: `run`'s op and check for a dense MLP."""
    if shape == "last":
        x = (torch.randn(2, 3, 96) * 2).to(dtype)[:, -1:]
    else:
        x = (torch.randn(*shape, 96) * 2).to(dtype)
    with kernels.use_isa(isa):
        want, n0 = run(x, norm, block, False, monkeypatch, *dense)
        got, n1 = run(x, norm, block, True, monkeypatch, *dense)
    assert (n0, n1) == (0, 1)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("renorm,zero_centered", [(False, False), (True, False), (False, True)])
def test_fused_block_norm_and_routing_variants(renorm, zero_centered, monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        norm, block = make(dtype, "float", False, renorm=renorm, zero_centered=zero_centered, E=16, K=4)
        x = torch.randn(1, 2, 96).to(dtype)
        want, _ = run(x, norm, block, False, monkeypatch)
        got, n = run(x, norm, block, True, monkeypatch)
        assert n == 1 and torch.equal(got, want)


def test_experts_pre_hooks_see_what_the_modules_would_pass(monkeypatch):
    """An expert tracker's pre-hook gets the same (h, ids, weights) from the fused call."""
    norm, block = make(torch.bfloat16)
    x = torch.randn(1, 3, 96).to(torch.bfloat16)
    seen = []
    handle = block.experts.register_forward_pre_hook(lambda m, args: seen.append(args))
    kw = block.experts.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args), with_kwargs=True)
    want, n0 = run(x, norm, block, False, monkeypatch)
    got, n1 = run(x, norm, block, True, monkeypatch)
    handle.remove(), kw.remove()
    assert (n0, n1) == (0, 1) and torch.equal(got, want)
    assert len(seen) == 4
    for a, b in ((seen[0], seen[2]), (seen[1], seen[3])):
        assert all(torch.equal(u, v) and u.dtype == v.dtype for u, v in zip(a, b))


def make_deepseek(dtype, experts="float", n_group=4, topk_group=2, renorm=True, shared=1, E=16, K=4, H=96, seed=0):
    """DeepSeek-V3's MoE block (grouped sigmoid routing with a selection bias, shared experts
    without a gate) and its post-attention norm."""
    from moerun.models.deepseek_v3 import MoE, ModelArgs

    a = ModelArgs(model_type="deepseek_v3", vocab_size=11, hidden_size=H, intermediate_size=64,
                  moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, n_routed_experts=E,
                  num_experts_per_tok=K, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                  n_group=n_group, topk_group=topk_group, norm_topk_prob=renorm, n_shared_experts=shared,
                  routed_scaling_factor=2.5)
    torch.manual_seed(seed)
    block = MoE(a)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        block.gate.e_score_correction_bias.normal_(0, 0.1)
    norm = RMSNorm(H, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    norm = norm.to(dtype)
    for name, m in block.named_children():  # the loader keeps the router's weight and bias in float32
        if name != "gate":
            m.to(dtype)
    if experts != "float":
        block.experts = QuantizedExperts.from_experts(block.experts, experts)
    return norm, block


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,groups,renorm,shared", [("float", (4, 2), True, 1), ("float", (1, 1), False, 0),
                                                          ("int4", (8, 3), True, 2), ("int8", (2, 1), False, 1)])
@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 2), (1, 16)])
def test_fused_deepseek_block_is_bit_identical(isa, dtype, experts, groups, renorm, shared, shape, monkeypatch):
    """DeepSeek-V3's MoE half (grouped sigmoid routing) as one native call: the bits of its
    modules one by one (their router the native routing op too, `kernels.route_sigmoid_grouped`)."""
    norm, block = make_deepseek(dtype, experts, *groups, renorm, shared)
    x = (torch.randn(*shape, 96) * 2).to(dtype)
    with kernels.use_isa(isa):
        want, n0 = run(x, norm, block, False, monkeypatch)
        got, n1 = run(x, norm, block, True, monkeypatch)
    assert (n0, n1) == (0, 1)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)


def test_fused_deepseek_block_against_its_torch_reference(monkeypatch):
    """The fused half against the module's torch forward (the reference router, torch's expert
    loop): float32 summation order only, and the same experts picked."""
    from moerun.kernels.reference import expert_mlp

    norm, block = make_deepseek(torch.float32)
    x = torch.randn(1, 3, 96) * 2
    got, n = run(x, norm, block, True, monkeypatch)
    with torch.inference_mode():
        h = norm(x).reshape(3, 96)
        rw, rids = kernels.route_sigmoid_grouped_ref(h, block.gate.weight, 4, True, block.gate.routing())
        w, ids = kernels.route_sigmoid_grouped(h, block.gate.weight, 4, True, block.gate.routing())
        e = block.experts
        ref = expert_mlp(h, rids, rw, e.gate_proj, e.up_proj, e.down_proj)
        g, u = F.linear(h, block.shared_experts.gate_proj.weight), F.linear(h, block.shared_experts.up_proj.weight)
        ref = x + (ref + F.linear(F.silu(g) * u, block.shared_experts.down_proj.weight)).view_as(x)
    assert n == 1 and torch.equal(ids, rids)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_deepseek_route_observer_sees_what_the_modules_route(monkeypatch):
    """A route observer on DeepSeek-V3's experts gets the same (h, ids, weights) from the fused
    call as from the modules."""
    from moerun.layers.routes import observe_routes

    norm, block = make_deepseek(torch.bfloat16)
    x = torch.randn(1, 2, 96).to(torch.bfloat16)
    seen = []
    handle = observe_routes(block.experts, lambda *a: seen.append(tuple(t.clone() for t in a)))
    want, n0 = run(x, norm, block, False, monkeypatch)
    got, n1 = run(x, norm, block, True, monkeypatch)
    handle.remove()
    assert (n0, n1) == (0, 1) and torch.equal(got, want)
    assert len(seen) == 2
    assert all(torch.equal(u, v) and u.dtype == v.dtype for u, v in zip(*seen, strict=True))
    assert seen[0][1].shape == (2, 4) and seen[0][2].dtype == torch.bfloat16


def make_dense(dtype, fmt=None, H=96, I=160, zero_centered=False, seed=0):
    torch.manual_seed(seed)
    mlp = GatedMLP(H, I)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.1)
    norm = RMSNorm(H, 1e-6, zero_centered=zero_centered)
    with torch.no_grad():
        norm.weight.normal_(0 if zero_centered else 1, 0.1)
    norm, mlp = norm.to(dtype), mlp.to(dtype)
    if fmt:
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, QuantizedLinear.from_linear(getattr(mlp, name), fmt))
    return norm, mlp


DENSE = ("mlp_block_run", "mlp_fusable")  # `run`'s op and check for a dense MLP (`mlp_residual`)


def run_dense(x, norm, mlp, fused: bool, monkeypatch):
    return run(x, norm, mlp, fused, monkeypatch, *DENSE)


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,zero_centered", [(None, False), ("int4", True), ("int8", False)])
@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 2), (1, 16), "last"])
def test_fused_dense_mlp_is_bit_identical(isa, dtype, fmt, zero_centered, shape, monkeypatch):
    """A dense MLP half (DeepSeek-V3's first layers, Qwen3-MoE's mlp_only_layers) as one native
    call (`kernels.mlp_block_run`): the bits of the norm, the MLP and the add one by one."""
    norm, mlp = make_dense(dtype, fmt, zero_centered=zero_centered)
    check_fused_bits(isa, dtype, shape, norm, mlp, monkeypatch, *DENSE)


@pytest.mark.parametrize("isa", NATIVE)
def test_fused_dense_mlp_against_its_torch_reference(isa, monkeypatch):
    norm, mlp = make_dense(torch.float32)
    x = torch.randn(1, 3, 96) * 2
    with kernels.use_isa(isa):
        got, n = run_dense(x, norm, mlp, True, monkeypatch)
    with torch.no_grad():
        ref = kernels.mlp_block_ref(x, norm.weight, 1e-6, mlp.gate_proj.weight, mlp.up_proj.weight,
                                    mlp.down_proj.weight)
    assert n == 1 and float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_dense_mlp_falls_back_where_it_cannot_fuse(monkeypatch):
    """Hooks on the norm, the MLP or one of its linears, autograd, a prompt-sized pass: the
    modules one by one."""
    norm, mlp = make_dense(torch.float32)
    x = torch.randn(1, 2, 96)
    assert run_dense(x, norm, mlp, True, monkeypatch)[1] == 1
    assert run_dense(torch.randn(1, 64, 96), norm, mlp, True, monkeypatch)[1] == 0
    for m in (norm, mlp, mlp.down_proj):
        h = m.register_forward_hook(lambda *a: None)
        assert run_dense(x, norm, mlp, True, monkeypatch)[1] == 0
        h.remove()
    assert run_dense(x, norm, mlp, True, monkeypatch)[1] == 1
    with torch.enable_grad():
        y = moe_residual(x, norm, mlp)
    assert y.requires_grad


def test_mlp_block_refuses_bad_arguments():
    nat = kernels._native()
    norm, mlp = make_dense(torch.float32, "int4")
    views = mlp._packed_views(torch.zeros(1, 96))
    args = kernels.mlp_block_args(*kernels.norm_args(norm), views)
    x, out = torch.randn(2, 96), torch.empty(2, 96)
    nat.mlp_block(x.numpy(), *args, out.numpy())
    for bad_out, msg in ((torch.empty(3, 96), "out"), (torch.empty(2, 96, dtype=torch.bfloat16), "both float32")):
        with pytest.raises(ValueError, match=msg):
            nat.mlp_block(x.numpy(), *args, kernels._np(bad_out))
    with pytest.raises(ValueError, match="norm_w"):
        nat.mlp_block(x.numpy(), torch.zeros(95).numpy(), *args[1:], out.numpy())
    with pytest.raises(ValueError, match="down"):  # down's rows must be H
        nat.mlp_block(x.numpy(), *args[:9], *kernels.mlp_block_args(*kernels.norm_args(norm), (views[0],) * 3)[9:],
                      out.numpy())


def test_a_hook_that_changes_arguments_is_refused(monkeypatch):
    norm, block = make(torch.float32)
    block.experts.register_forward_pre_hook(lambda m, args: (args[0] * 2, args[1], args[2]))
    with pytest.raises(RuntimeError, match="returned new arguments"):
        run(torch.randn(1, 1, 96), norm, block, True, monkeypatch)


def test_falls_back_where_it_cannot_fuse(monkeypatch):
    """Hooks on the norm, router or block, forward hooks on the experts, more rows than a
    decode pass, autograd, a dense MLP, a norm of another dtype: the modules one by one."""
    x = torch.randn(1, 2, 96)
    cases = []
    for where in ("norm", "gate", "block"):
        norm, block = make(torch.float32)
        {"norm": norm, "gate": block.gate, "block": block}[where].register_forward_pre_hook(lambda m, a: None)
        cases.append((x, norm, block))
    norm, block = make(torch.float32)
    block.experts.register_forward_hook(lambda m, a, o: None)
    cases.append((x, norm, block))
    norm, block = make(torch.float32)
    cases.append((torch.randn(1, 17, 96), norm, block))
    cases.append((x, norm, GatedMLP(96, 64)))
    norm, block = make(torch.float32)
    cases.append((x, norm.to(torch.bfloat16), block))
    for xi, norm, block in cases:
        got, n = run(xi, norm, block, True, monkeypatch)
        assert n == 0
        if xi.dtype == norm.weight.dtype:  # (the mixed case: only that it is not fused)
            with torch.inference_mode():
                assert torch.equal(got, xi + block(norm(xi)))
    norm, block = make(torch.float32)
    calls = []
    monkeypatch.setattr(kernels, "moe_block_run", lambda *a, **k: calls.append(1))
    y = moe_residual(x, norm, block)  # autograd on
    assert not calls and y.requires_grad


def test_a_changed_block_is_seen(monkeypatch):
    """The fused call's plan (kept on the block) follows new weights, swapped modules and
    hooks added later."""
    norm, block = make(torch.bfloat16)
    x = torch.randn(1, 1, 96).to(torch.bfloat16)

    def check(fused_calls):
        got, n = run(x, norm, block, True, monkeypatch)
        want, _ = run(x, norm, block, False, monkeypatch)
        assert n == fused_calls and torch.equal(got, want)
        return got

    first = check(1)
    block.gate.weight = nn.Parameter(torch.randn_like(block.gate.weight))  # a new router
    assert not torch.equal(check(1), first)
    with torch.no_grad():
        block.experts.down_proj.data = block.experts.down_proj.data * 2  # .data replaced
        norm.weight.data = norm.weight.data + 0.5
    check(1)
    block.experts = QuantizedExperts.from_experts(block.experts, "int4")  # a swapped module
    before = check(1)
    norm.eps, block.top_k = 0.5, 2  # settings the plan keeps are part of its key
    assert not torch.equal(check(1), before)
    handle = block.shared_expert.up_proj.register_forward_hook(lambda m, a, o: None)
    check(0)  # the shared expert's linears are called one by one then (torch's product)
    handle.remove()
    check(1)


def test_native_op_refuses_bad_arguments():
    nat = kernels._native()
    norm, block = make(torch.float32, shared=False, E=4, K=2)
    with torch.no_grad():
        views = block.experts.fused_views(torch.zeros(1, 96))
    x, out, e = torch.randn(1, 96), torch.empty(1, 96), torch.empty(0)
    w, r = kernels._np(kernels.float32_weight(norm)), kernels._np(block.gate.weight)
    empty, ids0 = e.numpy(), torch.empty(0, dtype=torch.int64).numpy()

    no_mask = torch.empty(0, dtype=torch.uint8).numpy()

    def call(router=r, k=2, o=out, ex=views, seen=no_mask):
        nat.moe_block(x.numpy(), w, 1e-6, 1.0, router, k, True, empty, 1, 1, 1.0, *ex, [], [], [], empty, kernels._np(o), empty, ids0,
                      empty, seen)

    call()
    seen = torch.zeros(5, dtype=torch.uint8)
    call(seen=seen.numpy())  # a route mask: the K routed experts marked, K at [E]
    assert int(seen[:4].sum()) == 2 and int(seen[4]) == 2
    for bad, msg in (({"k": 5}, "K must be"), ({"router": r[:3]}, "as many as the router"),
                     ({"o": torch.empty(1, 96, dtype=torch.bfloat16)}, "both float32 or both bf16"),
                     ({"o": torch.empty(2, 96)}, "out"),
                     ({"ex": views._replace(code=16)}, "bf16 as uint16"),
                     ({"seen": torch.zeros(4, dtype=torch.uint8).numpy()}, "seen"),
                     ({"seen": torch.zeros(5, dtype=torch.int32).numpy()}, "seen: must be uint8")):
        with pytest.raises(ValueError, match=msg):
            call(**bad)


# -- the linear-attention half (Qwen3.5) ----------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_5_path(tmp_path_factory):
    from test_qwen3_5_moe import make_reference

    path = tmp_path_factory.mktemp("qwen3_5_fused")
    make_reference().save_pretrained(path)
    return path


def decode_run(net, dtype, B=2, slots=(2, 0)):
    """Prefill two rows into slots (2, 0) of a 3-slot cache (not a range: the states are
    gathered), then one-token steps and passes of three (a verification pass, which keeps
    every token's state) -> (logits, the recurrent layers' states and kept states)."""
    from moerun.layers.cache import Cache, RecurrentState

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (B, 16), generator=g)
    cache = Cache(net.cache_spec(), 3, 24, dtype)
    rec = [layer for layer in cache.layers if isinstance(layer, RecurrentState)]
    for layer in rec:
        layer.positions = {}
    s = torch.tensor(slots)
    out = [net(ids[:, :8], cache, s)[:, -1]]
    for i, T in ((8, 1), (9, 3), (12, 1), (13, 3)):
        out.append(net(ids[:, i : i + T], cache, s).reshape(B, -1))
    states = [t.clone() for layer in rec for t in (layer.get("conv", s), layer.get("recurrent", s), *layer.positions.values())]
    return out, states


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "int4", "int8"])
def test_deltanet_half_is_bit_identical(qwen3_5_path, dtype, quant, monkeypatch):
    import moerun
    from moerun.models import qwen3_5_moe

    net = moerun.load(qwen3_5_path, dtype=dtype, threads=1, quant=quant).net
    calls = []
    real = kernels.deltanet_block
    monkeypatch.setattr(kernels, "deltanet_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        got, got_states = decode_run(net, net.model.embed_tokens.weight.dtype)
        n = len(calls)
        monkeypatch.setattr(qwen3_5_moe.GatedDeltaNet, "_fusable", lambda *a: None)
        want, want_states = decode_run(net, net.model.embed_tokens.weight.dtype)
    layers = sum(t == "linear_attention" for t in net.args.layer_types)
    assert n == 5 * layers and len(calls) == n  # every pass (the prefill of 8 tokens too: FEW)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(got_states) == len(want_states) and all(torch.equal(a, b) for a, b in zip(got_states, want_states))


def test_deltanet_half_serves_hooks_and_falls_back(qwen3_5_path, monkeypatch):
    """A hook on the DeltaNet layer, its norm or out_proj: the modules one by one (and the
    hook sees its call); without one, fused; the same logits either way."""
    import moerun

    net = moerun.load(qwen3_5_path, dtype="float32", threads=1).net
    layer = next(m for m in net.model.layers if m.layer_type == "linear_attention")
    calls = []
    real = kernels.deltanet_block
    monkeypatch.setattr(kernels, "deltanet_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        want, _ = decode_run(net, torch.float32)
        fused = len(calls)
        for module in (layer.linear_attn, layer.input_layernorm, layer.linear_attn.out_proj):
            seen = []
            handle = module.register_forward_hook(lambda m, a, o: seen.append(1))
            calls.clear()
            got, _ = decode_run(net, torch.float32)
            handle.remove()
            assert len(calls) == fused - 5 and len(seen) >= 5  # that layer's passes went unfused
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        # new weights after a fused call: the plan kept on the layer follows them
        la = layer.linear_attn
        la.out_proj.weight = nn.Parameter(la.out_proj.weight * 3)
        with torch.no_grad():
            la.in_proj_z.weight.data = la.in_proj_z.weight.data * -1
        calls.clear()
        got, _ = decode_run(net, torch.float32)
        assert len(calls) == fused
        monkeypatch.setattr(type(la), "_fusable", lambda *a: None)
        want2, _ = decode_run(net, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(got, want2)) and not torch.equal(got[-1], want[-1])


def test_deltanet_block_refuses_bad_arguments(qwen3_5_path):
    import moerun
    from moerun.layers.linear import packed_views
    from moerun.models.qwen3_5_moe import DELTA_WEIGHTS

    net = moerun.load(qwen3_5_path, dtype="float32", threads=1).net
    layer = next(m for m in net.model.layers if m.layer_type == "linear_attention")
    la, nat = layer.linear_attn, kernels._native()
    x = torch.randn(1, 1, net.args.hidden_size)
    with torch.no_grad():
        proj = packed_views(la.in_proj_qkv, la.in_proj_z, la.in_proj_a, la.in_proj_b, x=x)
        o = kernels.float_linear_views(la.out_proj)
    views = kernels.native_views(la, DELTA_WEIGHTS, kernels.deltanet_weight_views)
    C, K = la.conv1d.weight.shape[0], la.conv1d.weight.shape[-1]
    conv, S = torch.zeros(1, C, K - 1), torch.zeros(1, la.n_v, la.dk, la.dv)

    def call(out=None, p=proj, conv=conv):
        out = torch.empty_like(x) if out is None else out
        nat.deltanet_block(x.numpy(), kernels._np(kernels.float32_weight(layer.input_layernorm)), 1.0, 1e-6,
                           [q.w for q in p], [q.s for q in p], [q.code for q in p], o.w, o.s, o.code, views[0],
                           conv.numpy(), None, views[1], views[2], S.numpy(), None, views[3], 1e-6,
                           kernels._np(out), la.n_k)

    call()
    for bad, msg in (({"out": torch.empty(1, 1, x.shape[-1], dtype=torch.bfloat16)}, "both float32 or both bf16"),
                     ({"p": proj[:3]}, "in_proj_qkv, in_proj_z"), ({"conv": torch.zeros(1, C, K)}, "conv"),
                     ({"p": (proj[0], proj[2], proj[2], proj[3])}, "in_proj_z")):
        with pytest.raises(ValueError, match=msg):
            call(**bad)


# -- the attention half (fused attention with its input norm and residual) -------------------

def _separate_norm_and_add(x, norm, attn, cos_sin, kv, slots, pos0):
    """x + the fused attention's call on norm(x), the norm and the add apart from it."""
    from moerun.layers import attention

    h = norm(x)
    if not (attention.attention_fuses(attn) and attention.fused_attention_applies(h, kv)):
        return x + attn(h, cos_sin, kv, slots, pos0)
    return x + attention.fused_attention(attn, h, cos_sin, kv, slots, pos0, kernels.fused_call_plan(attn))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "int4"])
def test_attention_half_is_bit_identical(qwen3_5_path, dtype, quant, monkeypatch):
    """One row (the fused attention's passes): with the norm and the add in its call, the
    same logits and states as the attention's fused call between a separate norm and add."""
    import moerun
    from moerun.models import qwen3_5_moe

    net = moerun.load(qwen3_5_path, dtype=dtype, threads=1, quant=quant).net
    calls = []
    real = kernels._native().attn_block_decode
    nat = kernels._native()

    class Spy:  # counts the native calls given an input norm
        def __getattr__(self, name):
            if name != "attn_block_decode":
                return getattr(nat, name)
            return lambda *a, **k: (calls.append(len(a) > 25), real(*a, **k))[1]

    kv_dtype = net.model.embed_tokens.weight.dtype
    with torch.inference_mode():
        monkeypatch.setitem(kernels._state, "native", Spy())
        got, got_states = decode_run(net, kv_dtype, B=1, slots=(1,))
        halves = sum(calls)
        monkeypatch.setattr(qwen3_5_moe, "attn_residual", _separate_norm_and_add)
        calls.clear()
        want, want_states = decode_run(net, kv_dtype, B=1, slots=(1,))
    layers = sum(t == "full_attention" for t in net.args.layer_types)
    assert halves == 4 * layers and not any(calls) and len(calls) == 4 * layers  # 4 one-row passes of <= 5 tokens
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got_states, want_states))
