"""`attend`'s one-token decode path (grouped matmul over the cache) against SDPA."""

import pytest
import torch
import torch.nn.functional as F

from moerun.layers.cache import Cache, KVSpec
from moerun.layers.attention import attend, decode_attention


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 4), (6, 1)])
def test_decode_attention_matches_sdpa(dtype, tol, hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    q = torch.randn(1, hq, 1, 32, generator=g).to(dtype)
    k = torch.randn(1, hkv, 200, 32, generator=g).to(dtype)
    v = torch.randn(1, hkv, 200, 24, generator=g).to(dtype)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.3, enable_gqa=True)
    got = decode_attention(q, k, v, 0.3)
    assert got.shape == (1, hq, 1, 24) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_attend_uses_every_cached_position_in_decode():
    """Through the cache, past the 128-token switch: equal to one uncached causal pass."""
    g = torch.Generator().manual_seed(0)
    S = 150
    q, k, v = (torch.randn(1, h, S, 16, generator=g) for h in (4, 2, 2))
    full = attend(q, k, v, None, None, None, 0.25)
    cache = Cache([KVSpec(2, 16, 16)], 1, S, torch.float32)
    slots = torch.tensor([0])
    attend(q[:, :, : S - 1], k[:, :, : S - 1], v[:, :, : S - 1], cache.layers[0], slots, torch.tensor([0]), 0.25)
    last = attend(q[:, :, S - 1 :], k[:, :, S - 1 :], v[:, :, S - 1 :], cache.layers[0], slots, torch.tensor([S - 1]), 0.25)
    torch.testing.assert_close(last, full[:, :, S - 1 :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("T", [2, 5, 8])
def test_attend_few_queries_are_decode_steps(kv_dtype, T):
    """A few tokens of one row through the cache (a verification pass) run query by query:
    causal (equal to one uncached pass, within the cache's rounding) and bit-identical to
    feeding the same tokens one at a time."""
    g = torch.Generator().manual_seed(T)
    S = 20 + T
    q, k, v = (torch.randn(1, h, S, 16, generator=g) for h in (4, 2, 2))
    full = attend(q, k, v, None, None, None, 0.25)
    slots = torch.tensor([0])

    def prefilled():
        cache = Cache([KVSpec(2, 16, 16)], 1, S, torch.float32, kv_dtype)
        attend(q[:, :, :20], k[:, :, :20], v[:, :, :20], cache.layers[0], slots, torch.tensor([0]), 0.25)
        return cache.layers[0]

    kv = prefilled()
    few = attend(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], kv, slots, torch.tensor([20]), 0.25)
    kv = prefilled()
    steps = torch.cat([attend(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], kv, slots,
                              torch.tensor([t]), 0.25) for t in range(20, S)], dim=2)
    assert torch.equal(few, steps)
    tol = 1e-5 if kv_dtype == torch.float32 else 5e-2
    torch.testing.assert_close(few, full[:, :, 20:], rtol=tol, atol=tol)


@pytest.mark.parametrize("batch", [1, 2])
def test_cache_update_writes_reads_and_refuses_overflow(batch):
    """KVCache.update for one row (the helpers' one-row paths) and for a batch: values land
    at each row's positions, everything up to the longest row comes back, and writing past
    max_len is an error, not a silent truncation."""
    g = torch.Generator().manual_seed(batch)
    cache = Cache([KVSpec(2, 8, 4)], batch, 6, torch.float32)
    kv = cache.layers[0]
    slots, pos0 = torch.arange(batch), torch.tensor([2] * batch)
    k, v = torch.randn(batch, 2, 3, 8, generator=g), torch.randn(batch, 2, 3, 4, generator=g)
    k_all, v_all = kv.update(slots, pos0, k, v)
    assert k_all.shape == (batch, 2, 5, 8) and v_all.shape == (batch, 2, 5, 4)
    assert torch.equal(k_all[:, :, 2:5], k) and torch.equal(v_all[:, :, 2:5], v)
    assert not k_all[:, :, :2].any()
    with pytest.raises(ValueError, match="exceeds the cache's 6"):
        kv.update(slots, torch.tensor([4] * batch), k, v)


@pytest.mark.parametrize("slots", [[0, 1], [2, 0]])
def test_recurrent_state_set_casts_to_its_dtype(slots):
    """A state with its own dtype (fp32 in a bf16 model's cache) takes bf16 values at any
    slots, contiguous or scattered."""
    from moerun.layers.cache import RecurrentState, StateSpec

    st = RecurrentState(StateSpec(shapes=(("conv", (4, 3)),), dtypes=(("conv", torch.float32),)), 3, torch.bfloat16)
    value = torch.randn(2, 4, 3).bfloat16()
    st.set("conv", torch.tensor(slots), value)
    assert st.tensors["conv"].dtype == torch.float32
    assert torch.equal(st.tensors["conv"][slots], value.float())


def test_recurrent_state_set_of_what_get_gave_writes_nothing_else():
    """`set` with the view `get` gave (updated in place) leaves the state as it is; a
    one-row view of slot 0 set into two slots still broadcasts; set_slot writes one slot."""
    from moerun.layers.cache import RecurrentState, StateSpec

    st = RecurrentState(StateSpec(shapes=(("s", (2,)),), dtypes=()), 3, torch.float32)
    view = st.get("s", torch.tensor([0, 1]))
    view.fill_(5.0)
    st.set("s", torch.tensor([0, 1]), view)
    assert st.tensors["s"].tolist() == [[5.0, 5.0], [5.0, 5.0], [0.0, 0.0]]
    st.tensors["s"][0] = torch.tensor([1.0, 2.0])
    st.set("s", torch.tensor([0, 1]), st.tensors["s"][:1])
    assert st.tensors["s"].tolist() == [[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]]
    st.set_slot("s", 2, torch.tensor([7.0, 8.0]))
    assert st.tensors["s"][2].tolist() == [7.0, 8.0]


def test_recurrent_state_scratch_is_one_buffer_per_name_grown_when_needed():
    """Passes of different sizes taking turns reuse one allocation per name (contiguous views
    of the asked shape); a larger shape grows it once, a smaller one fits in it again."""
    from moerun.layers.cache import RecurrentState, StateSpec

    st = RecurrentState(StateSpec(shapes=(("conv", (4, 3)),)), 2, torch.float32)
    a = st.scratch("conv", (2, 3, 4, 3))
    assert a.shape == (2, 3, 4, 3) and a.is_contiguous() and a.dtype == torch.float32
    assert st.scratch("conv", (2, 3, 4, 3)).data_ptr() == a.data_ptr()
    b = st.scratch("conv", (2, 5, 4, 3))  # more room: a new buffer
    assert b.shape == (2, 5, 4, 3) and b.is_contiguous()
    for shape in ((2, 3, 4, 3), (1, 4, 4, 3), (2, 5, 4, 3)):  # sizes taking turns: the same memory
        c = st.scratch("conv", shape)
        assert c.shape == shape and c.is_contiguous() and c.data_ptr() == b.data_ptr()
        assert st.scratch("conv", list(shape)) is c  # the view kept for the shape, asked again
    d = st.scratch("conv", (3, 5, 4, 3))  # grown again: no view of the old buffer is handed out
    assert st.scratch("conv", (2, 3, 4, 3)).data_ptr() == d.data_ptr() != b.data_ptr()
    assert st.scratch("conv", (2, 3, 4, 3), torch.float64).dtype == torch.float64
    assert st.scratch("recurrent", (1,)).data_ptr() != b.data_ptr()


# -- the fused attention block's variants against the modules' own torch forward -------------
# (Qwen2-MoE: q/k/v biases and per-layer sliding windows; OLMoE: q/k norms across all heads;
# Mixtral: a sliding window), on every kernel path this CPU has

from moerun import kernels  # noqa: E402
from test_kernels import fused_attentions, torch_attention  # noqa: E402

NATIVE = [i for i in kernels.available_isas() if i != "torch"]


def _variant_net(arch: str, tmp_path, dtype: str, quant):
    """A tiny random model of `arch` (test_stack_archs.ARCHS)."""
    import moerun
    from test_stack_archs import ARCHS

    torch.manual_seed(0)
    ARCHS[arch]().eval().save_pretrained(tmp_path)
    return moerun.load(tmp_path, dtype=dtype, threads=1, quant=quant).net


def _variant_run(net, dtype):
    """Two rows of different lengths prefilled into slots (2, 0), then each row alone for
    one-token steps and a pass of three (past the windows), then three decode steps of the
    batch -> the logits of every step, the cache."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 97, (1, 16), generator=g), torch.randint(0, 97, (1, 16), generator=g)
    cache = Cache(net.cache_spec(), 3, 24, dtype)
    out = []
    for ids, s in ((a, 2), (b, 0)):
        sl = torch.tensor([s])
        out.append(net(ids[:, :6], cache, sl)[:, -1])
        out += [net(ids[:, i : i + 1], cache, sl)[:, -1] for i in range(6, 9)]
        out += list(net(ids[:, 9:12], cache, sl)[0])
    both = torch.cat([a, b])
    out += list(net(both[:, i : i + 1], cache, torch.tensor([2, 0]))[:, -1] for i in range(12, 15))
    return torch.cat([o.reshape(-1, 97) for o in out]), cache


@pytest.mark.skipif(not NATIVE, reason="needs the native extension")
@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen2_moe-window", "olmoe", "mixtral-window"])
@pytest.mark.parametrize("dtype, quant, tol, cache_tol", [("float32", "int4", 1e-4, 1e-5), ("float32", None, 1e-4, 1e-5),
                                                          ("bfloat16", "int4", 6e-2, 0.1)])
def test_fused_attention_variants_match_the_module(isa, arch, dtype, quant, tol, cache_tol, tmp_path):
    """The native block (bias, norms across heads, windows) against the module's own torch
    forward: the same logits, alone and in a batch, and the same keys and values in the cache
    (bf16: within bf16 rounding, the block keeps q and k in float32 where the module rounds
    them after each op)."""
    net = _variant_net(arch, tmp_path, dtype, quant)
    kv = net.model.embed_tokens.weight.dtype
    attn = net.model.layers[0].self_attn
    with torch.inference_mode(), kernels.use_isa(isa):
        with torch_attention():  # the module's own forward: the torch reference
            want, want_cache = _variant_run(net, kv)
        assert fused_attentions(net) == len(net.model.layers)
        variants = kernels.attn_plan(attn)[3]
        assert set(variants) == {"qwen2_moe": {"qkv_bias"}, "qwen2_moe-window": {"qkv_bias", "window"},
                                 "olmoe": set(), "mixtral-window": {"window"}}[arch]
        if arch == "olmoe":  # the norms across heads: weights of all heads' width
            assert kernels.attn_plan(attn)[0][12].shape == (attn.n_heads * attn.head_dim,)
        got, got_cache = _variant_run(net, kv)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for a, b in zip(got_cache.layers, want_cache.layers):
        torch.testing.assert_close(a.k.float(), b.k.float(), rtol=cache_tol, atol=cache_tol)
        torch.testing.assert_close(a.v.float(), b.v.float(), rtol=cache_tol, atol=cache_tol)


@pytest.mark.skipif(not NATIVE, reason="needs the native extension")
def test_attn_block_variants_refuse_bad_arguments():
    """The variants' arguments are checked: one line each."""
    from test_kernels import attn_block_inputs

    nat = kernels._native()
    H, Hq, Hkv, D, lin, kc, vc, none = attn_block_inputs()

    def call(qn=none, kn=none, **variants):
        args = [torch.randn(1, H).numpy()]
        for n in "qkvo":
            args += [lin[n][0].numpy(), lin[n][1].numpy(), 8]
        nat.attn_block_decode(*args, qn.numpy(), kn.numpy(), 1e-6, torch.ones(1, D).numpy(), torch.zeros(1, D).numpy(),
                              kc.numpy(), vc.numpy(), 3, Hq, 0.25, torch.empty(1, H).numpy(), **variants)

    call(qkv_bias=torch.zeros((Hq + 2 * Hkv) * D).numpy(), window=2)  # well-formed: runs
    call(qn=torch.ones(Hq * D), kn=torch.ones(Hkv * D))  # norms across heads
    call(qn=torch.ones(D), kn=torch.ones(D))  # per head
    with pytest.raises(ValueError, match="qkv_bias"):
        call(qkv_bias=torch.zeros(Hq * D).numpy())
    with pytest.raises(ValueError, match="qkv_bias"):
        call(qkv_bias=torch.zeros((Hq + 2 * Hkv) * D, dtype=torch.float64).numpy())
    with pytest.raises(ValueError, match="window"):
        call(window=-1)
    with pytest.raises(ValueError, match="q/k norm"):
        call(qn=torch.ones(Hq * D), kn=torch.ones(D))  # across for q, per head for k
