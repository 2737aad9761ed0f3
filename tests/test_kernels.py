"""Every native op against its torch reference, on every kernel path this CPU has.

Tolerances (errors relative to the reference's largest magnitude):
- qlinear, native vs the reference that reproduces its arithmetic (int8 activations,
  integer block dot products): 1e-5, float summation order only, both formats.
- moe_experts, same reference: the hidden activation is quantized a second time, and a
  float rounding difference can move one value across an int8 rounding boundary, so
  max 1e-2 and 1e-4 in norm (relative Frobenius error).
- against the float product with the unquantized weights (Gaussian weights, the worst case
  for block formats): int8 2e-2 and int4 0.2 in norm.
- attn_decode (float32 throughout) against its grouped-matmul reference: 1e-5, summation
  order and the kernel's exp polynomial (relative error ~2e-7) only.
- moe_experts_float (float32 or bf16 weights, float32 activations) against `expert_mlp` in
  float32 on the same weights: 1e-5, summation order only; bf16 weights on the avx512bf16
  path 3e-5: activations that are not bf16 values run as two bf16 halves, each within 2^-17
  of its value (`float_tol`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from moerun import kernels
from moerun.kernels.reference import expert_mlp
from moerun.layers.moe import Experts
from moerun.layers import attention
from moerun.layers.linear import native_float_linears
from moerun.kernels import formats
from moerun.layers.quantized import QuantizedExperts, QuantizedLinear


@contextlib.contextmanager
def torch_attention():
    """The attention modules' own forward, the torch reference the fused block is checked
    against: `layers.attention.attention_fuses` says no to every module meanwhile."""
    real = attention.attention_fuses
    attention.attention_fuses = lambda m: False
    try:
        yield
    finally:
        attention.attention_fuses = real


def fused_attentions(net) -> int:
    """How many of net's attention modules the fused block takes (`attention_fuses`)."""
    return sum(attention.attention_fuses(m) for m in net.modules())


NATIVE = [i for i in kernels.available_isas() if i != "torch"]
FMTS = ["int4", "int8"]
FLOAT_TOL = {"int4": 0.2, "int8": 2e-2}


def float_tol(isa: str, dtype: torch.dtype) -> float:
    """Float-weight products against float32 torch on the same weights: summation order only,
    but for bf16 weights on the avx512bf16 path, whose vdpbf16ps products take float32
    activations as two bf16 halves (x = hi + lo, lo within 2^-17 of what is left)."""
    return 3e-5 if isa in ("avx512bf16", "amx") and dtype == torch.bfloat16 else 1e-5  # amx: where the CPU has it


def max_rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def norm_rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_native_extension_loaded():
    # the build is part of the package: a missing extension is a failure, not a skip
    assert NATIVE, "moerun._native did not load"
    assert kernels.isa() in NATIVE
    assert kernels.describe().startswith("native")


def test_force_torch_path():
    with kernels.use_isa("torch"):
        assert kernels.isa() == "torch"
    assert kernels.isa() != "torch"
    with pytest.raises(RuntimeError):
        kernels.set_isa("avx9000")


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,K,N", [(1, 32, 4), (1, 100, 37), (1, 300, 37), (1, 512, 9), (3, 64, 5), (7, 257, 33),
                                   (64, 512, 130)])
def test_qlinear(isa, fmt, M, K, N):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(M, K, generator=g)
    q, s = formats.quantize(w, fmt)
    ref = kernels.qlinear_ref(x, q, s, fmt, K)
    with kernels.use_isa(isa):
        y = kernels.qlinear(x, q, s, fmt, K)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert max_rel(y, ref) < 1e-5
    assert norm_rel(y, x @ w.T) < FLOAT_TOL[fmt]


needs_amx = pytest.mark.skipif("amx" not in NATIVE, reason="this CPU has no AMX tiles (or Linux did not grant them)")


@needs_amx
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,K,N", [(16, 256, 16), (17, 300, 33), (40, 2048, 70), (100, 768, 130), (64, 520, 5)])
def test_qlinear_amx_tiles_equal_vnni(fmt, M, K, N):
    """The AMX path (tiles of 16 or more tokens; whole groups of 8 blocks on tiles, the tail
    blocks as the other kernels add them; partial row and token tiles) gives the bits of the
    512-bit kernel, which gives those of a decode step for each token."""
    g = torch.Generator().manual_seed(M + K + N)
    q, s = formats.quantize(torch.randn(N, K, generator=g) * 0.05, fmt)
    x = torch.randn(M, K, generator=g)
    with kernels.use_isa("amx"):
        y = kernels.qlinear(x, q, s, fmt, K).clone()
    with kernels.use_isa("avx512vnni"):
        v = kernels.qlinear(x, q, s, fmt, K).clone()
        one = torch.cat([kernels.qlinear(x[t : t + 1], q, s, fmt, K).clone() for t in range(M)])
    assert torch.equal(y, v)
    assert torch.equal(y, one)
    assert max_rel(y, kernels.qlinear_ref(x, q, s, fmt, K)) < 1e-5


@needs_amx
@pytest.mark.parametrize("fmt", FMTS)
def test_moe_experts_amx_tiles_equal_vnni(fmt):
    """Experts with 16 or more tokens each (their tokens gathered by index) on AMX tiles: the
    same bits as the 512-bit kernel."""
    g = torch.Generator().manual_seed(5)
    T, H, I, E, K = 80, 512, 96, 4, 2
    qe = QuantizedExperts.from_experts(_experts(E, H, I, seed=3), fmt)
    x = torch.randn(T, H, generator=g)
    ids, w = _route(T, E, K, g)
    assert int(torch.bincount(ids.flatten(), minlength=E).min()) >= 16
    with kernels.use_isa("amx"):
        y = qe(x, ids, w).clone()
    with kernels.use_isa("avx512vnni"):
        v = qe(x, ids, w).clone()
    assert torch.equal(y, v)


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("threads", [1, 2])
def test_qlinear_threads_agree(isa, threads):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(300, 96, generator=g), torch.randn(20, 96, generator=g)
    q, s = formats.quantize(w, "int4")
    before = torch.get_num_threads()
    try:
        with kernels.use_isa(isa):
            torch.set_num_threads(1)
            one = kernels.qlinear(x, q, s, "int4", 96)
            torch.set_num_threads(threads)
            many = kernels.qlinear(x, q, s, "int4", 96)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)  # tiles never split a dot product: bitwise the same


def _experts(E, H, I, seed):
    ex = Experts(E, H, I)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return ex


def _route(T, E, K, g):
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("T,H,I,E,K", [(1, 64, 32, 4, 2), (1, 100, 70, 9, 3), (5, 96, 40, 6, 6), (150, 128, 96, 16, 4)])
def test_moe_experts(isa, fmt, T, H, I, E, K):
    g = torch.Generator().manual_seed(T + H + I + E + K)
    ex = _experts(E, H, I, seed=T + E)
    qe = QuantizedExperts.from_experts(ex, fmt)
    x = torch.randn(T, H, generator=g)
    ids, w = _route(T, E, K, g)
    with kernels.use_isa("torch"):
        ref = qe(x, ids, w)
    with kernels.use_isa(isa):
        y = qe(x, ids, w)
    assert y.shape == (T, H)
    assert max_rel(y, ref) < 1e-2
    assert norm_rel(y, ref) < 1e-4
    with torch.no_grad():
        assert norm_rel(y, ex(x, ids, w)) < FLOAT_TOL[fmt]


@pytest.mark.skipif(not NATIVE, reason="needs the native extension")
@pytest.mark.parametrize("fmt", ["int4", "bfloat16"])
def test_long_expert_passes_run_in_calls_of_bounded_tokens(fmt, monkeypatch):
    """Past EXPERT_TOKENS_PER_CALL tokens the experts ops run in several native calls (their
    workspace grows with the tokens of a call): the same bits as one call."""
    g = torch.Generator().manual_seed(11)
    ex = _experts(8, 64, 48, seed=11)
    x = torch.randn(23, 64, generator=g)
    ids, w = _route(23, 8, 3, g)
    if fmt == "int4":
        qe = QuantizedExperts.from_experts(ex, fmt)
        args = (qe.gate_q, qe.gate_scales, qe.up_q, qe.up_scales, qe.down_q, qe.down_scales, fmt, 48)
        run = lambda: kernels.moe_experts(x, ids, w, *args)  # noqa: E731
    else:
        weights = [p.detach().bfloat16() for p in (ex.gate_proj, ex.up_proj, ex.down_proj)]
        run = lambda: kernels.moe_experts_float(x.bfloat16(), ids, w, *weights, dtype=torch.bfloat16)  # noqa: E731
    calls = []
    nat = kernels._native()
    name = "moe_experts" if fmt == "int4" else "moe_experts_float"
    real = getattr(nat, name)
    one = run()
    monkeypatch.setattr(kernels, "EXPERT_TOKENS_PER_CALL", 5)

    class Counting:  # the extension module's attributes are read-only: count through a stand-in
        def __getattr__(self, a):
            return getattr(nat, a)

    counting = Counting()
    setattr(counting, name, lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(kernels, "_native", lambda: counting)
    split = run()
    assert calls == [5, 5, 5, 5, 3]
    assert torch.equal(split, one)


@pytest.mark.parametrize("isa", NATIVE)
def test_moe_experts_bf16_in_out(isa):
    g = torch.Generator().manual_seed(3)
    ex = _experts(8, 64, 64, seed=3)
    qe = QuantizedExperts.from_experts(ex, "int4")
    x = torch.randn(3, 64, generator=g)
    ids, w = _route(3, 8, 2, g)
    with kernels.use_isa(isa):
        y32 = qe(x, ids, w)
        y16 = qe(x.bfloat16(), ids, w.bfloat16())
    assert y16.dtype == torch.bfloat16
    assert norm_rel(y16, y32) < 2e-2


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,I,E,K", [(1, 64, 32, 4, 2), (1, 100, 70, 9, 3), (5, 7, 45, 6, 6), (16, 256, 96, 16, 4),
                                       (24, 64, 48, 8, 4)])  # 96 pairs: past one pool job's (kChainedPairs)
def test_moe_experts_float(isa, dtype, T, H, I, E, K):
    g = torch.Generator().manual_seed(T + H + I + E + K)
    ex = _experts(E, H, I, seed=T + E).to(dtype)
    x = torch.randn(T, H, generator=g)
    ids, w = _route(T, E, K, g)
    weights = (ex.gate_proj.detach(), ex.up_proj.detach(), ex.down_proj.detach())
    with torch.no_grad():
        ref = kernels.moe_experts_float_ref(x, ids, w, *weights)
    with kernels.use_isa(isa):
        y = kernels.moe_experts_float(x, ids, w, *weights)
        # one token per call gives the same bits (a verification pass equals its decode steps)
        one = torch.cat([kernels.moe_experts_float(x[t : t + 1], ids[t : t + 1], w[t : t + 1], *weights)
                         for t in range(T)])
        # the experts given one by one (an expert store's pieces) give the same bits too
        split = kernels.moe_experts_float(x, ids, w, *(list(p.unbind(0)) for p in weights))
    assert y.dtype == torch.float32 and y.shape == (T, H)
    assert max_rel(y, ref) < float_tol(isa, dtype)
    assert torch.equal(one, y)
    assert torch.equal(split, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_module_runs_decode_natively(dtype):
    """`Experts` takes the native kernel for a decode-sized pass without autograd and stays
    on torch with autograd (training) or above FLOAT_LINEAR_MAX_TOKENS float32 tokens; bf16
    of any size goes native where torch's bf16 GEMM is slow (`kernels.torch_bf16_is_slow`)."""
    g = torch.Generator().manual_seed(1)
    ex = _experts(8, 64, 48, seed=1).to(dtype)
    calls = []
    real = kernels.moe_experts_float

    def spy(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    kernels.moe_experts_float = spy
    try:
        for T in (1, kernels.FLOAT_LINEAR_MAX_TOKENS, kernels.FLOAT_LINEAR_MAX_TOKENS + 1):
            x = torch.randn(T, 64, generator=g).to(dtype)
            ids, w = _route(T, 8, 2, g)
            with torch.inference_mode():
                y = ex(x, ids, w.to(dtype))
            ref = expert_mlp(x.float(), ids, w, *(p.detach().float() for p in ex.parameters()))
            assert y.dtype == dtype
            assert norm_rel(y, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
        x = torch.randn(1, 64, generator=g).to(dtype)
        ex(x, *_route(1, 8, 2, g)).sum()  # autograd on: the torch path
    finally:
        kernels.moe_experts_float = real
    many = [kernels.FLOAT_LINEAR_MAX_TOKENS + 1] if dtype == torch.bfloat16 and kernels.torch_bf16_is_slow() else []
    assert calls == ([1, kernels.FLOAT_LINEAR_MAX_TOKENS, *many] if kernels.native() else [])


def test_float_weights_refused_when_they_do_not_match():
    nat = kernels._native()
    if nat is None:
        pytest.skip("native extension not in use")
    g, d = torch.zeros(2, 8, 16).numpy(), torch.zeros(2, 16, 8).numpy()
    x, out = torch.zeros(1, 16).numpy(), torch.zeros(1, 16).numpy()
    ids, w = torch.zeros(1, 1, dtype=torch.long).numpy(), torch.ones(1, 1).numpy()
    with pytest.raises(ValueError, match="up: must be float32 \\(fmt 32\\) or bf16"):
        nat.moe_experts_float(x, ids, w, [g], [g.astype("float64")], [d], out)
    with pytest.raises(ValueError, match="down"):
        nat.moe_experts_float(x, ids, w, [g], [g], [g], out)
    # a float weight with the other float format's code, and with the wrong width
    f32 = kernels.float_packed(torch.zeros(4, 16))
    with pytest.raises(ValueError, match="float32 \\(fmt 32\\) or bf16"):
        nat.qlinear_multi(x, [f32.w], [f32.s], [16], torch.zeros(1, 4).numpy())
    with pytest.raises(ValueError, match="weight"):
        nat.qlinear_multi(torch.zeros(1, 8).numpy(), [f32.w], [f32.s], [32], torch.zeros(1, 4).numpy())


def test_moe_experts_bad_expert_id():
    qe = QuantizedExperts.from_experts(_experts(4, 32, 32, seed=0), "int8")
    with pytest.raises((IndexError, ValueError)):
        qe(torch.randn(1, 32), torch.tensor([[0, 4]]), torch.ones(1, 2))


def test_moe_hand_set_weights_known_answer():
    """One expert, identity-like weights exactly representable in both formats."""
    E, H, I = 2, 32, 32
    ex = Experts(E, H, I)
    with torch.no_grad():
        ex.gate_proj.zero_()
        ex.up_proj.zero_()
        ex.down_proj.zero_()
        ex.gate_proj[1] = torch.eye(I) * 4.0   # silu(4 x)
        ex.up_proj[1] = torch.eye(I)           # * x
        ex.down_proj[1] = torch.eye(H) * 2.0   # * 2
    x = torch.zeros(1, H)
    x[0, 3] = 1.0
    ids = torch.tensor([[1, 0]])
    w = torch.tensor([[0.5, 0.5]])
    expected = torch.zeros(1, H)
    expected[0, 3] = 0.5 * 2.0 * torch.nn.functional.silu(torch.tensor(4.0)) * 1.0
    for fmt in FMTS:
        qe = QuantizedExperts.from_experts(ex, fmt)
        for isa in NATIVE + ["torch"]:
            with kernels.use_isa(isa):
                y = qe(x, ids, w)
            # the hidden value silu(4) is quantized to int8 in its block: 1/127 relative
            assert torch.allclose(y, expected, rtol=1e-2, atol=1e-6), (fmt, isa, y[0, 3])


def test_quantized_linear_module_shapes_and_bias():
    lin = torch.nn.Linear(70, 9, bias=True)
    ql = QuantizedLinear.from_linear(lin, "int8")
    x = torch.randn(2, 3, 70)
    y = ql(x)
    assert y.shape == (2, 3, 9)
    with torch.no_grad():
        assert norm_rel(y, lin(x)) < FLOAT_TOL["int8"]
    assert ql(torch.randn(0, 70)).shape == (0, 9)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_pool_survives_fork():
    """A forked child (servers, data loaders) has none of the parent's pool threads."""
    import os

    q, s = formats.quantize(torch.randn(300, 64), "int8")
    x = torch.randn(20, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        y = kernels.qlinear(x, q, s, "int8", 64)
        pid = os.fork()
        if pid == 0:  # child: exit status says whether the op ran and agreed
            ok = torch.equal(kernels.qlinear(x, q, s, "int8", 64), y)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert torch.equal(kernels.qlinear(x, q, s, "int8", 64), y)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_split_threads_decode_on_one_torch_thread():
    """Quantized net: decode-sized passes run torch on one thread, native ops on N with
    workers that spin longer between ops; larger passes give torch its N threads back and
    the workers their short spin; outputs do not depend on it."""
    from moerun.layers.cache import Cache
    from moerun.quant import quantize_model
    from test_quant import tiny_model

    net = tiny_model()
    quantize_model(net, "int4")
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    with torch.inference_mode():
        want = net(ids)
        plain_cache = Cache(net.cache_spec(), 1, 64, torch.float32)
        net(ids[:, :39], plain_cache)
        plain_step = net(ids[:, 39:], plain_cache)
        try:
            assert kernels.split_threads(net, threads=2)
            assert kernels._state["pinned"] == 2
            got = net(ids)  # 40 tokens > 32: torch keeps 2 threads
            assert torch.get_num_threads() == 2
            assert kernels._native().get_spin_us() == kernels.IDLE_SPIN_US
            cache = Cache(net.cache_spec(), 1, 64, torch.float32)
            net(ids[:, :39], cache)
            step = net(ids[:, 39:], cache)  # one token: torch on one thread
            assert torch.get_num_threads() == 1
            assert kernels._native().get_spin_us() == kernels.DECODE_SPIN_US > kernels.IDLE_SPIN_US
        finally:
            net._split_threads.remove()
            kernels.set_threads(None)
            kernels.set_spin(kernels.IDLE_SPIN_US)
            torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, plain_step, rtol=1e-5, atol=1e-5)


def test_split_threads_takes_float_moe_nets_too():
    """A float MoE net's decode steps run native kernels too (experts, projections,
    attention blocks), so its torch ops go on one thread there as well."""
    from test_quant import tiny_model

    net = tiny_model()
    try:
        assert kernels.split_threads(net, threads=2) == kernels.native()
        assert (getattr(net, "_split_threads", None) is not None) == kernels.native()
    finally:
        if getattr(net, "_split_threads", None) is not None:
            net._split_threads.remove()
        kernels.set_threads(None)


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_split_threads_finds_any_native_module():
    """Store-backed packed experts (experts.attach.QuantStoreExperts) are neither
    QuantizedLinear nor QuantizedExperts; the marker is what counts."""
    from moerun.experts.attach import QuantStoreExperts

    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert not kernels.split_threads(net)
    net.append(QuantStoreExperts(0, 2, 32, 32, "int4"))  # never run here
    try:
        assert kernels.split_threads(net, threads=1)
    finally:
        net._split_threads.remove()
        kernels.set_threads(None)


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hq,hkv,S,D,Dv,spread", [(8, 2, 1, 32, 32, 1.0), (4, 4, 7, 20, 13, 1.0), (6, 1, 300, 64, 72, 1.0),
                                                  (32, 4, 700, 128, 128, 1.0), (3, 3, 65, 8, 8, 1.0), (4, 2, 130, 32, 32, 40.0),
                                                  (16, 2, 33, 20, 24, 1.0), (16, 1, 300, 64, 64, 40.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_decode(isa, threads, hq, hkv, S, D, Dv, spread, dtype):
    """Odd head dims (tails of the 8-lane loops), one position, chunked long caches, G = 1,
    groups of 8 and 16 query heads (their scores go 8 heads at a time), and scores spread
    wide enough that most exp() underflow; k and v are views of a longer cache, as in
    decode, in float32 or bf16."""
    g = torch.Generator().manual_seed(S * 7 + D)
    q = torch.randn(hq, D, generator=g) * spread
    k = torch.randn(hkv, S + 37, D, generator=g).to(dtype)[:, :S]
    v = torch.randn(hkv, S + 37, Dv, generator=g).to(dtype)[:, :S]
    ref = kernels.attn_decode_ref(q, k, v, D**-0.5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with kernels.use_isa(isa):
            assert kernels.attn_decode_is_native(k, v)
            got = kernels.attn_decode(q, k, v, D**-0.5)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (hq, Dv) and got.dtype == torch.float32
    assert max_rel(got, ref) < 1e-5


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("hq,hkv,S,D", [(32, 4, 511, 128), (16, 2, 511, 256), (16, 2, 4096, 256), (8, 8, 300, 64)])
def test_attn_decode_bits_do_not_depend_on_the_threads(isa, hq, hkv, S, D):
    """Its chunks of positions set the order of the merge: they are cut the same for every
    thread count, so 1, 2, 3 or 8 threads give the same bits, and so does the pool while it
    runs a job on the calling thread alone (its width is 1 while the CPU is shared: the bits
    of a decode step once changed with it)."""
    g = torch.Generator().manual_seed(S + D)
    q = torch.randn(hq, D, generator=g)
    k = torch.randn(hkv, S, D, generator=g).to(torch.bfloat16)
    v = torch.randn(hkv, S, D, generator=g).to(torch.bfloat16)
    outs = []
    try:
        for threads in (1, 2, 3, 8):
            kernels.set_threads(threads)
            with kernels.use_isa(isa):
                outs.append(kernels.attn_decode(q, k, v, D**-0.5))
    finally:
        kernels.set_threads(None)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_attn_decode_bad_shapes_and_fallbacks():
    nat = kernels._native()
    q, k, v, out = torch.zeros(8, 16), torch.zeros(3, 5, 16), torch.zeros(3, 5, 16), torch.zeros(8, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        nat.attn_decode(q.numpy(), k.numpy(), v.numpy(), out.numpy(), 1.0)
    with pytest.raises(ValueError, match="last dimension"):
        nat.attn_decode(q.numpy(), torch.zeros(2, 16, 5).transpose(1, 2).numpy(), torch.zeros(2, 5, 16).numpy(),
                        out.numpy(), 1.0)
    # fp16 caches and transposed views are not native: the reference runs instead
    kh = torch.randn(2, 5, 16).half()
    assert not kernels.attn_decode_is_native(kh, kh)
    kt = torch.randn(2, 16, 5).transpose(1, 2)
    assert not kernels.attn_decode_is_native(kt, kt)
    q = torch.randn(8, 16)
    torch.testing.assert_close(kernels.attn_decode(q, kh, kh, 0.25), kernels.attn_decode_ref(q, kh, kh, 0.25))


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("head_dim, dtype, tol, cache_tol", [(16, torch.float32, 1e-4, 1e-5), (20, torch.float32, 1e-4, 1e-5),
                                                             (16, torch.bfloat16, 6e-2, 0.1)])
@pytest.mark.parametrize("quant", ["int4", "none"])
def test_fused_decode_attention_matches_the_module(isa, head_dim, dtype, tol, cache_tol, quant):
    """The fused attention block: decode steps and a few-token pass through the native
    attention block give the module's own logits and leave the same keys and values in the
    cache (bf16: within
    bf16 rounding: the block keeps q and k in float32 where the module rounds them after
    each op, a few bf16 steps apart for keys of magnitude 1-3);
    prefill and batches keep the module's forward."""
    from moerun.layers.cache import Cache
    from moerun.quant import quantize_model
    from test_quant import tiny_model

    net = tiny_model(head_dim=head_dim)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in net.model.layers:  # per-head norms that are not all ones
            for nm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                nm.weight.copy_(1 + 0.3 * torch.randn(head_dim, generator=g))
    net.to(dtype)
    if quant != "none":
        quantize_model(net, quant)
    ids = torch.randint(0, 101, (1, 14), generator=g)

    def run():  # prefill, one-token steps, then a pass of three tokens (a verification pass)
        cache = Cache(net.cache_spec(), 1, 16, dtype)
        out = [net(ids[:, :8], cache)[:, -1]]
        out += [net(ids[:, i : i + 1], cache)[:, -1] for i in range(8, 11)]
        out += list(net(ids[:, 11:14], cache)[0])
        return torch.stack([o.reshape(-1) for o in out]), cache

    keys = list(net.state_dict())
    with torch.inference_mode(), kernels.use_isa(isa):
        with torch_attention():
            want, want_cache = run()
        assert fused_attentions(net) == 2
        got, got_cache = run()
        batch = net(ids[:, :3].repeat(2, 1))  # uncached batch of two: the module's forward
    assert got.dtype == want.dtype == torch.float32  # logits (`layers.linear.head_logits`), whatever the model dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for a, b in zip(got_cache.layers, want_cache.layers):
        torch.testing.assert_close(a.k[:, :, :14].float(), b.k[:, :, :14].float(), rtol=cache_tol, atol=cache_tol)
        torch.testing.assert_close(a.v[:, :, :14].float(), b.v[:, :, :14].float(), rtol=cache_tol, atol=cache_tol)
    assert batch.shape == (2, 3, 101)
    assert list(net.state_dict()) == keys  # the checkpoint layout does not change


def test_fused_decode_attention_skips_mixed_and_biased_modules():
    from moerun.quant import quantize_model
    from test_quant import tiny_model

    net = tiny_model()
    attn = net.model.layers[0].self_attn
    attn.o_proj = QuantizedLinear.from_linear(attn.o_proj, "int8")  # one packed projection among float ones
    attn.q_proj.register_forward_hook(lambda *a: None)  # and a hooked float projection
    assert fused_attentions(net) == (1 if kernels.isa() != "torch" else 0)  # only layer 1
    net = tiny_model()
    quantize_model(net, "int4")
    # a biased q/k/v projection fuses (the block adds the bias: Qwen2-MoE); a biased o_proj does not
    net.model.layers[0].self_attn.o_proj.bias = torch.zeros(net.model.layers[0].self_attn.o_proj.out_features)
    net.model.layers[1].self_attn.q_proj.bias = torch.zeros(net.model.layers[1].self_attn.q_proj.out_features)
    assert fused_attentions(net) == (1 if kernels.isa() != "torch" else 0)
    assert attention.attention_fuses(net.model.layers[1].self_attn) or kernels.isa() == "torch"


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("hq,hkv,S,D", [(8, 2, 1, 32), (4, 4, 9, 20), (32, 4, 700, 128), (16, 2, 9, 20)])
def test_attn_decode_int8_cache(isa, hq, hkv, S, D):
    """int8 keys/values with per-position scales (views of an int8 cache) against the
    reference on the dequantized values: the kernel applies the scales as it reads."""
    from moerun.layers.cache import quantize_int8

    g = torch.Generator().manual_seed(S + D)
    q = torch.randn(hq, D, generator=g)
    k8, ks = quantize_int8(torch.randn(hkv, S + 5, D, generator=g))
    v8, vs = quantize_int8(torch.randn(hkv, S + 5, D, generator=g))
    k8, ks, v8, vs = k8[:, :S], ks[:, :S], v8[:, :S], vs[:, :S]
    ref = kernels.attn_decode_ref(q, k8.float() * ks, v8.float() * vs, D**-0.5)
    with kernels.use_isa(isa):
        assert kernels.attn_decode_is_native(k8, v8)
        got = kernels.attn_decode(q, k8, v8, D**-0.5, ks, vs)
    assert max_rel(got, ref) < 1e-5


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_attn_decode_int8_needs_both_scales():
    nat = kernels._native()
    k8 = torch.zeros(2, 5, 16, dtype=torch.int8)
    q, out, sc = torch.zeros(4, 16), torch.zeros(4, 16), torch.ones(2, 5, 1)
    with pytest.raises(ValueError, match="need k_scale and v_scale"):
        nat.attn_decode(q.numpy(), k8.numpy(), k8.numpy(), out.numpy(), 1.0, sc.numpy())
    with pytest.raises(ValueError, match="both float32, both bf16"):
        nat.attn_decode(q.numpy(), k8.numpy(), torch.zeros(2, 5, 16).numpy(), out.numpy(), 1.0)


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("hq,hkv,S,D", [(8, 2, 1, 32), (4, 4, 9, 20), (32, 4, 700, 128)])
def test_attn_decode_bf16_cache(isa, hq, hkv, S, D):
    """bf16 keys/values (a bf16 model's cache), widened in the kernel: against the reference
    on the same bf16 values in fp32, so only summation order differs."""
    g = torch.Generator().manual_seed(S * 3 + D)
    q = torch.randn(hq, D, generator=g)
    k = torch.randn(hkv, S + 5, D, generator=g).bfloat16()[:, :S]
    v = torch.randn(hkv, S + 5, D, generator=g).bfloat16()[:, :S]
    ref = kernels.attn_decode_ref(q, k, v, D**-0.5)
    with kernels.use_isa(isa):
        assert kernels.attn_decode_is_native(k, v)
        got = kernels.attn_decode(q, k, v, D**-0.5)
    assert max_rel(got, ref) < 1e-5


def attn_block_inputs(H: int = 64, Hq: int = 4, Hkv: int = 2, D: int = 16) -> tuple:
    """(H, Hq, Hkv, D, int8 q/k/v/o weights {name: (qweight, scales)}, an 8-position k and v
    cache, an empty tensor): what the bad-argument tests of the fused attention block call it with."""
    lin = {n: formats.quantize(torch.randn(r, c) * 0.1, "int8") for n, r, c in
           (("q", Hq * D, H), ("k", Hkv * D, H), ("v", Hkv * D, H), ("o", H, Hq * D))}
    return H, Hq, Hkv, D, lin, torch.zeros(Hkv, 8, D), torch.zeros(Hkv, 8, D), torch.empty(0)


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_attn_block_decode_refuses_bad_arguments():
    """The fused block's binding checks what it is given: one line each, nothing written."""
    nat = kernels._native()
    H, Hq, Hkv, D, lin, kc, vc, none = attn_block_inputs()

    def call(pos=3, hq=Hq, kc=kc, rd=D, T=1, gated=False, cos_rows=None, half=()):
        cos, sin = torch.ones(cos_rows or T, rd), torch.zeros(cos_rows or T, rd)
        args = [torch.randn(T, H).numpy()]
        for n in "qkvo":
            args += [lin[n][0].numpy(), lin[n][1].numpy(), 8]
        nat.attn_block_decode(*args, none.numpy(), none.numpy(), 1e-6, cos.numpy(), sin.numpy(), kc.numpy(),
                              vc.numpy(), pos, hq, 0.25, torch.empty(T, H).numpy(), gated, *half)

    call()  # well-formed: runs
    assert kc[:, 3].abs().sum() > 0 and not kc[:, 4:].any()  # wrote its position only
    call(pos=4, T=3)  # a few tokens: positions 4..6
    assert kc[:, 6].abs().sum() > 0 and not kc[:, 7:].any()
    with pytest.raises(ValueError, match="position outside the cache"):
        call(pos=8)
    with pytest.raises(ValueError, match="position outside the cache"):
        call(pos=6, T=3)
    with pytest.raises(ValueError, match=r"cos, sin must be \[T, rd\]"):
        call(T=2, cos_rows=1)
    with pytest.raises(ValueError, match="q_proj"):
        call(gated=True)  # a gated block's q_proj has twice the rows
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(hq=3)
    with pytest.raises(ValueError, match="q_proj"):
        call(hq=2)  # q_proj has 4 heads' rows
    with pytest.raises(ValueError, match="rotary dims"):
        call(rd=D + 2)
    with pytest.raises(ValueError, match="both float32 or both bf16"):
        call(kc=torch.zeros(Hkv, 8, D, dtype=torch.float64))
    call(half=(torch.ones(H).numpy(), 0.0, 1e-6))  # a decoder layer's first half: runs
    with pytest.raises(ValueError, match="in_norm"):
        call(half=(torch.ones(H + 1).numpy(), 0.0, 1e-6))


def _qwen3_5_net(tmp_path):
    """A tiny random Qwen3.5-MoE net (transformers' init, norms moved off identity), float32."""
    from conftest import save_and_load
    from test_qwen3_5_moe import make_reference

    return save_and_load(make_reference(), tmp_path).net


@pytest.mark.parametrize("isa", NATIVE)
def test_fused_decode_attention_gated(isa, tmp_path):
    """Qwen3.5's attention (output gate, zero-centred per-head norms, partial rotary) through
    the native block: the same logits and cache contents as the module's own forward."""
    from moerun.layers.cache import Cache
    from moerun.quant import quantize_model

    net = _qwen3_5_net(tmp_path)
    quantize_model(net, "int4")
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))

    def run():  # a prefill, one-token steps, then a pass of three tokens (a verification pass)
        cache = Cache(net.cache_spec(), 1, 16, torch.float32)
        out = [net(ids[:, :6], cache)[:, -1]]
        out += [net(ids[:, i : i + 1], cache)[:, -1] for i in range(6, 9)]
        out += list(net(ids[:, 9:12], cache)[0])
        return torch.stack([o.reshape(-1) for o in out]), cache

    with torch.inference_mode(), kernels.use_isa(isa):
        with torch_attention():
            want, want_cache = run()
        assert fused_attentions(net) == sum(t == "full_attention" for t in net.args.layer_types)
        got, got_cache = run()
    assert max_rel(got, want) < 1e-4
    for a, b in zip(got_cache.layers, want_cache.layers):
        if hasattr(a, "k"):
            assert max_rel(a.k[:, :, :12], b.k[:, :, :12]) < 1e-5 and max_rel(a.v[:, :, :12], b.v[:, :, :12]) < 1e-5


DELTA_SHAPES = [  # B, T, Hk, Hv, Dk, Dv, K
    (1, 1, 2, 4, 32, 32, 4), (2, 3, 2, 4, 8, 12, 4), (1, 5, 1, 3, 16, 24, 3), (3, 2, 4, 8, 128, 128, 4)]


def _delta_inputs(B, T, Hk, Hv, Dk, Dv, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * Dk + Hv * Dv
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(qkv=r(B, T, C), conv_w=0.5 * r(C, 1, K), conv=r(B, C, K - 1), a=r(B, T, Hv), b=r(B, T, Hv),
                A_log=0.5 * r(Hv), dt_bias=r(Hv), S=0.1 * r(B, Hv, Dk, Dv), z=r(B, T, Hv, Dv), norm_w=r(Dv))


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("shape", DELTA_SHAPES)
@pytest.mark.parametrize("every", [False, True])
def test_deltanet_decode(isa, shape, every):
    """The native Gated DeltaNet steps against the torch reference (float32, summation order
    only: 1e-5): outputs and states. The given states end as the last token's, updated in
    place; with `every` each token's state comes back too."""
    from moerun.kernels.reference import few_tokens_ref

    inp = _delta_inputs(*shape, seed=sum(shape))
    Hk = shape[2]
    want = few_tokens_ref(**{k: v.clone() for k, v in inp.items()}, eps=1e-6, key_heads=Hk, every=every)
    conv, S = inp["conv"].clone(), inp["S"].clone()
    with kernels.use_isa(isa):
        assert kernels.deltanet_decode_is_native(inp["qkv"], conv, S)
        got = kernels.deltanet_decode(**{**inp, "conv": conv, "S": S}, eps=1e-6, key_heads=Hk, every=every)
    for a, b in zip(got, want):
        assert a.shape == b.shape and max_rel(a, b) < 1e-5
    if every:
        assert torch.equal(conv, got[1][:, -1]) and torch.equal(S, got[2][:, -1])
        assert got[1].shape[:2] == got[2].shape[:2] == shape[:2]
        bufs = (torch.full_like(got[1], float("nan")), torch.full_like(got[2], float("nan")))
        conv, S = inp["conv"].clone(), inp["S"].clone()
        with kernels.use_isa(isa):
            again = kernels.deltanet_decode(**{**inp, "conv": conv, "S": S}, eps=1e-6, key_heads=Hk, every=True,
                                            every_out=bufs)
        assert again[1] is bufs[0] and again[2] is bufs[1]  # written where asked
        assert all(torch.equal(a, b) for a, b in zip(again, got))
    else:
        assert got[1] is conv and got[2] is S


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("every", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deltanet_decode_reads_column_slices(isa, every, dtype):
    """qkv, z, a and b as column slices of one projection buffer (as `project` returns them),
    read in place (bf16 ones widened where they lie): the same results as contiguous copies,
    bit for bit."""
    B, T, Hk, Hv, Dk, Dv, K = 2, 3, 2, 4, 8, 12, 4
    inp = _delta_inputs(B, T, Hk, Hv, Dk, Dv, K, seed=3)
    inp = {k: (v.to(dtype) if k in ("qkv", "a", "b", "z") else v) for k, v in inp.items()}
    C = 2 * Hk * Dk + Hv * Dv
    buf = torch.randn(B, T, C + Hv * Dv + 2 * Hv + 5).to(dtype)  # 5 unused columns
    qkv, z, a, b = buf[..., :-5].split([C, Hv * Dv, Hv, Hv], dim=-1)
    for t, name in ((qkv, "qkv"), (z, "z"), (a, "a"), (b, "b")):
        t.copy_(inp[name].reshape(t.shape))
    assert not qkv.is_contiguous() and not a.is_contiguous()
    sliced = {**inp, "qkv": qkv, "z": z.reshape(B, T, Hv, Dv), "a": a, "b": b}
    with kernels.use_isa(isa):
        want = kernels.deltanet_decode(**{k: v.clone() for k, v in inp.items()}, eps=1e-6, key_heads=Hk, every=every)
        # only the states are written: the slices go in as they are (clone would make them contiguous)
        got = kernels.deltanet_decode(**{**sliced, "conv": inp["conv"].clone(), "S": inp["S"].clone()}, eps=1e-6,
                                      key_heads=Hk, every=every)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("isa", NATIVE)
def test_deltanet_decode_bf16_inputs(isa):
    """A bf16 model's projections with float32 states: native, the inputs widened exactly, so
    the result is the float32 reference's on the same values (o comes back float32)."""
    from moerun.kernels.reference import few_tokens_ref

    inp = _delta_inputs(2, 3, 2, 4, 16, 16, 4, seed=5)
    bf = {k: (v.bfloat16() if k in ("qkv", "a", "b", "z") else v) for k, v in inp.items()}
    want = few_tokens_ref(**{k: v.float().clone() for k, v in bf.items()}, eps=1e-6, key_heads=2, every=True)
    with kernels.use_isa(isa):
        assert kernels.deltanet_decode_is_native(bf["qkv"], bf["conv"], bf["S"])
        wide = kernels.deltanet_decode(**{k: v.float().clone() for k, v in bf.items()}, eps=1e-6, key_heads=2, every=True)
        out16 = kernels.deltanet_decode(**{k: v.clone() for k, v in bf.items()}, eps=1e-6, key_heads=2, every=True,
                                        dtype=torch.bfloat16)
        got = kernels.deltanet_decode(**bf, eps=1e-6, key_heads=2, every=True)
    assert got[0].dtype == torch.float32
    for a, b in zip(got, want):
        assert max_rel(a, b) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(got, wide))  # widened exactly: the float32 call's bits
    # dtype=bf16: o rounded once, as .to(bfloat16) rounds the float32 o; the states as before
    assert out16[0].dtype == torch.bfloat16 and torch.equal(out16[0], got[0].bfloat16())
    assert torch.equal(out16[1], got[1]) and torch.equal(out16[2], got[2])


def test_deltanet_decode_falls_back_and_refuses_bad_arguments():
    from moerun.kernels.reference import few_tokens_ref

    inp = _delta_inputs(1, 2, 2, 4, 8, 12, 4)
    bf = {**inp, "qkv": inp["qkv"].bfloat16(), "conv": inp["conv"].bfloat16()}
    assert not kernels.deltanet_decode_is_native(bf["qkv"], bf["conv"], bf["S"])
    got = kernels.deltanet_decode(**{k: v.clone() for k, v in bf.items()}, eps=1e-6, key_heads=2, every=True)
    want = few_tokens_ref(**{k: v.clone() for k, v in bf.items()}, eps=1e-6, key_heads=2, every=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if kernels.isa() == "torch":
        return
    nat = kernels._native()
    n = lambda t: t.numpy()  # noqa: E731
    out = torch.empty(1, 2, 4, 12)

    def call(**over):
        a = {**inp, **over}
        cw = a["conv_w"].reshape(a["conv_w"].shape[0], -1)
        cw = cw if over.get("untransposed") else cw.t().contiguous()  # the native conv reads [K, C]
        nat.deltanet_decode(n(a["qkv"]), n(cw), n(a["conv"]),
                            over.get("conv_every"), n(a["a"]), n(a["b"]), n(a["A_log"]), n(a["dt_bias"]), n(a["S"]),
                            over.get("S_every"), n(a["z"]), n(a["norm_w"]), 1e-6, n(over.get("out", out)),
                            over.get("hk", 2))

    call()  # the good call runs
    with pytest.raises(ValueError, match="C must be"):
        call(qkv=torch.zeros(1, 2, 70), conv_w=torch.zeros(70, 1, 4), conv=torch.zeros(1, 70, 3))
    with pytest.raises(ValueError, match="multiple of key heads"):
        call(hk=3)
    with pytest.raises(ValueError, match=r"conv_w must be \[K, C\]"):
        call(untransposed=True)
    with pytest.raises(ValueError, match="go together"):
        call(conv_every=n(torch.zeros(1, 2, inp["qkv"].shape[-1], 3)))
    with pytest.raises(ValueError, match="wrong dtype"):
        call(z=inp["z"].double())
    with pytest.raises(ValueError, match="out: wrong dtype"):
        call(out=torch.empty(1, 2, 4, 12, dtype=torch.float64))
    with pytest.raises(ValueError, match="out: dimension 1"):
        call(out=torch.empty(1, 3, 4, 12))
    with pytest.raises(ValueError, match="z: must be contiguous within a token"):  # heads strided apart
        call(z=torch.zeros(1, 2, 4, 24)[..., :12])
    with pytest.raises(ValueError, match="a: dimension 2"):
        call(a=torch.zeros(1, 2, 5))


@pytest.mark.parametrize("isa", NATIVE)
def test_qlinear_multi_is_the_separate_calls(isa):
    """Several packed weights of one input in one call (mixed formats, odd widths, 1 and 5
    rows): each output equals that weight's own qlinear exactly."""
    g = torch.Generator().manual_seed(7)
    K = 100
    ws = [formats.quantize(torch.randn(n, K, generator=g) * 0.1, f) + (f,)
          for n, f in ((37, "int8"), (5, "int4"), (64, "int8"), (3, "int4"))]
    for M in (1, 5):
        x = torch.randn(M, K, generator=g)
        with kernels.use_isa(isa):
            got = kernels.qlinear_multi(x, ws)
            want = [kernels.qlinear(x, w, sc, f, K) for w, sc, f in ws]
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_project_runs_packed_linears_together_and_others_one_by_one():
    from moerun.layers.linear import project

    g = torch.Generator().manual_seed(8)
    lins = [torch.nn.Linear(64, n, bias=False) for n in (24, 8)]
    many = torch.randn(2, kernels.FLOAT_LINEAR_MAX_TOKENS, 64, generator=g)  # above the float rows
    few = torch.randn(2, 3, 64, generator=g)
    with torch.no_grad():
        for a, b in zip(project(many, *lins), [m(many) for m in lins]):  # torch's own calls
            assert torch.equal(a, b)
        qs = [QuantizedLinear.from_linear(m, "int8") for m in lins]
        got = project(few, *qs)
        assert [t.shape for t in got] == [(2, 3, 24), (2, 3, 8)]
        for a, b in zip(got, [m(few) for m in qs]):
            assert torch.equal(a, b)
    for a, b in zip(project(few, *lins), [m(few) for m in lins]):  # autograd on: torch's calls
        assert torch.equal(a, b)
    with torch.no_grad():  # few rows of float linears: one native call, float32 products
        got = project(few, *lins)
        assert all(max_rel(a, m(few)) < 1e-6 for a, m in zip(got, lins))
        lins[1].register_forward_hook(lambda *a: None)  # a hooked module must see its call
        got = project(few, *lins)
        assert all(torch.equal(a, m(few)) for a, m in zip(got, lins))


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_weights_in_the_linear_ops(isa, dtype):
    """float32 / bf16 weights (`kernels.float_packed`) in qlinear_multi, swiglu_mlp and
    mixed with packed ones: against float32 torch products on the same weights,
    and a token's output the same whichever rows share its call."""
    g = torch.Generator().manual_seed(9)
    K, I = 100, 45
    wf = [torch.randn(n, K, generator=g).to(dtype) * 0.1 for n in (37, 5)]
    q8 = formats.quantize(torch.randn(11, K, generator=g) * 0.1, "int8") + ("int8",)
    x = torch.randn(5, K, generator=g)
    with kernels.use_isa(isa):
        got = kernels.qlinear_multi(x, [kernels.float_packed(w) for w in wf] + [q8])
        one = [kernels.qlinear_multi(x[t : t + 1], [kernels.float_packed(w) for w in wf]) for t in range(5)]
        want8 = kernels.qlinear(x, *q8[:2], "int8", K)
    for j, w in enumerate(wf):
        assert max_rel(got[j], x @ w.float().T) < float_tol(isa, dtype)
        assert torch.equal(torch.cat([o[j] for o in one]), got[j])
    assert torch.equal(got[2], want8)
    gate, up = (torch.randn(I, K, generator=g).to(dtype) * 0.1 for _ in range(2))
    down = torch.randn(K, I, generator=g).to(dtype) * 0.1
    gv = torch.randn(K, generator=g) * 0.1
    with kernels.use_isa(isa):
        y = kernels.swiglu_mlp(x, *(kernels.float_packed(w) for w in (gate, up, down)), gate_vec=gv)
    ref = (torch.nn.functional.silu(x @ gate.float().T) * (x @ up.float().T)) @ down.float().T
    assert max_rel(y, ref * torch.sigmoid(x @ gv[:, None])) < float_tol(isa, dtype)


@pytest.mark.skipif("avx512bf16" not in NATIVE, reason="needs a CPU with AVX-512 BF16")
@pytest.mark.parametrize("K", [7, 16, 31, 32, 33, 100, 256])
def test_bf16_dot_products(K):
    """The avx512bf16 path's bf16 weight rows: tokens whose activations are bf16 values (one
    vdpbf16ps chain: exact products, float32 sums) within float32 summation order of the
    float32 product, others (two bf16 halves) within float_tol; every row count and tail
    of K; each token's output the same bits whichever tokens share its call, bf16 or not;
    a NaN activation (its payload in the high bits or the low) gives NaN in its token's
    outputs only."""
    g = torch.Generator().manual_seed(K)
    N = 21  # two blocks of 8 rows and a block of 5
    w = (torch.randn(N, K, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(7, K, generator=g)
    x[::2] = x[::2].to(torch.bfloat16).float()  # tokens 0, 2, 4, 6 bf16 values, 1, 3, 5 not
    x[5, K // 2] = float("nan")
    x[3, K - 1] = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)  # a NaN whose payload is in the low bits
    p = kernels.float_packed(w)
    with kernels.use_isa("avx512bf16"):
        got = kernels.qlinear_multi(x, [p])[0]
        one = torch.cat([kernels.qlinear_multi(x[t : t + 1], [p])[0] for t in range(7)])
        rev = kernels.qlinear_multi(x.flip(0), [p])[0].flip(0)
    same = lambda a, b: torch.equal(a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0))  # noqa: E731 (NaN != NaN)
    assert same(got, one) and same(got, rev)
    want = x @ w.float().T
    assert torch.isnan(got[[3, 5]]).all() and not torch.isnan(got[[0, 1, 2, 4, 6]]).any()
    assert max_rel(got[::2], want[::2]) < 1e-5
    assert max_rel(got[1], want[1]) < float_tol("avx512bf16", torch.bfloat16)


@pytest.mark.parametrize("isa", NATIVE)
def test_bf16_activations_in_and_out(isa):
    """Each op that takes a bf16 model's activations as they are (`kernels.FLOAT_DTYPES`) gives,
    with bf16 x and dtype=bf16, the float32 call on x.float() rounded by torch's .to(bf16),
    bit for bit: the widening and the rounding (to nearest even; NaN stays NaN) happen inside."""
    g = torch.Generator().manual_seed(21)
    bf = torch.bfloat16
    H, I, E, K, T = 96, 40, 6, 2, 3
    x = torch.randn(T, H, generator=g).to(bf)
    x[0, 5] = float("nan")  # a NaN row must come out NaN where torch's rounding makes it NaN
    x32 = x.float()
    wq = formats.quantize(torch.randn(33, H, generator=g) * 0.1, "int8") + ("int8",)
    wf = kernels.float_packed(torch.randn(17, H, generator=g).to(bf) * 0.1)
    gate, up = (torch.randn(I, H, generator=g).to(bf) * 0.1 for _ in range(2))
    down = torch.randn(H, I, generator=g).to(bf) * 0.1
    mlp = [kernels.float_packed(w) for w in (gate, up, down)]
    ex = _experts(E, H, I, seed=21)
    qe = QuantizedExperts.from_experts(ex, "int4")
    qviews = (qe.gate_q, qe.gate_scales, qe.up_q, qe.up_scales, qe.down_q, qe.down_scales)
    stacks = [p.detach().to(bf) for p in (ex.gate_proj, ex.up_proj, ex.down_proj)]
    ids, w = _route(T, E, K, g)
    norm_w = torch.rand(H, generator=g) + 0.5
    cases = {
        "qlinear_multi": lambda a, **k: torch.cat(kernels.qlinear_multi(a, [wq, wf], **k), dim=-1),
        "swiglu_mlp": lambda a, **k: kernels.swiglu_mlp(a, *mlp, **k),
        "moe_experts": lambda a, **k: kernels.moe_experts(a, ids, w, *qviews, "int4", I, **k),
        "moe_experts_float": lambda a, **k: kernels.moe_experts_float(a, ids, w, *stacks, **k),
        "rms_norm": lambda a, **k: kernels.rms_norm(a, norm_w, 1e-6, 1.0, **k),
    }
    with kernels.use_isa(isa):
        for name, op in cases.items():
            want = op(x32)
            assert want.dtype == torch.float32, name
            got = op(x, dtype=bf)
            assert got.dtype == bf, name
            assert not want.isnan().all(), name
            torch.testing.assert_close(got, want.to(bf), rtol=0, atol=0, equal_nan=True, msg=name)
            torch.testing.assert_close(op(x), want, rtol=0, atol=0, equal_nan=True, msg=name)  # bf16 in, float32 out
        assert kernels.rms_norm(x, norm_w, 1e-6, dtype=bf)[0].isnan().all()  # NaN in, NaN out (0x7fc0)
        rows = slice(1, None)  # routing: the rows without the NaN, bf16 in -> the float32 call's choice
        router = torch.randn(E, H, generator=g)
        assert all(torch.equal(a, b) for a, b in zip(kernels.route_softmax_topk(x[rows], router, K, True),
                                                     kernels.route_softmax_topk(x32[rows], router, K, True)))


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_qlinear_multi_refuses_bad_arguments():
    nat = kernels._native()
    w, sc = formats.quantize(torch.randn(8, 64), "int8")
    x, out = torch.zeros(2, 64), torch.zeros(2, 16)
    nat.qlinear_multi(x.numpy(), [w.numpy(), w.numpy()], [sc.numpy(), sc.numpy()], [8, 8], out.numpy())
    with pytest.raises(ValueError, match="one scales tensor and one fmt per weight"):
        nat.qlinear_multi(x.numpy(), [w.numpy(), w.numpy()], [sc.numpy()], [8, 8], out.numpy())
    with pytest.raises(ValueError, match="out: dimension 1"):
        nat.qlinear_multi(x.numpy(), [w.numpy()], [sc.numpy()], [8], out.numpy())
    with pytest.raises(ValueError, match="weight"):
        nat.qlinear_multi(torch.zeros(2, 96).numpy(), [w.numpy()], [sc.numpy()], [8], torch.zeros(2, 8).numpy())


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("fmts", [("int8", "int8", "int8"), ("int4", "int4", "int8")])
def test_swiglu_mlp_against_reference(isa, fmts):
    """The one-call SwiGLU MLP against the torch reference (odd widths padded to blocks of 32;
    1, 3 and 40 rows: the last splits SiLU * up over the pool). The int8-quantized input of
    the down projection may round one step apart where SiLU's float rounding differs."""
    g = torch.Generator().manual_seed(11)
    H, I = 72, 40
    gate, up = (formats.quantize(torch.randn(I, H, generator=g) * 0.2, f) + (f,) for f in fmts[:2])
    down = formats.quantize(torch.randn(H, I, generator=g) * 0.2, fmts[2]) + (fmts[2],)
    for M in (1, 3, 40):
        x = torch.randn(M, H, generator=g)
        with kernels.use_isa(isa):
            got = kernels.swiglu_mlp(x, gate, up, down)
            views = kernels.swiglu_mlp(x, *(kernels.packed(*w) for w in (gate, up, down)))
        assert torch.equal(got, views)
        assert got.shape == (M, H) and max_rel(got, kernels.swiglu_mlp_ref(x, gate, up, down)) < 2e-2


@pytest.mark.parametrize("isa", NATIVE)
def test_swiglu_mlp_with_a_shared_expert_gate(isa):
    g = torch.Generator().manual_seed(14)
    H, I = 96, 64
    gate, up = (formats.quantize(torch.randn(I, H, generator=g) * 0.2, "int8") + ("int8",) for _ in range(2))
    down = formats.quantize(torch.randn(H, I, generator=g) * 0.2, "int8") + ("int8",)
    gv = torch.randn(H, generator=g) * 0.3
    x = torch.randn(5, H, generator=g)
    with kernels.use_isa(isa):
        got = kernels.swiglu_mlp(x, gate, up, down, gate_vec=gv)
        plain = kernels.swiglu_mlp(x, gate, up, down)
    scale = torch.sigmoid(x @ gv)[:, None]
    assert max_rel(got, plain * scale) < 1e-5  # the gate only scales the rows
    assert max_rel(got, kernels.swiglu_mlp_ref(x, gate, up, down, gv)) < 2e-2


@pytest.mark.parametrize("T,E,K,renorm", [(1, 8, 2, True), (3, 128, 8, False), (16, 60, 4, True), (2, 1, 1, True)])
def test_route_softmax_topk_against_reference(T, E, K, renorm):
    g = torch.Generator().manual_seed(T * E)
    H = 200  # not a multiple of 8: the dot product's tail
    x, R = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g) * 0.1
    w, ids = kernels.route_softmax_topk(x, R, K, renorm)
    rw, rids = kernels.route_softmax_topk_ref(x, R, K, renorm)
    assert ids.dtype == torch.long and torch.equal(ids, rids)
    assert w.shape == (T, K) and max_rel(w, rw) < 1e-5
    if renorm:
        assert torch.allclose(w.sum(-1), torch.ones(T))
    # a token's routing does not depend on the other tokens of the call
    w1, ids1 = kernels.route_softmax_topk(x[-1:], R, K, renorm)
    assert torch.equal(ids1, ids[-1:]) and torch.equal(w1, w[-1:])


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_route_softmax_topk_refuses_bad_arguments():
    nat = kernels._native()
    x, R = torch.zeros(2, 16).numpy(), torch.zeros(4, 16).numpy()
    ids, w = torch.zeros(2, 2, dtype=torch.long).numpy(), torch.zeros(2, 2).numpy()
    nat.route_softmax_topk(x, R, ids, w, True)
    with pytest.raises(ValueError, match="router"):
        nat.route_softmax_topk(x, torch.zeros(4, 8).numpy(), ids, w, True)
    with pytest.raises(ValueError, match="K <= experts"):
        nat.route_softmax_topk(x, R, torch.zeros(2, 5, dtype=torch.long).numpy(), torch.zeros(2, 5).numpy(), True)
    with pytest.raises(ValueError, match="ids"):
        nat.route_softmax_topk(x, R, torch.zeros(2, 2, dtype=torch.int32).numpy(), w, True)
    with pytest.raises(ValueError, match="weights"):
        nat.route_softmax_topk(x, R, ids, torch.zeros(3, 2).numpy(), True)


def _sigmoid_route(E, n_group, topk_group, seed, scale=2.5):
    g = torch.Generator().manual_seed(seed)
    return kernels.SigmoidRouting(torch.randn(E, generator=g) * 0.1, n_group, topk_group, scale)


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("T,E,K,n_group,topk_group,renorm", [
    (1, 8, 2, 1, 1, True), (3, 16, 3, 4, 2, False), (16, 64, 8, 8, 4, True), (2, 32, 4, 2, 1, True),
    (5, 12, 1, 3, 3, False), (2, 8, 8, 2, 2, True),  # K = every expert of the kept groups
])
def test_route_sigmoid_grouped_against_reference(isa, T, E, K, n_group, topk_group, renorm):
    g = torch.Generator().manual_seed(T * E + K)
    H = 200  # not a multiple of 8: the dot product's tail
    x, R = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g) * 0.1
    route = _sigmoid_route(E, n_group, topk_group, T + E)
    with kernels.use_isa(isa):
        w, ids = kernels.route_sigmoid_grouped(x, R, K, renorm, route)
        w1, ids1 = kernels.route_sigmoid_grouped(x[-1:], R, K, renorm, route)
    rw, rids = kernels.route_sigmoid_grouped_ref(x, R, K, renorm, route)
    assert ids.dtype == torch.long and torch.equal(ids, rids)  # largest biased score first, both
    assert w.shape == (T, K) and max_rel(w, rw) < 1e-5
    if renorm:
        assert torch.allclose(w.sum(-1), torch.full((T,), route.scale))
    # the picks lie in topk_group groups, and the bias picked them: the weights are not the biased scores
    groups = ids // (E // n_group)
    assert all(len(set(row.tolist())) <= topk_group for row in groups)
    # a token's routing does not depend on the other tokens of the call
    assert torch.equal(ids1, ids[-1:]) and torch.equal(w1, w[-1:])


def _stable_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of each row, largest first, the lower index first among equals."""
    return torch.sort(scores, dim=-1, descending=True, stable=True)[1][:, :k]


@pytest.mark.parametrize("isa", NATIVE)
def test_routers_break_ties_to_the_lower_id(isa):
    """Experts with equal scores (equal router rows: their dot products are computed alike) and
    groups with equal scores: both routers pick the lower expert, and the lower group, first."""
    g = torch.Generator().manual_seed(5)
    H, E = 40, 16
    x = torch.randn(3, H, generator=g)
    R = torch.randn(E // 2, H, generator=g).repeat_interleave(2, dim=0) * 0.1  # experts 2i and 2i+1 equal
    with kernels.use_isa(isa):
        w, ids = kernels.route_softmax_topk(x, R, 6, False)
    logits = x @ R.T
    assert torch.equal(logits[:, 0::2], logits[:, 1::2])
    assert torch.equal(ids, _stable_top(logits, 6))
    assert torch.equal(ids[:, 0::2] + 1, ids[:, 1::2])  # each pair together, the lower first
    # grouped: groups of 4 experts, groups 2 and 3 copies of 0 and 1 (expert e + 8 equals e), no
    # bias: the kept groups tie in pairs, and so do the experts picked from them
    Rg = R[0::2].repeat(2, 1)  # [16, H]
    route = kernels.SigmoidRouting(torch.zeros(E), 4, 2, 1.0)
    with kernels.use_isa(isa):
        w, ids = kernels.route_sigmoid_grouped(x, Rg, 4, False, route)
    scores = torch.sigmoid(x @ Rg.T)  # [T, E]
    assert torch.equal(scores[:, :8], scores[:, 8:])
    best_pair = scores.view(-1, 4, 4).topk(2, dim=-1)[0].sum(-1)[:, :2].argmax(-1)  # group 0 or 1, and its copy
    assert torch.equal(ids // 4 % 2, best_pair[:, None].expand(-1, 4))
    assert torch.equal(ids[:, 0::2] + 8, ids[:, 1::2])  # expert e, then its copy e + 8
    assert max_rel(w, scores.gather(1, ids)) < 1e-5
    # one tied group kept (topk_group 1): groups 0 and 2 tie as best or 1 and 3 do; the lower wins
    route1 = kernels.SigmoidRouting(torch.zeros(E), 4, 1, 1.0)
    with kernels.use_isa(isa):
        _, ids1 = kernels.route_sigmoid_grouped(x, Rg, 2, False, route1)
    assert (ids1 < 8).all() and torch.equal(ids1 // 4, ids1[:, :1].expand(-1, 2) // 4)


def test_route_sigmoid_grouped_bias_picks_but_does_not_weigh():
    """A large bias on one expert of a far group: picked (its group wins), weighed by its score."""
    x, R = torch.randn(1, 64), torch.randn(8, 64) * 0.1
    bias = torch.zeros(8)
    bias[6] = 10.0
    route = kernels.SigmoidRouting(bias, 4, 1, 1.0)
    w, ids = kernels.route_sigmoid_grouped(x, R, 2, False, route)
    scores = torch.sigmoid(x @ R.T)[0]
    assert ids[0, 0] == 6 and ids[0, 1] == 7  # only group 3 (experts 6, 7) is kept
    assert torch.allclose(w[0], scores[[6, 7]])


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_route_sigmoid_grouped_refuses_bad_arguments():
    nat = kernels._native()
    x, R, b = torch.zeros(2, 16).numpy(), torch.zeros(8, 16).numpy(), torch.zeros(8).numpy()
    ids, w = torch.zeros(2, 2, dtype=torch.long).numpy(), torch.zeros(2, 2).numpy()
    nat.route_sigmoid_grouped(x, R, b, 4, 2, 1.0, ids, w, True)
    for args, msg in (((x, R, b[:7], 4, 2), "bias"), ((x, R, b, 3, 2), "n_group must divide"),
                      ((x, R, b, 8, 2), "at least 2 experts per group"), ((x, R, b, 4, 5), "topk_group"),
                      ((x, R, b, 4, 0), "topk_group")):
        with pytest.raises(ValueError, match=msg):
            nat.route_sigmoid_grouped(*args, 1.0, ids, w, True)
    with pytest.raises(ValueError, match="K must be at most"):  # 1 group of 2 kept: K = 3 cannot be met
        nat.route_sigmoid_grouped(x, R, b, 4, 1, 1.0, torch.zeros(2, 3, dtype=torch.long).numpy(),
                                  torch.zeros(2, 3).numpy(), True)


def test_softmax_topk_runs_router_hooks_through_torch():
    from moerun.layers.moe import softmax_topk

    g = torch.Generator().manual_seed(15)
    gate = torch.nn.Linear(64, 16, bias=False)
    gate.weight.data = torch.randn(16, 64, generator=g)
    h = torch.randn(2, 64, generator=g)
    with torch.no_grad():
        w, ids = softmax_topk(gate, h, 4, True)  # native when the extension runs
        seen = []
        handle = gate.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
        hw, hids = softmax_topk(gate, h, 4, True)
        handle.remove()
    assert seen == [(2, 64)]  # a predictor's hook on the router still sees its input
    assert torch.equal(ids, hids) and max_rel(w, hw) < 1e-5


def test_gated_mlp_of_quantized_linears_is_one_call(monkeypatch):
    from moerun.layers.moe import GatedMLP

    g = torch.Generator().manual_seed(12)
    mlp = GatedMLP(64, 96)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.weight.data = torch.randn(lin.weight.shape, generator=g) * 0.1
    x = torch.randn(2, 3, 64, generator=g)
    with torch.no_grad():
        ref = mlp(x)
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, QuantizedLinear.from_linear(getattr(mlp, name), "int8"))
        calls = []
        real = kernels.swiglu_mlp
        monkeypatch.setattr(kernels, "swiglu_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))
        got = mlp(x)
    assert got.shape == x.shape and max_rel(got, ref) < 5e-2
    assert calls == ([1] if kernels.isa() != "torch" else [])


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_swiglu_mlp_refuses_bad_arguments():
    nat = kernels._native()
    gw, gs = (t.numpy() for t in formats.quantize(torch.randn(40, 64), "int8"))
    dw, ds = (t.numpy() for t in formats.quantize(torch.randn(64, 40), "int8"))
    x, out, none = torch.zeros(2, 64).numpy(), torch.zeros(2, 64).numpy(), torch.zeros(0).numpy()

    def call(x=x, down=(dw, ds), out=out, gv=none):
        nat.swiglu_mlp(x, gw, gs, 8, gw, gs, 8, *down, 8, out, gv)

    call()
    call(gv=torch.zeros(64).numpy())
    with pytest.raises(ValueError, match="down"):  # down's rows must be H
        call(down=(gw, gs))
    with pytest.raises(ValueError, match="out"):
        call(out=torch.zeros(3, 64).numpy())
    with pytest.raises(ValueError, match="x"):
        call(x=torch.zeros(2, 64).double().numpy())
    with pytest.raises(ValueError, match="gate_vec"):
        call(gv=torch.zeros(63).numpy())


def test_native_views_follow_replaced_buffers():
    # a module's cached numpy views are rebuilt when a buffer is replaced
    g = torch.Generator().manual_seed(13)
    lin = torch.nn.Linear(64, 16, bias=False)
    q = QuantizedLinear.from_linear(lin, "int8")
    first = q.views()
    assert q.views() is first
    x = torch.randn(1, 64, generator=g)
    before = q(x)
    q.qweight = q.qweight.clone().neg_()  # a new tensor: the old views would read the old weight
    assert q.views() is not first
    assert torch.equal(q(x), -before) or kernels.isa() == "torch" and torch.allclose(q(x), -before)
    # parameters (their .data replaced, as Module.to() does) and a child's, by dotted name
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(3))
    m.child = torch.nn.Linear(2, 2, bias=False)
    made = []
    make = lambda *ts: made.append(ts) or len(made)  # noqa: E731
    names = ("a", "child.weight")
    assert kernels.native_views(m, names, make) == 1 == kernels.native_views(m, names, make)
    m.a.data = torch.ones(3)
    assert kernels.native_views(m, names, make) == 2
    m.child.weight.data = torch.ones(2, 2)
    assert kernels.native_views(m, names, make) == 3 and made[-1][1] is m.child.weight
    # another kind of view of the same tensors keeps its own entry, and leaves this one alone
    assert kernels.native_views(m, names, lambda *ts: "other") == "other"
    assert kernels.native_views(m, names, make) == 3


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_float_linears(dtype):
    """Plain float linears run their few-row calls natively once wrapped: outputs within
    float32 summation order of torch's (bf16: within its rounding), hooks see every call,
    and more rows, autograd, biased or hooked modules keep torch's forward."""
    g = torch.Generator().manual_seed(14)
    net = torch.nn.Sequential(torch.nn.Linear(40, 24, bias=False), torch.nn.Linear(24, 8), torch.nn.Linear(8, 8, bias=False))
    net.to(dtype)
    net[2].register_forward_pre_hook(lambda *a: None)
    assert native_float_linears(net) == 1  # the biased and the hooked ones are left alone
    assert native_float_linears(net) == 0  # already wrapped
    lin = net[0]
    seen = []
    lin.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    few, many = torch.randn(2, 3, 40, generator=g).to(dtype), torch.randn(kernels.FLOAT_LINEAR_MAX_TOKENS + 1, 40, generator=g).to(dtype)
    ref = torch.nn.functional.linear
    bf16_native = dtype == torch.bfloat16 and kernels.torch_bf16_is_slow()
    native_calls = []
    real = kernels.qlinear_multi
    kernels.qlinear_multi = lambda x, ws, **k: native_calls.append(x.shape) or real(x, ws, **k)
    try:
        with torch.inference_mode():
            y = lin(few)
            assert y.dtype == dtype and y.shape == (2, 3, 24)
            assert max_rel(y, few.float() @ lin.weight.float().T) < (1e-6 if dtype == torch.float32 else 1e-2)
            y = lin(many)
            if bf16_native:  # torch's bf16 GEMM is slow here: every bf16 call is native
                assert max_rel(y, many.float() @ lin.weight.float().T) < 1e-2
            else:
                assert torch.equal(y, ref(many, lin.weight))
        assert torch.equal(lin(few), ref(few, lin.weight))  # autograd on
    finally:
        kernels.qlinear_multi = real
    assert native_calls == [(2, 3, 40)] + ([many.shape] if bf16_native else [])
    assert seen == [(2, 3, 24), (kernels.FLOAT_LINEAR_MAX_TOKENS + 1, 24), (2, 3, 24)]


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("shape", [(1, 1, 128), (3, 5, 20), (7, 2048)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(isa, shape, offset):
    """The native RMSNorm of a few rows against torch's (float32, 1e-6: summation order)."""
    g = torch.Generator().manual_seed(shape[-1])
    x, w = torch.randn(*shape, generator=g), torch.randn(shape[-1], generator=g)
    with kernels.use_isa(isa):
        got = kernels.rms_norm(x, w, 1e-6, offset)
    assert got.shape == x.shape and max_rel(got, kernels.rms_norm_ref(x, w, 1e-6, offset)) < 1e-6


@pytest.mark.parametrize("isa", NATIVE)
def test_rms_norm_grouped_weights(isa):
    """A [G, D] weight norms column block g of each row with weight[g]: the separate norms,
    bit for bit (zero-centred too), and the torch reference within summation order."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 3, 24, generator=g), torch.randn(3, 24, generator=g)
    with kernels.use_isa(isa):
        got = kernels.rms_norm(x, w, 1e-6, 1.0)
        each = torch.stack([kernels.rms_norm(x[:, i], w[i], 1e-6, 1.0) for i in range(3)], dim=1)
    assert torch.equal(got, each)
    assert max_rel(got, kernels.rms_norm_ref(x, w, 1e-6, 1.0)) < 1e-6


def test_rms_norm_cat_is_the_separate_norms():
    """rms_norm_cat: the norms of several inputs side by side, one native call, bit-identical
    to cat of the modules' own outputs; with a hook on one norm, the modules run (and the hook
    sees its call)."""
    from moerun.layers.norm import RMSNorm, rms_norm_cat

    owner = torch.nn.Module()
    owner.a, owner.b = RMSNorm(16, 1e-6, zero_centered=True), RMSNorm(16, 1e-6)
    for n in (owner.a, owner.b):
        torch.nn.init.normal_(n.weight)
    for dtype in (torch.float32, torch.bfloat16):  # bf16: float32 inside, rounded once, both ways
        xs = [torch.randn(2, 3, 16).to(dtype), torch.randn(2, 3, 16).to(dtype)]
        with torch.inference_mode():
            want = torch.cat([owner.a(xs[0]), owner.b(xs[1])], dim=-1)
            assert want.dtype == dtype
            assert torch.equal(rms_norm_cat(owner, ("a", "b"), xs), want)
            seen = []
            h = owner.b.register_forward_hook(lambda m, a, o: seen.append(o.shape))
            assert torch.equal(rms_norm_cat(owner, ("a", "b"), xs), want) and seen == [torch.Size([2, 3, 16])]
            h.remove()
    # with autograd (training) the torch ops run, and gradients reach the inputs and weights
    xs = [torch.randn(2, 3, 16, requires_grad=True), torch.randn(2, 3, 16, requires_grad=True)]
    rms_norm_cat(owner, ("a", "b"), xs).sum().backward()
    assert all(x.grad is not None for x in xs) and owner.a.weight.grad is not None


def test_rms_norm_falls_back_for_other_dtypes_and_large_inputs():
    w = torch.randn(64)
    xb = torch.randn(2, 64).bfloat16()
    assert torch.equal(kernels.rms_norm(xb, w, 1e-6), kernels.rms_norm_ref(xb, w, 1e-6))
    big = torch.randn(kernels.RMS_NORM_MAX // 64 + 1, 64)
    assert torch.equal(kernels.rms_norm(big, w, 1e-6, 1.0), kernels.rms_norm_ref(big, w, 1e-6, 1.0))


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_rms_norm_refuses_bad_arguments():
    nat = kernels._native()
    x, w, out = torch.zeros(2, 8), torch.ones(8), torch.zeros(2, 8)
    nat.rms_norm(x.numpy(), w.numpy(), out.numpy(), 1e-6)  # well-formed: runs
    with pytest.raises(ValueError, match=r"w must be \[D\] or \[G, D\]"):
        nat.rms_norm(x.numpy(), torch.ones(9).numpy(), out.numpy(), 1e-6)
    with pytest.raises(ValueError, match="multiple of G"):
        nat.rms_norm(x.numpy(), torch.ones(3, 8).numpy(), out.numpy(), 1e-6)
    with pytest.raises(ValueError, match="out: dimension 0"):
        nat.rms_norm(x.numpy(), w.numpy(), torch.zeros(3, 8).numpy(), 1e-6)
    with pytest.raises(ValueError, match="x: wrong dtype"):
        nat.rms_norm(x.double().numpy(), w.numpy(), out.numpy(), 1e-6)
    with pytest.raises(ValueError, match="out: wrong dtype"):  # float32 or bf16 (uint16) only
        nat.rms_norm(x.numpy(), w.numpy(), out.double().numpy(), 1e-6)
    with pytest.raises(ValueError, match=r"x must be \[M, D\]"):
        nat.rms_norm(torch.zeros(8).numpy(), w.numpy(), out.numpy(), 1e-6)


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
@pytest.mark.parametrize("T,H,D,rd", [(1, 4, 64, 64), (5, 3, 128, 64), (300, 8, 128, 128), (64, 2, 96, 32)])
@pytest.mark.parametrize("norm", ["plain", "zero_centered", "none"])
def test_norm_rope_heads(T, H, D, rd, norm):
    """Per-head RMSNorm + rope into the head-major layout against the torch ops (one pass
    over the pool from 64 rows on, row by row below)."""
    g = torch.Generator().manual_seed(T * H + D + rd)
    x = torch.randn(T, H, D, generator=g)
    w = None if norm == "none" else torch.randn(D, generator=g)
    offset = 1.0 if norm == "zero_centered" else 0.0
    pos = torch.arange(T)[:, None] * 0.01 * torch.arange(rd)[None]
    cos, sin = pos.cos(), pos.sin()
    got = kernels.norm_rope_heads(x, w, 1e-6, offset, cos, sin)
    ref = kernels.norm_rope_heads_ref(x, w, 1e-6, offset, cos, sin)
    assert got.shape == (H, T, D) and got.is_contiguous()
    assert max_rel(got, ref) < 1e-5
    if rd < D:  # past the rotary dims only the norm applies
        normed = x if w is None else kernels.rms_norm_ref(x, w, 1e-6, offset)
        assert max_rel(got[..., rd:], normed.transpose(0, 1)[..., rd:]) < 1e-5


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_norm_rope_heads_refuses_bad_arguments():
    nat = kernels._native()
    x, w, cs, out = torch.zeros(3, 2, 8), torch.ones(8), torch.zeros(3, 8), torch.zeros(2, 3, 8)
    nat.norm_rope_heads(x.numpy(), w.numpy(), cs.numpy(), cs.numpy(), out.numpy(), 1e-6)  # well-formed: runs
    nat.norm_rope_heads(x.numpy(), torch.zeros(0).numpy(), cs.numpy(), cs.numpy(), out.numpy(), 1e-6)  # no norm
    cases = [
        ((torch.zeros(3, 16), w, cs, cs, out), r"x must be \[T, H, D\]"),
        ((x, torch.ones(9), cs, cs, out), r"w must be \[D\] or empty"),
        ((x, w, torch.zeros(4, 8), cs, out), r"cos must be \[T, rd\]"),
        ((x, w, torch.zeros(3, 7), torch.zeros(3, 7), out), "even and at most D"),
        ((x, w, torch.zeros(3, 10), torch.zeros(3, 10), out), "even and at most D"),
        ((x, w, cs, torch.zeros(3, 6), out), "sin: dimension 1"),
        ((x, w, cs, cs, torch.zeros(3, 2, 8)), "out: dimension 0"),
        ((x.double(), w, cs, cs, out), "x: wrong dtype"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            nat.norm_rope_heads(*(a.numpy() for a in args), 1e-6)


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_qwen3_attention_runs_norm_and_rope_as_one_call(monkeypatch):
    """A float32 Qwen3-MoE attention block of one row hands its q and k to norm_rope_heads
    (prefill and decode alike), and the result is the torch composition's."""
    from moerun.layers import rope as rope_mod
    from moerun.models import qwen3_moe

    args = qwen3_moe.ModelArgs.from_dict(dict(
        model_type="qwen3_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
        vocab_size=32, rms_norm_eps=1e-6, rope_theta=10000.0))
    attn = qwen3_moe.Attention(args).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(1, 9, 64, generator=g)
    rope = rope_mod.Rope({"rope_type": "default", "rope_theta": 10000.0}, 16, 64)
    cos_sin = rope(torch.arange(9)[None], torch.float32)
    calls = []
    real = kernels.norm_rope_heads
    monkeypatch.setattr(kernels, "norm_rope_heads", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        got = attn(x, cos_sin, None, None, None)
    assert calls == [(9, 4, 16), (9, 2, 16)]
    monkeypatch.setattr(kernels, "norm_rope_heads", kernels.norm_rope_heads_ref)
    with torch.inference_mode():
        ref = attn(x, cos_sin, None, None, None)
    assert max_rel(got, ref) < 1e-5
    # a hook on the q norm must see it called: q then takes the torch ops, k stays native
    seen = []
    attn.q_norm.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    calls.clear()
    monkeypatch.setattr(kernels, "norm_rope_heads", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        hooked = attn(x, cos_sin, None, None, None)
    assert seen == [(1, 9, 4, 16)] and calls == [(9, 2, 16)]
    assert max_rel(hooked, ref) < 1e-5


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
@pytest.mark.parametrize("head", ["bf16", "int8"])
def test_head_logits_of_a_bf16_model_keep_float32_precision(head):
    """`layers.linear.head_logits`: a bf16 model's logits are the native product's float32
    sums, not rounded to bf16 (where logits within 1/256 tie and argmax takes the lower id)."""
    from moerun.layers.linear import head_logits

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 500, bias=False).to(torch.bfloat16)
    if head == "int8":
        lin = QuantizedLinear.from_linear(lin, "int8")
    else:
        assert native_float_linears(torch.nn.Sequential(lin)) == 1  # its forward: the native bf16 product
    h = torch.randn(2, 3, 256).to(torch.bfloat16)
    with torch.inference_mode():
        got = head_logits(lin, h)
        rounded = lin(h)  # the module's own output: rounded to bf16
    assert got.dtype == torch.float32 and got.shape == (2, 3, 500)
    assert torch.equal(got.to(torch.bfloat16), rounded)  # the same product, rounded once at the end
    assert not torch.equal(got, rounded.float())  # ... which head_logits does not do
