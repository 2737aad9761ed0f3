"""The command line a newcomer meets: usage without arguments, a prompt from stdin, help on
every option, the cut of --max-tokens said once, chat's /help and /reset, how the decode
passes ran (bench --json `decode_path`, generate --verbose), the summary line."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

import moerun
from moerun.cli import build_parser, main


def test_no_arguments_prints_the_usage(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moerun") and "generate" in out


def test_a_wrong_command_points_at_moerun_help(capsys):
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    err = capsys.readouterr().err.strip()
    assert err.endswith("(see moerun --help)") and "moerun moerun" not in err and len(err.splitlines()) == 1


def test_every_option_has_help():
    missing = []

    def walk(p, name):
        for act in p._actions:
            if act.option_strings and act.help is None:
                missing.append((name, act.option_strings))
            if isinstance(getattr(act, "choices", None), dict):
                for sub, sp in act.choices.items():
                    walk(sp, sub)
    walk(build_parser(), "moerun")
    assert not missing


def test_generate_reads_the_prompt_from_stdin(monkeypatch, capsys):
    prompt = "def add(a, b):"
    monkeypatch.setattr("sys.stdin", io.StringIO(prompt))
    assert main(["generate", "-", "--max-tokens", "5", "--temperature", "0", "--threads", "1", "--verbose"]) == 0
    out, err = capsys.readouterr()
    llm = moerun.load(threads=1)
    assert out.rstrip("\n") == "".join(llm.generate(prompt, max_tokens=5, temperature=0.0))
    # the summary says what it timed; --verbose how the decode passes ran
    assert re.search(r"generated 5 tok; decode timed over 4 tok after the first", err)
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
    for argv in (["simulate", str(tmp_path / "none.npz")], ["predict-eval", str(tmp_path / "none.npz")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("moerun: error:") and "none.npz" in err and len(err.strip().splitlines()) == 1


def test_the_cli_says_a_cut_only_of_a_max_tokens_given(capsys):
    ctx = moerun.load(threads=1).context_length
    assert main(["generate", "hi", "--max-tokens", str(ctx + 5), "--temperature", "0", "--threads", "1"]) == 0
    assert capsys.readouterr().err.count(f"max_tokens {ctx + 5} cut to") == 1
    assert main(["generate", "hi", "--temperature", "0", "--threads", "1", "--max-tokens", "3"]) == 0
    assert "cut to" not in capsys.readouterr().err
