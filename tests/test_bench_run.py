"""`moerun bench`'s timing protocol: llama-bench's (a warm-up pass of the timed prompt's size,
then `--reps` timed runs on fresh ids, their mean and each run's figure). No timed assertions:
the passes the net sees, and the JSON fields and how they relate."""

from __future__ import annotations

import json

import pytest
import torch

import moerun
from moerun.bench.run import bench
from moerun.cli import main
from moerun.errors import MoerunError

from conftest import assert_one_line_error, cli


@pytest.fixture(scope="module")
def demo():
    return moerun.load(threads=1)


def passes(llm, **kw):
    """The token count of every forward pass `bench` makes, in order, and its result."""
    seen = []
    h = llm.net.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    try:
        out = bench(llm, **kw)
    finally:
        h.remove()
    return seen, out


@pytest.mark.parametrize("prompt,gen,reps", [(12, 3, 1), (7, 2, 3)])
def test_the_warm_up_is_a_pass_of_the_prompts_size(demo, prompt, gen, reps):
    seen, out = passes(demo, prompt_tokens=prompt, gen_tokens=gen, reps=reps)
    # warm-up: the prompt's size, 3 steps; then each rep: the prompt, gen steps
    assert seen == [prompt, 1, 1, 1] + ([prompt] + [1] * gen) * reps
    assert out["warmup"] == {"name": "full", "prefill_tokens": prompt, "decode_steps": 3}


def test_the_short_warm_up_is_the_old_4_token_pass(demo):
    seen, out = passes(demo, prompt_tokens=10, gen_tokens=2, warmup="short")
    assert seen == [4, 1, 1, 1, 10, 1, 1]
    assert out["warmup"]["prefill_tokens"] == 4


def test_each_rep_prefills_fresh_ids(demo):
    ids = []
    h = demo.net.register_forward_pre_hook(lambda mod, args: ids.append(args[0].clone()) if args[0].shape[1] > 1 else None)
    try:
        bench(demo, prompt_tokens=9, gen_tokens=1, reps=2)
    finally:
        h.remove()
    assert len(ids) == 3 and all(x.shape == (1, 9) for x in ids)  # the warm-up and two timed prompts
    assert not torch.equal(ids[0], ids[1]) and not torch.equal(ids[1], ids[2])
    vocab = demo.net.args.vocab_size
    assert all(int(x.min()) >= 0 and int(x.max()) < vocab for x in ids)


def test_json_fields_old_and_new(capsys):
    assert main(["bench", "--prompt-tokens", "8", "--gen-tokens", "5", "--threads", "1", "--reps", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # the fields earlier callers read, unchanged in meaning (now the mean over the reps)
    for key in ("model", "prompt_tokens", "gen_tokens", "prefill_tok_s", "decode_tok_s", "prefill_s", "decode_s",
                "decode_path", "threads"):
        assert key in d, key
    assert (d["prompt_tokens"], d["gen_tokens"], d["reps"]) == (8, 5, 3)
    pp, tg = d["prefill_tok_s_reps"], d["decode_tok_s_reps"]
    assert len(pp) == len(tg) == 3 and min(pp) > 0 and min(tg) > 0
    assert d["prefill_tok_s"] == pytest.approx(sum(pp) / 3) and d["decode_tok_s"] == pytest.approx(sum(tg) / 3)
    assert min(pp) <= d["prefill_tok_s"] <= max(pp)
    # prefill_s is the mean time of a pass: 8 tokens over it is the harmonic mean, never above the mean rate
    assert 8 / d["prefill_s"] <= d["prefill_tok_s"] * (1 + 1e-9)
    assert d["warmup"] == {"name": "full", "prefill_tokens": 8, "decode_steps": 3}
    assert d["decode_path"]["native_stack_passes"] == 15  # the timed steps of all 3 reps, not the warm-up's


def test_text_summary_gives_the_range_and_the_warm_up(capsys):
    assert main(["bench", "--prompt-tokens", "6", "--gen-tokens", "2", "--threads", "1", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "mean of 2 runs" in out and "after a 6-token warm-up pass" in out
    assert out.count("-") >= 2  # prefill and decode ranges (low-high)


@pytest.mark.parametrize("args,msg", [
    (["--reps", "0"], "--reps must be at least 1"),
    (["--warmup", "long"], "invalid choice"),
])
def test_bad_reps_and_warmup_are_one_line(capsys, args, msg):
    assert_one_line_error(cli(capsys, "bench", "--prompt-tokens", "4", "--gen-tokens", "1", *args), msg)


def test_python_api_refuses_bad_reps_and_warmup(demo):
    with pytest.raises(MoerunError, match="--reps"):
        bench(demo, prompt_tokens=4, gen_tokens=1, reps=0)
    with pytest.raises(MoerunError, match="--warmup"):
        bench(demo, prompt_tokens=4, gen_tokens=1, warmup="none")
