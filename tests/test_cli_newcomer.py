"""The command line a newcomer meets (issue 34, item 7): usage without arguments, a prompt
from stdin, help on every option and argument, the cut of --max-tokens said once, a summary
line that says what it timed and leaves the warm-up out, one way to pass a trace, a missing
tokenizer or an impossible flag said before any weight is read, chat's /help and /reset, how
the decode passes ran (bench --json `decode_path`, generate --verbose)."""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch

import moerun
from moerun.cli import build_parser, main

from conftest import assert_one_line_error, cli, make_tiny_model


def test_no_arguments_prints_the_usage(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moerun") and "generate" in out
    # the installed command takes its arguments from sys.argv
    r = subprocess.run([sys.executable, "-m", "moerun.cli"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: moerun") and "COMMAND --help" in r.stdout, r.stderr
    assert "error" not in r.stderr


def test_a_wrong_command_points_at_moerun_help(capsys):
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    err = capsys.readouterr().err.strip()
    assert err.endswith("(see moerun --help)") and "moerun moerun" not in err and len(err.splitlines()) == 1


def test_every_option_and_argument_has_help():
    """Every action of every parser but -h: options, positionals, the command list and each
    command in it. Hidden ones (help=SUPPRESS) are only the aliases kept on purpose."""
    missing, hidden, walked = [], [], []

    def walk(p, name):
        walked.append(name)
        for act in p._actions:
            if isinstance(act, argparse._HelpAction):
                continue
            label = (name, act.option_strings[0] if act.option_strings else act.dest)
            if act.help == argparse.SUPPRESS:
                hidden.append(label)
            elif not (act.help or "").strip():
                missing.append(label)
            if isinstance(act, argparse._SubParsersAction):
                for choice in act._choices_actions:  # the command list's line for each command
                    if not (choice.help or "").strip():
                        missing.append((name, choice.dest))
                for sub, sp in act.choices.items():
                    walk(sp, sub)
    walk(build_parser(), "moerun")
    assert len(walked) > 10 and "simulate" in walked
    assert not missing
    assert hidden == [("simulate", "--trace")]


def test_generate_reads_the_prompt_from_stdin(monkeypatch, capsys):
    prompt = "def add(a, b):"
    monkeypatch.setattr("sys.stdin", io.StringIO(prompt))
    assert main(["generate", "-", "--max-tokens", "5", "--temperature", "0", "--threads", "1", "--verbose"]) == 0
    out, err = capsys.readouterr()
    llm = moerun.load(threads=1)
    assert out.rstrip("\n") == "".join(llm.generate(prompt, max_tokens=5, temperature=0.0))
    # the summary says what it timed; --verbose how the decode passes ran
    assert re.search(r"generated 5 tok: the first from the prompt's pass, 1 in the warm-up pass, 3 timed at "
                     r"\d+\.\d tok/s", err)
    assert re.search(r"\[decode path: \d+ passes as one native call over the layer stack", err)


def test_an_empty_stdin_prompt_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["generate", "-"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "moerun: error: the prompt is empty (nothing on standard input)"


def test_a_max_tokens_cut_is_said_once(caplog):
    llm = moerun.load(threads=1)
    too_many = llm.context_length + 10
    with caplog.at_level(logging.WARNING, logger="moerun"):
        for _ in range(2):
            assert len(llm.generate_ids([[1, 2, 3]], max_tokens=too_many, temperature=0.0)[0]) <= llm.context_length - 3
    said = [r.getMessage() for r in caplog.records if "cut to" in r.getMessage()]
    assert len(said) == 1 and f"max_tokens {too_many} cut to {llm.context_length - 3}" in said[0]


def test_chat_answers_help_and_confirms_reset(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("/help\n/reset\n/nonsense\n/exit\n"))
    assert main(["chat", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert err.count("/reset clears the history") >= 3  # the banner, /help and the unknown command
    assert "[history cleared]" in err and "unknown command /nonsense" in err


def test_bench_json_says_how_decode_ran(capsys):
    assert main(["bench", "--prompt-tokens", "8", "--gen-tokens", "6", "--threads", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["decode_path"] == {"native_stack_passes": 6, "module_passes": 0, "why": None}
    assert d["threads"] == 1
    assert main(["bench", "--prompt-tokens", "8", "--gen-tokens", "6", "--threads", "1", "--json",
                 "--kv-cache", "int8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["decode_path"]["native_stack_passes"] == 0 and d["decode_path"]["module_passes"] == 6
    assert "int8 KV cache" in d["decode_path"]["why"]


def test_simulate_takes_its_trace_as_predict_eval_does(capsys, tmp_path):
    parser = build_parser()
    for cmd in ("simulate", "predict-eval"):
        assert parser.parse_args([cmd, "t.npz"]).trace == "t.npz"  # a positional TRACE, the same in both
        usage = _sub(parser, cmd).format_usage()
        assert "trace" in usage and "--trace" not in usage
    for argv in (["simulate", str(tmp_path / "none.npz")], ["predict-eval", str(tmp_path / "none.npz")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("moerun: error:") and "none.npz" in err and len(err.strip().splitlines()) == 1
    # the older spelling still runs, hidden; both at once is one clear error
    assert main(["simulate", "--trace", str(tmp_path / "old.npz")]) == 1
    assert "old.npz" in capsys.readouterr().err
    assert main(["simulate", "a.npz", "--trace", "b.npz"]) == 1
    assert capsys.readouterr().err.strip() == "moerun: error: give the trace once: moerun simulate TRACE.npz"


def _sub(parser, name):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def test_the_cli_says_a_cut_only_of_a_max_tokens_given(capsys):
    ctx = moerun.load(threads=1).context_length
    assert main(["generate", "hi", "--max-tokens", str(ctx + 5), "--temperature", "0", "--threads", "1"]) == 0
    assert capsys.readouterr().err.count(f"max_tokens {ctx + 5} cut to") == 1
    assert main(["generate", "hi", "--temperature", "0", "--threads", "1", "--max-tokens", "3"]) == 0
    assert "cut to" not in capsys.readouterr().err


# -- the summary line: what it timed, without the warm-up ---------------------------------------


def _fake_clock(monkeypatch, llm, rows=1):
    """The generate loop's clock advanced only by the model's passes: each prompt's pass 1 s,
    the first decode pass (the warm-up) 0.5 s, each later one 0.01 s."""
    now, passes = [0.0], [0]
    monkeypatch.setattr("moerun.engine.generate.time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    forward = llm.net.forward

    def timed(*args, **kw):
        passes[0] += 1
        now[0] += 1.0 if passes[0] <= rows else 0.5 if passes[0] == rows + 1 else 0.01
        return forward(*args, **kw)
    monkeypatch.setattr(llm.net, "forward", timed)
    return passes


def test_decode_rate_leaves_out_the_first_token_and_the_warm_up(monkeypatch):
    llm = moerun.load(threads=1)
    passes = _fake_clock(monkeypatch, llm)
    ids = llm.encode_prompt("def add(a, b):")
    assert len(llm.generate_ids([ids], max_tokens=5, temperature=0.0, stop=())[0]) == 5
    s = llm.last_stats
    assert passes[0] == 5 and s.decode_steps == 4  # the prompt's pass, the warm-up, three timed passes
    assert (s.decode_rows_started, s.warmup_tokens, s.timed_tokens) == (1, 1, 3)
    assert s.decode_s == pytest.approx(0.53) and s.warmup_s == pytest.approx(0.5)
    assert s.decode_tok_s == pytest.approx(100.0)  # 3 tokens over 0.03 s (counting all: 4 / 0.53 s = 7.5)
    # two rows: the warm-up pass gives one token to each
    passes = _fake_clock(monkeypatch, llm, rows=2)
    out = llm.generate_ids([ids, ids[:3]], max_tokens=4, temperature=0.0, stop=())
    s = llm.last_stats
    assert [len(o) for o in out] == [4, 4] and (s.decode_rows_started, s.warmup_tokens, s.timed_tokens) == (2, 2, 4)
    assert s.decode_tok_s == pytest.approx(4 / 0.02)
    # too short to time: no rate rather than one made of the warm-up
    llm.generate_ids([ids], max_tokens=2, temperature=0.0, stop=())
    assert llm.last_stats.timed_tokens == 0 and llm.last_stats.decode_tok_s == 0.0


def test_the_summary_line_says_what_it_timed(monkeypatch, capsys):
    load = moerun.load

    def load_with_clock(*args, **kw):
        llm = load(*args, **kw)
        _fake_clock(monkeypatch, llm)
        return llm
    monkeypatch.setattr(moerun, "load", load_with_clock)
    assert main(["generate", "def add(a, b):", "--max-tokens", "5", "--temperature", "0", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "| generated 5 tok: the first from the prompt's pass, 1 in the warm-up pass, 3 timed at 100.0 tok/s |" in err
    assert main(["generate", "def add(a, b):", "--max-tokens", "2", "--temperature", "0", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "generated 2 tok: the first from the prompt's pass, 1 in the warm-up pass, too few to time the decode" in err
    assert "tok/s |" not in err.split("generated")[1]


# -- chat --------------------------------------------------------------------------------------


def test_chat_reset_clears_the_history_it_confirms(monkeypatch, capsys):
    sent = []

    def generate(self, messages, **kw):
        sent.append([dict(m) for m in messages])
        yield "ok"
    monkeypatch.setattr("moerun.engine.llm.LLM.generate", generate)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\nagain\n/exit\n"))
    assert main(["chat", "--system", "Be terse.", "--threads", "1"]) == 0
    system = {"role": "system", "content": "Be terse."}
    assert sent == [[system, {"role": "user", "content": "hello"}], [system, {"role": "user", "content": "again"}]]
    assert "[history cleared, the system prompt kept]" in capsys.readouterr().err


# -- what is refused before any weight is read -------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path, max_position_embeddings=64)
    return path


@pytest.fixture()
def no_weights(monkeypatch):
    """Reading a weight fails the test: an error said instead came before the weights."""
    def read(*args, **kw):
        raise AssertionError("weights were read")
    monkeypatch.setattr("moerun.loaders.hf.load_state", read)
    monkeypatch.setattr("moerun.loaders.gguf._load", read)


def test_the_weight_guard_works(tiny, no_weights, capsys):
    assert_one_line_error(cli(capsys, "generate", "-m", tiny, "hi"), "weights were read")


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve", "--port", "1"]])
def test_a_missing_tokenizer_is_said_before_the_weights(tiny, tmp_path, no_weights, capsys, command):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    (d / "tokenizer.json").unlink()
    assert_one_line_error(cli(capsys, command[0], "-m", d, *command[1:]), f"{d} has no tokenizer.json")
    assert_one_line_error(cli(capsys, "info", "-m", d), "weights were read")  # info needs none


def test_chat_without_a_template_is_said_before_the_weights(tiny, tmp_path, no_weights, capsys):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert_one_line_error(cli(capsys, "chat", "-m", d), "has no chat template; use `moerun generate`")


CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("argv,needle", [
    (["generate", "hi", "--speculative", "mtp"], "needs a checkpoint with a multi-token-prediction head"),
    (["bench", "--speculative", "mtp"], "needs a checkpoint with a multi-token-prediction head"),
    (["generate", "hi", "--ram-budget", "lots"], "cannot read --ram-budget 'lots'"),
    (["generate", "hi", "--draft-tokens", "2"], "--draft-tokens sets speculative decoding: give --speculative mtp too"),
    (["generate", "hi", "--draft-vocab", "64"], "--draft-vocab sets speculative decoding"),
    (["generate", "hi", "--emulate-link", "pcie4"], "--emulate-link needs a device tier: give --vram-budget too"),
    (["generate", "hi", "--execute", "cpu", "--ram-budget", "50%"], "--execute cpu places device misses"),
    (["generate", "hi", "--execute", "auto", "--vram-budget", "0", "--emulate-link", "pcie4"], "needs a device tier"),
    pytest.param(["generate", "hi", "--vram-budget", "25%"], "--vram-budget needs a CUDA GPU",
                 marks=pytest.mark.skipif(CUDA, reason="a CUDA GPU is there")),
    (["generate", "hi", "--predictor-trace", __file__], "--predictor-trace fits a predictor: give --predictor too"),
    (["bench", "--gen-tokens", "0"], "--prompt-tokens and --gen-tokens must be at least 1"),
    (["bench", "--populate", "--ram-budget", "50%"], "--populate pages in the weights' file maps"),
], ids=["mtp", "mtp-bench", "ram-budget", "draft-tokens", "draft-vocab", "link", "execute", "execute-vram-0",
        "vram-no-gpu", "predictor-trace", "bench-tokens", "populate-store"])
def test_an_impossible_flag_is_said_before_the_weights(tiny, no_weights, capsys, argv, needle):
    assert_one_line_error(cli(capsys, argv[0], "-m", tiny, *argv[1:]), needle)


def test_speculative_on_a_model_with_an_mtp_head_still_runs(capsys):
    assert main(["generate", "def", "--speculative", "mtp", "--draft-tokens", "2", "--max-tokens", "4",
                 "--temperature", "0", "--threads", "1"]) == 0
    assert "[speculative: acceptance" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory):
    from moerun.loaders.gguf_write import export

    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    export(tiny, out, "f32")
    return out


def test_a_gguf_file_is_checked_before_its_weights(tiny_gguf, tmp_path, no_weights, capsys):
    assert_one_line_error(cli(capsys, "generate", "-m", tiny_gguf, "hi"), "weights were read")  # the guard holds
    assert_one_line_error(cli(capsys, "generate", "-m", tiny_gguf, "hi", "--speculative", "mtp"),
                          "needs a checkpoint with a multi-token-prediction head")
    data = bytearray(tiny_gguf.read_bytes())  # a tokenizer kind moerun cannot build
    key = b"tokenizer.ggml.model"
    at = data.index(len(key).to_bytes(8, "little") + key) + 8 + len(key) + 4 + 8
    assert data[at : at + 4] == b"gpt2"
    data[at : at + 4] = b"bert"
    bad = tmp_path / "bert.gguf"
    bad.write_bytes(bytes(data))
    assert_one_line_error(cli(capsys, "chat", "-m", bad), "tokenizer model 'bert' is not supported")
    assert_one_line_error(cli(capsys, "info", "-m", bad), "weights were read")  # info needs no tokenizer


def test_random_model_help_names_every_preset():
    """(The parser is built without importing torch, so the presets are written out in its help.)"""
    from moerun.bench.random_model import PRESETS
    from moerun.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and "random-model" in a.choices)
    preset = next(a for a in sub.choices["random-model"]._actions if a.dest == "preset")
    assert all(name in preset.help for name in PRESETS), preset.help
