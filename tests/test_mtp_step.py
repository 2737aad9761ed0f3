"""An MTP head's draft steps as a few native calls (`layers.mtp.native_step`,
`kernels.MtpStep`): bit-identical to its modules one by one, over the calls speculative
decoding makes (a catch-up over the tokens accepted since the last draft, then chained
one-token drafts), in float32 and bf16, with quantized weights and a drafter's smaller head;
the experts' hooks still see their arguments; anything it does not cover runs the modules."""

import numpy as np
import pytest
import torch
from torch import nn

import moerun
from moerun import kernels
from moerun.layers.cache import Cache
from moerun.engine.draft_extras import ExpertTracker
from moerun.engine.draft_extras import draft_head
from moerun.layers import mtp as mtp_layers
from moerun.models import qwen3_5_moe

pytestmark = pytest.mark.skipif(not kernels.native(), reason="native extension not built")


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    from test_speculative import build_qwen

    return build_qwen(tmp_path_factory.mktemp("qwen_mtp_step"), vocab_size=300)


def draft_calls(net, head=None, kv_dtype=None):
    """MTP calls as a speculative run makes them, on 2 slots of one cache (slot 1 at its own
    positions): a catch-up over 3 pending pairs, chained drafts, a catch-up over 2, one over
    5 -> every call's logits and hidden state, and the cache's keys and values."""
    g = torch.Generator().manual_seed(3)
    H, V = net.args.hidden_size, net.args.vocab_size
    dtype = net.model.embed_tokens.weight.dtype
    cache = Cache(net.mtp_cache_spec(), 2, 24, dtype, kv_dtype)
    cache.lengths[0] = 4  # the head's cache starts where the trunk's pending states do
    out = []
    for slot, T in ((1, 3), (1, 1), (1, 1), (0, 2), (1, 1), (0, 5), (0, 1)):
        hidden = torch.randn(1, T, H, generator=g).to(dtype)
        tokens = torch.randint(0, V, (1, T), generator=g)
        logits, h = net.mtp_logits(hidden, tokens, cache, torch.tensor([slot]), return_hidden=True, head=head,
                                   last_only=True)
        out += [logits, h]
    kv = cache.layers[0]
    return out, [kv.k.clone(), kv.v.clone()], cache.lengths.clone()


def run_both(net, monkeypatch, head=None, calls=draft_calls):
    """`calls` (draft_calls) with the native step, then with the modules -> (both, how many
    calls the native step took)."""
    taken = []
    real = qwen3_5_moe.native_step
    with monkeypatch.context() as m, torch.inference_mode():
        m.setattr(qwen3_5_moe, "native_step", lambda *a: taken.append(r := real(*a)) or r)
        got = calls(net, head)
        m.setattr(qwen3_5_moe, "native_step", lambda *a: None)
        want = calls(net, head)
    return got, want, sum(r is not None for r in taken)


def assert_same(got, want):
    """Every tensor of `got` (tensors, or lists of them) equals `want`'s bit for bit."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        a, b = (a, b) if isinstance(a, list) else ([a], [b])
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "int4"])
@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_native_step_is_bit_identical(mtp_path, dtype, quant, draft_vocab, monkeypatch):
    net = moerun.load(mtp_path, dtype=dtype, threads=2, quant=quant).net
    head = None if draft_vocab is None else draft_head(net.lm_head, draft_vocab)
    got, want, native = run_both(net, monkeypatch, head)
    assert native == 7
    assert got[0][0].shape == (1, 1, draft_vocab or net.args.vocab_size)
    assert_same(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_catch_up_is_one_call(mtp_path, dtype, monkeypatch):
    """A catch-up over more pairs than a fused trunk pass takes (9) is one native call, equal
    bit for bit to calls over 5 and then 4 (each position computed as a draft step computes
    it), and close to the modules (which run it as a prefill: torch's attention); past
    `mtp.MAX_TOKENS` the modules run it."""
    net = moerun.load(mtp_path, dtype=dtype, threads=2).net
    g = torch.Generator().manual_seed(5)
    H, V = net.args.hidden_size, net.args.vocab_size
    wdtype = net.model.embed_tokens.weight.dtype
    hidden = torch.randn(1, 9, H, generator=g).to(wdtype)
    tokens = torch.randint(0, V, (1, 9), generator=g)

    def catch_up(splits):
        cache = Cache(net.mtp_cache_spec(), 1, 16, wdtype)
        cache.lengths[0] = 3
        for a, b in splits:
            logits, h = net.mtp_logits(hidden[:, a:b], tokens[:, a:b], cache, torch.tensor([0]), return_hidden=True,
                                       last_only=True)
        return [logits, h, cache.layers[0].k.clone(), cache.layers[0].v.clone()]

    taken = []
    real = qwen3_5_moe.native_step
    with torch.inference_mode():
        monkeypatch.setattr(qwen3_5_moe, "native_step", lambda *a: taken.append(r := real(*a)) or r)
        one = catch_up([(0, 9)])
        assert [r is not None for r in taken] == [True]
        assert_same(one, catch_up([(0, 5), (5, 9)]))
        monkeypatch.setattr(mtp_layers, "MAX_TOKENS", 8)
        taken.clear()
        past = catch_up([(0, 9)])
        assert [r is not None for r in taken] == [False]
        monkeypatch.setattr(qwen3_5_moe, "native_step", lambda *a: None)
        assert_same(past, catch_up([(0, 9)]))
    tol = 1e-5 if dtype == "float32" else 3e-2
    for a, b in zip(one, past):
        assert float((a.float() - b.float()).abs().max()) <= tol * float(b.float().abs().max())


def test_experts_watchers_see_the_native_step(mtp_path, monkeypatch):
    """An expert tracker (route masks) counts the same union either way, and a forward
    pre-hook on the head's experts is called with the same (h, ids, weights)."""
    net = moerun.load(mtp_path, dtype="bfloat16", threads=2).net
    tracker = ExpertTracker(net)
    bytes_seen = []
    hooked = []
    handle = net.mtp.layers[0].mlp.experts.register_forward_pre_hook(lambda m, args: hooked.append(args))

    def tracked(net, head):
        hooked.clear()
        tracker.start_pass("draft")
        r = draft_calls(net, head)
        tracker.end_pass()
        bytes_seen.append(tracker.bytes["draft"])
        return r, list(hooked)

    (got, got_args), (want, want_args), native = run_both(net, monkeypatch, calls=lambda n, h: tracked(n, h))
    handle.remove()
    tracker.close()
    assert native == 7 and bytes_seen[0] > 0 and bytes_seen[1] == 2 * bytes_seen[0]
    assert len(got_args) == len(want_args) == 7
    for a, b in zip(got_args, want_args):
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
    assert_same(got, want)


def test_hooks_and_unfusable_parts_run_the_modules(mtp_path, monkeypatch):
    """A hook on fc, the final norm or the decoder layer, or a head no native call reads:
    the modules (the hook sees its call), the same outputs; new weights are followed."""
    net = moerun.load(mtp_path, dtype="float32", threads=2).net
    mtp = net.mtp
    for module in (mtp.fc, mtp.norm, mtp.layers[0], net.model.embed_tokens):
        seen = []
        handle = module.register_forward_hook(lambda m, a, o: seen.append(1))
        got, want, native = run_both(net, monkeypatch)
        handle.remove()
        assert native == 0 and len(seen) == 2 * 7 and len(got[0]) == len(want[0])
        assert_same(got, want)

    class Head(nn.Module):  # a head of another kind: the modules run it
        def forward(self, h):
            return net.lm_head(h) * 2

    got, want, native = run_both(net, monkeypatch, Head())
    assert native == 0
    assert_same(got, want)
    # an int8 KV cache (the fused attention reads float ones only): the modules
    got, want, native = run_both(net, monkeypatch, calls=lambda n, h: draft_calls(n, h, torch.int8))
    assert native == 0
    assert_same(got, want)
    before, _, native = run_both(net, monkeypatch)
    assert native == 7
    with torch.no_grad():
        mtp.fc.weight.data = mtp.fc.weight.data * -1  # new memory: the plan kept on the head follows it
    got, want, native = run_both(net, monkeypatch)
    assert native == 7 and not torch.equal(got[0][0], before[0][0])
    assert_same(got, want)


def test_mtp_step_refuses_bad_arguments(mtp_path, monkeypatch):
    """The binding checks what it is given, once for the weights (`NativeMtp`) and at each
    call for the rest: one clear ValueError each, nothing run."""
    net = moerun.load(mtp_path, dtype="float32", threads=2).net
    nat = kernels._native()
    Real = nat.NativeMtp
    made, ran = [], []

    class Capture:
        def __init__(self, *a):
            made.append(a)
            self.native = Real(*a)

        def run(self, *a):
            ran.append(a)
            return self.native.run(*a)

    monkeypatch.setattr(nat, "NativeMtp", Capture)
    with torch.inference_mode():
        draft_calls(net)
    monkeypatch.setattr(nat, "NativeMtp", Real)
    args = list(made[0])  # embed, pre_w, pre_eps, fc ..., the attention's, the MoE half's, the final norm's, the head's
    call = next(list(a) for a in ran if a[0].shape == (1,))  # a one-token call: tokens, hidden, cos, sin, pos ...
    H = net.args.hidden_size
    native = Real(*args)
    native.run(*call)  # as captured: runs

    def bad_weights(i, value, match):
        a = list(args)
        a[i] = value
        with pytest.raises(ValueError, match=match):
            Real(*a)

    def bad_call(i, value, match):
        a = list(call)
        a[i] = value
        with pytest.raises(ValueError, match=match):
            native.run(*a)

    bad_weights(0, np.zeros((5, H), dtype=np.uint8), "embed")
    bad_weights(1, np.zeros((3, H), dtype=np.float32), "pre_w")
    bad_weights(3, np.zeros((H + 1, 2 * H), dtype=np.float32), "fc")
    bad_call(0, np.array([net.args.vocab_size], dtype=np.int64), "outside the embedding")
    bad_call(0, np.array([1, 2], dtype=np.int64), "tokens")
    bad_call(1, np.zeros((1, H), dtype=np.uint16), "model's dtype")
    bad_call(2, np.zeros((2, 4), dtype=np.float32), "cos, sin")
    bad_call(4, 10**6, "position outside the cache")
    bad_call(len(call) - 2, np.zeros((2, H), dtype=np.float32), "h")
    bad_call(len(call) - 1, np.zeros((1, 7), dtype=np.float32), "logits")


def test_drafter_gives_the_calls_of_mtp_logits(mtp_path):
    """A `Drafter` made once for a slot (`mtp_drafter`) gives each call of a run what
    `mtp_logits` gives it, bit for bit, and leaves the same keys and values; more tokens than
    one native call takes are refused (None), for the caller to run the modules."""
    net = moerun.load(mtp_path, dtype="bfloat16", threads=2).net
    H, V = net.args.hidden_size, net.args.vocab_size
    dtype = net.model.embed_tokens.weight.dtype
    g = torch.Generator().manual_seed(5)
    caches = [Cache(net.mtp_cache_spec(), 2, 24, dtype) for _ in range(2)]
    with torch.inference_mode():
        drafter = net.mtp_drafter(caches[0], 1)
        assert drafter is not None
        pos = 0
        for T in (3, 1, 1, 2, 1):
            hidden = torch.randn(1, T, H, generator=g).to(dtype)
            tokens = torch.randint(0, V, (1, T), generator=g)
            got = drafter.run(hidden, tokens, pos)
            want = net.mtp_logits(hidden, tokens, caches[1], torch.tensor([1]), return_hidden=True, last_only=True)
            assert_same(list(got), list(want))
            pos += T
        assert int(caches[1].lengths[1]) == pos
        assert_same([caches[0].layers[0].k, caches[0].layers[0].v], [caches[1].layers[0].k, caches[1].layers[0].v])
        too_many = mtp_layers.MAX_TOKENS + 1
        assert drafter.run(torch.zeros(1, too_many, H, dtype=dtype), torch.zeros(1, too_many, dtype=torch.long),
                           pos) is None


def test_a_single_stream_run_drafts_through_one_drafter(mtp_path):
    """Speculative decoding of one row makes its drafter once and calls it for the head's
    steps (a batch of rows calls `mtp_logits`); the output is plain greedy's."""
    from moerun.engine.generate import Sequence, run
    from moerun.engine.sampling import SamplingParams
    from moerun.engine.speculative import SpeculativeDecoder, SpeculativeStats
    from moerun.layers.mtp import Drafter

    model = moerun.load(mtp_path, dtype="bfloat16", threads=2)
    net = model.net
    calls, module_calls = [], []
    real, real_logits = Drafter.run, net.mtp_logits

    def counted(self, *a):
        calls.append(r := real(self, *a))
        return r

    def seqs(n):
        return [Sequence([5 + i, 9, 17, 3], SamplingParams(max_tokens=12, temperature=0.0)) for i in range(n)]

    for rows in (1, 2):
        plain = seqs(rows)
        for _ in run(net, plain, set(), model.dtype):
            pass
        spec = seqs(rows)
        dec = SpeculativeDecoder(net, model.dtype, draft_tokens=2)
        stats = SpeculativeStats()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(Drafter, "run", counted)
            m.setattr(net, "mtp_logits", lambda *a, **k: module_calls.append(1) or real_logits(*a, **k))
            for _ in dec.run(spec, set(), stats):
                pass
        assert [s.out_ids for s in spec] == [s.out_ids for s in plain]
        # two head calls a step (the catch-up and one chained draft), each through the drafter
        # for one row (the prompt's 4 pairs fit one call), through mtp_logits for two
        assert stats.verify_steps >= 4
        if rows == 1:
            assert dec.drafter is not None and not module_calls
            assert len(calls) == 2 * stats.verify_steps and all(r is not None for r in calls)
        else:
            assert dec.drafter is None and not calls and len(module_calls) == 2 * stats.verify_steps
        calls.clear()
        module_calls.clear()
