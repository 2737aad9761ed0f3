import pytest
import torch

from moerun.engine.generate import Sequence
from moerun.engine.sampling import SamplingParams, apply_repetition_penalty, argmax, filter_logits, greedy_token, sample
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
