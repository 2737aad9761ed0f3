import numpy as np
import pytest
import torch

from moerun import kernels
from moerun.engine import sampling
from moerun.engine.generate import Sequence
from moerun.engine.sampling import (
    History,
    SamplingParams,
    Uniforms,
    apply_repetition_penalty,
    argmax,
    candidate_probs,
    distribution,
    draw,
    draw_ref,
    filter_logits,
    full_probs,
    greedy_token,
    greedy_tokens,
    greedy_tokens_ref,
    sample,
)
from moerun.errors import MoerunError


def kept(logits, **kw):
    out = filter_logits(torch.tensor([logits]), SamplingParams(temperature=1.0, **kw))
    return torch.isfinite(out[0]).nonzero().flatten().tolist()


def test_top_k_keeps_k_best():
    assert kept([1.0, 3.0, 2.0, 0.0], top_k=2) == [1, 2]


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().tolist()
    assert kept(logits, top_p=0.5) == [0]
    assert kept(logits, top_p=0.75) == [0, 1]
    assert kept(logits, top_p=0.9) == [0, 1, 2]


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert kept(logits, min_p=0.35) == [0, 1]


def test_repetition_penalty_sign_aware():
    out = apply_repetition_penalty(torch.tensor([[2.0, -2.0, 1.0]]), [[0, 1]], 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_repetition_penalty_rows_match_torch_arithmetic():
    # several rows, repeated tokens, an empty history; the input is left as it was
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4096, generator=g) * 5
    history = [[7, 7, 4095, 0, 12], [], torch.randint(0, 4096, (300,), generator=g).tolist()]
    before = logits.clone()
    out = apply_repetition_penalty(logits, history, 1.3)
    assert torch.equal(logits, before)
    ref = logits.clone()
    for b, seen in enumerate(history):
        for i in set(seen):
            v = ref[b, i]
            ref[b, i] = v / 1.3 if v > 0 else v * 1.3
    assert torch.equal(out, ref)


def test_greedy_picks_the_first_of_tied_maxima():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    assert sample(logits, SamplingParams(), [[], []], None).tolist() == [1, 0]


def test_greedy_token_is_the_argmax_of_the_penalized_row():
    """greedy_token: argmax(apply_repetition_penalty(row)) for penalties above and below 1,
    none, an empty history, a bf16 row and a token the penalty knocks off the top; the row
    itself is left alone."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g) * 3
    logits[5, 17] = 50.0  # the best by far, and seen: a penalty of 100 makes it lose
    histories = [[1, 2, 2, 299], [], torch.randint(0, 300, (80,), generator=g).tolist(), [0], [5, 9], [17]]
    before = logits.clone()
    for penalty in (1.0, 1.3, 0.7, 100.0):
        for row, seen in zip(logits, histories):
            want = int(argmax(apply_repetition_penalty(row[None], [seen], penalty))[0])
            assert greedy_token(row, seen, penalty) == want
            assert greedy_token(row.bfloat16(), seen, penalty) == int(argmax(apply_repetition_penalty(
                row.bfloat16().float()[None], [seen], penalty))[0])
    assert greedy_token(logits[5], [17], 100.0) != 17 and greedy_token(logits[5], [17], 1.0) == 17
    assert torch.equal(logits, before)
    # tied maxima, seen and unseen, before and after one another; a float32 numpy row too
    tied = torch.tensor([1.0, 3.0, 3.0, -3.0, 3.0, 0.0])
    for seen in ([1], [2], [1, 2], [4, 1, 1], [3, 5], [1, 2, 4], []):
        for penalty in (1.3, 0.7):
            want = int(argmax(apply_repetition_penalty(tied[None], [seen], penalty))[0])
            assert greedy_token(tied, seen, penalty) == want
            assert greedy_token(tied.numpy(), seen, penalty) == want


def _penalized_argmax(row: torch.Tensor, seen: list[int], penalty: float) -> int:
    return int(argmax(apply_repetition_penalty(row.float()[None], [seen], penalty))[0])


def test_greedy_with_a_history_and_drafts_after_it_is_the_penalized_argmax():
    """greedy_token with a `History` and `extra` ids (drafts), and greedy_tokens over a
    verification pass's rows (row j: history + extra[:j]), native and numpy reference, against
    argmax(penalized row) with the ids as one list: drafts seen before, drafted twice, new;
    ties; NaN; float32, bf16 and numpy rows; penalties above, below and at 1; no history."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(4, 40, generator=g).round()  # many ties
    rows[1, 9] = rows[2, 9] = 30.0  # the best by far where 9 is drafted: penalised in rows 2 and 3 only
    rows[3, 20] = float("nan")  # numpy's argmax takes a NaN
    ways = [greedy_tokens, lambda r, *a: greedy_tokens_ref(r.float().numpy(), *a)]
    for hist_ids in ([], [1, 1, 5, 39], torch.randint(0, 40, (25,), generator=g).tolist()):
        for extra in ([], [9], [9, 9, 3], [5, 9, 12], [0, 1, 2]):
            for penalty in (1.0, 1.3, 0.7, 100.0):
                hist = History(hist_ids)
                pass_rows = rows[: len(extra) + 1]
                for r in (pass_rows, pass_rows.bfloat16()):
                    want = [_penalized_argmax(r[j], hist_ids + extra[:j], penalty) for j in range(len(extra) + 1)]
                    for way in ways:
                        assert way(r, hist, penalty, extra) == want
                        assert way(r, hist_ids, penalty, extra) == want
                    assert greedy_tokens(r.float().numpy(), hist, penalty, extra) == want
                for j in range(len(rows)):
                    for r in (rows[j], rows[j].bfloat16()):
                        assert greedy_token(r, hist, penalty, extra) == _penalized_argmax(r, hist_ids + extra, penalty)


@pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")
def test_native_picks_and_draws_refuse_ids_outside_the_row_and_nan_rows():
    row = torch.tensor([[0.0, 5.0, 1.0]])
    assert kernels.greedy_picks(row, np.array([1]), [], 10.0, True) == [2]
    assert kernels.greedy_picks(row, np.array([1]), [], 2.0, True) == [1]
    with pytest.raises(IndexError, match="token id 3 outside"):
        kernels.greedy_picks(row, np.array([3]), [], 2.0, True)
    with pytest.raises(IndexError, match="token id -1 outside"):
        kernels.greedy_picks(row, np.array([0]), [-1], 2.0, False)
    args = (1.1, 0.7, 2, 1.0, 0.0)  # penalty, temperature, top_k, top_p, min_p
    assert kernels.sample_row(row[0], np.array([1]), [], *args, 0.999) in (1, 2)
    with pytest.raises(IndexError, match="token id 5 outside"):
        kernels.sample_row(row[0], np.array([5]), [], *args, 0.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        kernels.sample_row(row[0], np.array([1]), [], 1.1, 0.0, 2, 1.0, 0.0, 0.5)
    with pytest.raises(ValueError, match="logits contain NaN"):
        kernels.sample_row(torch.tensor([0.0, float("nan")]), np.array([], dtype=np.int64), [], *args, 0.5)


def test_sampling_without_the_extension_runs_the_reference(monkeypatch):
    x = torch.randn(50, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=0.9, top_k=10, top_p=0.9, repetition_penalty=1.2)
    native = [draw(x, p, [1, 2], torch.Generator().manual_seed(s)) for s in range(20)]
    monkeypatch.setattr(kernels, "sample_row", lambda *a, **k: None)
    monkeypatch.setattr(kernels, "greedy_picks", lambda *a, **k: None)
    assert [draw(x, p, [1, 2], torch.Generator().manual_seed(s)) for s in range(20)] == native
    assert greedy_token(x, [int(x.argmax())], 5.0) == _penalized_argmax(x, [int(x.argmax())], 5.0)


def test_uniforms_are_the_generators_stream_drawn_in_blocks():
    a = Uniforms(torch.Generator().manual_seed(4))
    got = [a.next() for _ in range(150)]  # past two blocks
    want = torch.rand(192, generator=torch.Generator().manual_seed(4), dtype=torch.float64)[:150].tolist()
    assert got == want and all(0.0 <= u < 1.0 for u in got)
    s1, s2 = (Sequence([1], SamplingParams(temperature=1.0, seed=11)) for _ in range(2))
    x = torch.randn(2, 30, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_k=8)
    assert [sample(x, p, [[], []], s1.uniforms).tolist() for _ in range(70)] == [
        sample(x, p, [[], []], s2.uniforms).tolist() for _ in range(70)]


def test_history_grows_with_the_sequence():
    s = Sequence([4, 5, 4], SamplingParams(max_tokens=300))
    h = s.history()
    assert h.ids.tolist() == [4, 5, 4] and h.set == {4, 5}
    for t in range(200):  # past its first capacity
        s.accept(t % 7 + 10, eos_ids=set())
    assert s.history() is h and h.ids.tolist() == [4, 5, 4] + [t % 7 + 10 for t in range(200)]
    assert h.set == {4, 5, *range(10, 17)}
    s.out_ids = s.out_ids[:3]  # shortened (not what decoding does): made again
    assert s.history().ids.tolist() == [4, 5, 4, 10, 11, 12]


def test_top_k_candidates_give_the_filtered_distribution():
    """candidate_probs over the top-k candidates, scattered back, equals
    filter_logits(...).softmax over the whole row (float rounding apart) for top-k with and
    without top-p and min-p, with rows whose logits tie with the k-th past k (all kept) next
    to rows without; without top-k it is the whole-row path, exactly."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 500, generator=g) * 4
    tied = logits.clone()
    tied[1, :] = 0.0
    tied[1, :3] = 5.0  # top-k 10: the k-th value 0.0 ties 497 logits
    tied[2] = tied[2].bfloat16().float()  # bf16's few values: ties here and there
    for params in (dict(top_k=10), dict(top_k=10, top_p=0.8), dict(top_k=50, top_p=0.95, min_p=0.05),
                   dict(top_k=1), dict(top_p=0.9), dict(top_k=0, min_p=0.1)):
        p = SamplingParams(temperature=0.7, **params)
        for x in (logits, tied):
            want = filter_logits(x, p).softmax(-1)
            probs, ids = candidate_probs(x, p)
            got = full_probs(probs, ids, x.shape[-1])
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
            assert torch.equal(got > 0, want > 0)  # the same tokens kept
            if ids is None:
                assert torch.equal(got, want) and not p.top_k
            else:
                assert ids.shape[1] >= p.top_k and bool((probs.sum(-1) - 1).abs().max() < 1e-5)
    assert candidate_probs(tied, SamplingParams(temperature=0.7, top_k=10))[1].shape[1] == 500  # row 1 keeps them all


def test_top_k_sampling_draws_only_kept_tokens_at_their_frequency():
    g = torch.Generator().manual_seed(6)
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0, 0.0]])
    p = SamplingParams(temperature=1.0, top_k=3)
    draws = torch.stack([sample(logits, p, [[]], g) for _ in range(6000)]).flatten()
    assert set(draws.tolist()) == {0, 1, 3}
    want = filter_logits(logits, p).softmax(-1)[0]
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert torch.allclose(freq, want, atol=0.02)


@pytest.mark.parametrize("params", [dict(top_k=40, top_p=0.95, repetition_penalty=1.1), dict(top_k=5),
                                    dict(top_p=0.7, repetition_penalty=0.8), dict(min_p=0.05, top_k=100),
                                    dict(temperature=1.3)])
def test_draw_and_distribution_match_the_torch_reference(params):
    """draw (native where built) takes the same token as draw_ref for the same u, and
    distribution gives filter_logits' law (float rounding apart), with a history, drafts after
    it, float32 and bf16 rows; the inverse CDF runs in candidate order."""
    p = SamplingParams(**{"temperature": 0.7, **params})
    g = torch.Generator().manual_seed(8)
    x = torch.randn(300, generator=g) * 3
    hist_ids = torch.randint(0, 300, (40,), generator=g).tolist()
    def law(row, ids):
        penalised = apply_repetition_penalty(row.float()[None], [ids], p.repetition_penalty)
        return filter_logits(penalised, p).softmax(-1)[0]

    for extra in ([], [7, 7, 290]):
        want_law = law(x, hist_ids + extra)
        for hist in (hist_ids, History(hist_ids)):
            assert torch.allclose(distribution(x, p, hist, extra), want_law, atol=1e-6, rtol=1e-5)
            assert torch.allclose(distribution(x.bfloat16(), p, hist, extra), law(x.bfloat16(), hist_ids + extra),
                                  atol=1e-6, rtol=1e-5)
            for u in torch.rand(200, generator=g).tolist():
                want = draw_ref(x, p, hist, extra, u)
                assert sampling._row(x, p, hist, extra, u, None) == want and want_law[want] > 0
            u0 = float(torch.rand((), generator=torch.Generator().manual_seed(9)))
            assert draw(x, p, hist, torch.Generator().manual_seed(9), extra) == draw_ref(x, p, hist, extra, u0)


def test_greedy_is_argmax_and_seed_reproduces():
    logits = torch.randn(3, 50)
    assert sample(logits, SamplingParams(), [[], [], []], None).tolist() == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, p, [[]] * 3, torch.Generator().manual_seed(7)).tolist() for _ in range(2)]
    assert a[0] == a[1]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs.log()[None], SamplingParams(temperature=1.0), [[]], g) for _ in range(3000)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=1), dict(top_k=-1), dict(max_tokens=-2)])
def test_invalid_params(bad):
    with pytest.raises(MoerunError):
        SamplingParams(**bad)


class FakeDecoder:
    def __init__(self, pieces):
        self.pieces = pieces

    def push(self, token):
        return self.pieces[token]


def run_seq(pieces, stop, max_tokens=100, eos=()):
    s = Sequence([0], SamplingParams(stop=stop, max_tokens=max_tokens), decoder=FakeDecoder(pieces))
    shown = ""
    for t in range(len(pieces)):
        shown += s.accept(t, set(eos))
        if s.finished:
            break
    return shown, s


def test_stop_string_split_across_tokens_is_cut_and_never_shown():
    shown, s = run_seq(["Hello", " wor", "ld", "STO", "P", "more"], stop=("STOP",))
    assert shown == "Hello world" and s.text == "Hello world" and s.finish_reason == "stop"


def test_text_resembling_a_stop_prefix_is_released():
    shown, s = run_seq(["a", "ST", "x", "b"], stop=("STOP",), max_tokens=4)
    assert shown == "aSTxb" and s.finish_reason == "length"


def test_eos_and_max_tokens():
    shown, s = run_seq(["a", "b", "c"], stop=(), eos=(1,))
    assert shown == "a" and s.finish_reason == "stop" and s.out_ids == [0]
    shown, s = run_seq(["a", "b", "c"], stop=(), max_tokens=2)
    assert shown == "ab" and s.finish_reason == "length"


def test_residual_draw_matches_its_reference_and_its_law(monkeypatch):
    """A rejected draft's replacement from norm(max(0, p - q)): the native draw equals the
    numpy reference for every uniform (q below p at some ids, q covering p at all of them:
    then p itself), never picks an id without weight, and follows the residual's law."""
    from moerun.engine.sampling import residual_draw

    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(40, generator=g), 0)
    q = torch.softmax(torch.randn(40, generator=g), 0)
    covers = p * 2  # q >= p everywhere: the residual is empty and p itself is drawn
    us = torch.rand(300, generator=g, dtype=torch.float64).tolist() + [0.0, 1.0 - 1e-12]
    got = {name: [residual_draw(p, qq, u) for u in us] for name, qq in (("q", q), ("covers", covers))}
    monkeypatch.setattr(kernels, "residual_draw", lambda *a: None)
    want = {name: [residual_draw(p, qq, u) for u in us] for name, qq in (("q", q), ("covers", covers))}
    monkeypatch.undo()
    assert got == want
    w = (p - q).clamp_min(0)
    assert all(w[t] > 0 for t in got["q"]) and all(p[t] > 0 for t in got["covers"])
    u = torch.rand(20000, generator=g, dtype=torch.float64).tolist()
    counts = np.bincount([residual_draw(p, q, x) for x in u], minlength=40) / len(u)
    assert np.abs(counts - (w / w.sum()).numpy()).max() < 0.015
