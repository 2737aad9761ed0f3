"""Each bad input gives one clear line on stderr and a non-zero exit, without a traceback."""

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from conftest import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path, max_position_embeddings=64)
    return path


def moerun(*args):
    return subprocess.run([sys.executable, "-m", "moerun.cli", *map(str, args)], capture_output=True, text=True, timeout=120)


def assert_one_line_error(r, *needles):
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def broken_copy(tiny, tmp_path, mutate):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    mutate(d)
    return d


def test_good_model_generates(tiny):
    r = moerun("generate", "-m", tiny, "def add", "--max-tokens", "5", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr


def test_missing_path(tmp_path):
    assert_one_line_error(moerun("info", "-m", tmp_path / "nope"), "does not exist")


def test_directory_without_config(tmp_path):
    assert_one_line_error(moerun("info", "-m", tmp_path), "config.json")


def test_truncated_safetensors(tiny, tmp_path):
    def cut(d):
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-1000])

    assert_one_line_error(moerun("info", "-m", broken_copy(tiny, tmp_path, cut)), "truncated", "model.safetensors")


def test_corrupt_safetensors_header(tiny, tmp_path):
    def corrupt(d):
        f = d / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[8 : 8 + 16] = b"\x00garbage-garbage"
        f.write_bytes(bytes(data))

    assert_one_line_error(moerun("info", "-m", broken_copy(tiny, tmp_path, corrupt)), "corrupt")


def test_missing_tensor_is_named(tiny, tmp_path):
    victim = "model.layers.1.mlp.experts.2.up_proj.weight"

    def drop(d):
        w = load_file(d / "model.safetensors")
        del w[victim]
        save_file(w, d / "model.safetensors")

    assert_one_line_error(moerun("info", "-m", broken_copy(tiny, tmp_path, drop)), victim)


def test_wrong_shape_is_named(tiny, tmp_path):
    victim = "model.layers.0.self_attn.q_proj.weight"

    def reshape(d):
        w = load_file(d / "model.safetensors")
        w[victim] = w[victim][:-1].contiguous()
        save_file(w, d / "model.safetensors")

    assert_one_line_error(moerun("info", "-m", broken_copy(tiny, tmp_path, reshape)), victim, "shape")


def test_unknown_architecture_lists_supported(tiny, tmp_path):
    def retype(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["model_type"] = "llama_moe_9000"
        (d / "config.json").write_text(json.dumps(cfg))

    assert_one_line_error(moerun("info", "-m", broken_copy(tiny, tmp_path, retype)), "llama_moe_9000", "qwen3_moe", "mixtral")


def test_prompt_longer_than_context(tiny):
    assert_one_line_error(moerun("generate", "-m", tiny, "word " * 200, "--threads", "1"), "context window")


def test_bad_flag_values(tiny):
    assert_one_line_error(moerun("generate", "-m", tiny, "x", "--top-p", "0"), "top_p")
    assert_one_line_error(moerun("generate", "-m", tiny, "x", "--threads", "0"), "threads")
    assert_one_line_error(moerun("bench", "-m", tiny, "--bogus"), "unrecognized")


def test_debug_shows_traceback(tmp_path):
    r = moerun("info", "-m", tmp_path / "nope", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_chat_keeps_history_and_exits(tiny):
    r = subprocess.run(
        [sys.executable, "-m", "moerun.cli", "chat", "-m", str(tiny), "--max-tokens", "4", "--threads", "1"],
        input="hello\nand again\n/exit\n", capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 3  # two turns answered, then the prompt that read /exit


def test_chat_without_template_is_refused(tiny, tmp_path):
    def untemplate(d):
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        del cfg["chat_template"]
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))

    r = subprocess.run([sys.executable, "-m", "moerun.cli", "chat", "-m", str(broken_copy(tiny, tmp_path, untemplate))],
                       input="", capture_output=True, text=True, timeout=120)
    assert_one_line_error(r, "chat template")


def test_bench_json_reports_the_expert_store(tiny):
    r = moerun("bench", "-m", tiny, "--json", "--threads", "1", "--prompt-tokens", "8", "--gen-tokens", "4",
               "--ram-budget", "50%")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("prefill_tok_s", "decode_tok_s", "threads", "model", "expert_hit_rate", "stall_s_per_token"):
        assert key in out
    assert 0.0 <= out["expert_hit_rate"] <= 1.0


def test_bench_with_a_very_short_prompt():
    # the warm-up used to slice the prompt; a 2-token prompt left DeltaNet an empty pass
    r = moerun("bench", "--json", "--threads", "1", "--prompt-tokens", "2", "--gen-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == 2


def test_speculative_without_mtp_head_is_refused(tiny):
    assert_one_line_error(moerun("generate", "-m", tiny, "x", "--speculative", "mtp", "--threads", "1"), "multi-token-prediction")
    # the server refuses before it listens (the port is never bound)
    assert_one_line_error(moerun("serve", "-m", tiny, "--speculative", "mtp", "--threads", "1", "--port", "1"),
                          "multi-token-prediction")


def test_bad_draft_vocabulary_is_refused():
    assert_one_line_error(moerun("generate", "x", "--speculative", "mtp", "--draft-vocab", "0", "--threads", "1"),
                          "draft_vocab must be 1..4096")
    assert_one_line_error(moerun("generate", "x", "--speculative", "mtp", "--draft-vocab", "many", "--threads", "1"),
                          "--draft-vocab must be an integer, not 'many'")


def test_speculative_server_with_bad_draft_tokens_is_refused():
    assert_one_line_error(moerun("serve", "--speculative", "mtp", "--draft-tokens", "9", "--threads", "1", "--port", "1"),
                          "draft_tokens must be 1..4")


def test_quant_and_store_together_are_refused(tiny):
    assert_one_line_error(moerun("generate", "-m", tiny, "x", "--quant", "int4", "--ram-budget", "50%"), "needs a quantized checkpoint")
