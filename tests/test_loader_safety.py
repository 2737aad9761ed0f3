"""A model directory cannot hang, escape or quietly break the load: each bad file or flag is
one MoerunError through the API and one line on stderr (and a non-zero exit) through the CLI,
and flags are checked before any weight is read."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import moerun
from moerun.errors import MoerunError
from moerun.experts.store import StoreOptions

from conftest import assert_one_line_error, cli, make_tiny_model

WEIGHTS = "model.safetensors"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path, max_position_embeddings=64)
    return path


def copy(tiny, tmp_path, name="m"):
    d = tmp_path / name
    shutil.copytree(tiny, d)
    return d


def assert_refused(capsys, model, *needles, **load_options):
    """moerun.load raises MoerunError saying `needles`, and `moerun info` says it in one line."""
    with pytest.raises(MoerunError) as e:
        moerun.load(model, threads=1, **load_options)
    for n in needles:
        assert n in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    flags = ["--check-weights"] if load_options.get("check_weights") else []
    assert_one_line_error(cli(capsys, "info", "-m", model, *flags), *needles)


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def rewrite_header(path, edit):
    """Rewrite a safetensors file's JSON header through edit(header dict) -> header text;
    the tensor bytes stay where they were."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = edit(json.loads(raw[8 : 8 + n])).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


# -- files ------------------------------------------------------------------------------------


def test_fifo_weights_are_refused_without_hanging(tiny, tmp_path):
    d = copy(tiny, tmp_path)
    (d / WEIGHTS).unlink()
    os.mkfifo(d / WEIGHTS)  # nobody writes to it: opening it for reading would block for good
    r = subprocess.run([sys.executable, "-m", "moerun.cli", "info", "-m", str(d), "--threads", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "is not a regular file" in lines[0] and "Traceback" not in r.stderr, r.stderr
    with pytest.raises(MoerunError, match="is not a regular file"):
        moerun.load(d, threads=1)


def test_fifo_config_is_refused(tiny, tmp_path, capsys):
    d = copy(tiny, tmp_path)
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    assert_refused(capsys, d, "config.json is not a regular file")


def test_index_cannot_name_files_outside_the_model_directory(tiny, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(tiny / WEIGHTS, outside / WEIGHTS)  # a real file there: refused by name, never opened
    d = copy(tiny, tmp_path)
    (d / WEIGHTS).unlink()
    names = load_file(tiny / WEIGHTS)
    for target in ("../outside/model.safetensors", str(outside / WEIGHTS)):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: target for k in names}}))
        assert_refused(capsys, d, "outside the model directory")


def test_index_shards_inside_the_directory_still_load(tiny, tmp_path):
    d = copy(tiny, tmp_path)
    (d / "shards").mkdir()
    (d / WEIGHTS).rename(d / "shards" / WEIGHTS)
    names = load_file(d / "shards" / WEIGHTS)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: f"shards/{WEIGHTS}" for k in names}}))
    ref = moerun.load(tiny, threads=1)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(moerun.load(d, threads=1).forward(ids), ref.forward(ids))


def test_overlapping_tensor_bytes_are_refused(tiny, tmp_path, capsys):
    d = copy(tiny, tmp_path)
    other = "model.layers.0.self_attn.o_proj.weight"  # the same shape and dtype as q_proj

    def overlap(h):
        start = h[Q_PROJ]["data_offsets"][0]
        h[other]["data_offsets"] = [start + 4, start + 4 + 32 * 32 * 4]  # one float into q_proj's bytes
        return json.dumps(h)

    rewrite_header(d / WEIGHTS, overlap)
    assert_refused(capsys, d, "overlap", Q_PROJ, other)


def test_duplicate_tensor_names_are_refused(tiny, tmp_path, capsys):
    d = copy(tiny, tmp_path)

    def duplicate(h):  # the same name twice: json.loads alone would keep the last silently
        text = json.dumps(h)
        entry = json.dumps({Q_PROJ: h[Q_PROJ]})[1:-1]
        return text[:-1] + ", " + entry + "}"

    rewrite_header(d / WEIGHTS, duplicate)
    assert_refused(capsys, d, "twice", Q_PROJ)


def test_integer_dtype_where_a_float_weight_belongs_is_refused(tiny, tmp_path, capsys):
    d = copy(tiny, tmp_path)
    w = load_file(d / WEIGHTS)
    w[Q_PROJ] = torch.ones(32, 32, dtype=torch.int32)
    save_file(w, d / WEIGHTS)
    assert_refused(capsys, d, Q_PROJ, "I32", "floating-point")
    # the expert store reads experts from the file itself: the same check there
    victim = "model.layers.1.mlp.experts.2.up_proj.weight"
    w = load_file(tiny / WEIGHTS)
    w[victim] = torch.ones(16, 32, dtype=torch.int8)
    save_file(w, d / WEIGHTS)
    with pytest.raises(MoerunError, match="floating-point") as e:
        from moerun.experts.attach import load as load_with_store

        load_with_store(d, threads=1, options=StoreOptions(ram_budget="50%"))
    assert victim in str(e.value)


def test_quantized_checkpoint_with_integer_tensors_still_loads(tiny, tmp_path):
    from moerun.loaders.quantized_write import quantize_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(tiny, out, "int4")
    llm = moerun.load(out, threads=1, check_weights=True)  # uint8/int8 blocks: not float, not scanned
    assert len(llm.generate_ids([[1, 2, 3]], max_tokens=3)[0]) == 3


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_check_weights_refuses_nan_and_inf(tiny, tmp_path, capsys, bad):
    d = copy(tiny, tmp_path)
    victim = "model.layers.1.mlp.experts.3.down_proj.weight"
    w = load_file(d / WEIGHTS)
    w[victim][5, 7] = bad
    save_file(w, d / WEIGHTS)
    assert_refused(capsys, d, victim, "NaN or infinite", check_weights=True)
    moerun.load(d, threads=1)  # without the flag nothing scans the weights: it loads


def test_check_weights_passes_a_good_model(tiny, capsys):
    rc, lines = cli(capsys, "info", "-m", tiny, "--check-weights")
    assert rc == 0, lines
    assert moerun.load(tiny, threads=1, check_weights=True).forward(torch.tensor([[1, 2]])).isfinite().all()


def test_tokenizer_past_the_vocabulary_is_refused(tiny, tmp_path, capsys):
    d = copy(tiny, tmp_path)
    edit_json(d / "config.json", vocab_size=200)  # the tokenizer has 300 ids
    assert_refused(capsys, d, "token ids up to 299", "vocab_size", "200")


# -- the KV cache -----------------------------------------------------------------------------


def test_huge_context_allocates_by_what_a_run_asks(tiny, tmp_path, capsys, monkeypatch):
    from moerun.engine import generate

    made = []

    class Recorded(generate.Cache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(generate, "Cache", Recorded)
    d = copy(tiny, tmp_path)
    edit_json(d / "config.json", max_position_embeddings=1e12)
    llm = moerun.load(d, threads=1)
    assert llm.context_length == 10**12
    assert len(llm.generate_ids([[1, 2, 3]], max_tokens=4)[0]) == 4
    assert [c.max_len for c in made] == [7]  # the run's 7 tokens: not the context window
    with pytest.raises(MoerunError, match="KV cache .* needs .* memory available"):
        llm.generate_ids([[1, 2, 3]], max_tokens=10**11)
    assert_one_line_error(cli(capsys, "generate", "-m", d, "hi", "--max-tokens", 10**11), "KV cache", "available")


# -- config files -----------------------------------------------------------------------------

BAD_CONFIGS = [
    ({"hidden_size": "32"}, "hidden_size must be an integer"),
    ({"hidden_size": 10**30}, "hidden_size is"),
    ({"num_hidden_layers": -1}, "num_hidden_layers is -1"),
    ({"vocab_size": 3.5}, "vocab_size must be an integer"),
    ({"max_position_embeddings": math.inf}, "max_position_embeddings must be an integer"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite number"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ({"mlp_only_layers": 3}, "mlp_only_layers must be a list"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be in 1..num_experts"),
    ({"model_type": ["qwen3_moe"]}, "model_type must be a string"),
    ({"rope_parameters": "fast"}, "rope_parameters must be an object"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8}}, "rope_type is 'llama3'"),
    ({"rope_parameters": {"rope_type": "linear"}}, "linear needs a factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": "4"}}, "factor must be a number"),
    ({"rope_parameters": {"rope_theta": -1.0}}, "rope_theta must be positive"),
    ({"rope_parameters": None, "rope_scaling": [1, 2]}, "rope_scaling must be an object"),
]


@pytest.mark.parametrize("change,needle", BAD_CONFIGS, ids=[n for _, n in BAD_CONFIGS])
def test_malformed_config_fields(tiny, tmp_path, capsys, change, needle):
    d = copy(tiny, tmp_path)
    edit_json(d / "config.json", **change)
    assert_refused(capsys, d, needle)


@pytest.mark.parametrize("text,needle", [
    ('{"model_type": "qwen3_moe", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"model_type": "qwen3_moe", "vocab_size": ' + "9" * 5000 + "}", "thousands of digits"),
    ('{"model_type": "qwen3_moe",', "not valid JSON"),
    ("[]", "has no model_type"),
    (b"\xff\xfe{}", "not UTF-8"),
], ids=["deep", "huge-int", "truncated", "not-an-object", "not-utf8"])
def test_malformed_config_json(tiny, tmp_path, capsys, text, needle):
    d = copy(tiny, tmp_path)
    (d / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_refused(capsys, d, needle)


@pytest.mark.parametrize("text,needle", [
    ("{", "generation_config.json is not valid JSON"),
    ("[1]", "must hold a JSON object"),
    ('{"eos_token_id": ["x"]}', "eos_token_id must be an integer"),
    ('{"do_sample": true, "temperature": "hot"}', "temperature must be a number"),
    ('{"do_sample": "yes"}', "do_sample must be true or false"),
], ids=["truncated", "list", "eos", "temperature", "do_sample"])
def test_malformed_generation_config(tiny, tmp_path, capsys, text, needle):
    d = copy(tiny, tmp_path)
    (d / "generation_config.json").write_text(text)
    assert_refused(capsys, d, needle)


# -- flags are checked before the weights load ------------------------------------------------


@pytest.fixture()
def unloadable(tiny, tmp_path):
    """A model whose weights fail to load: a flag error reported instead proves it came first."""
    d = copy(tiny, tmp_path, "unloadable")
    (d / WEIGHTS).write_bytes(b"\x00" * 4)
    with pytest.raises(MoerunError, match="truncated"):
        moerun.load(d, threads=1)
    return d


@pytest.mark.parametrize("flags,needle", [
    (["--ram-budget", "abc"], "cannot read --ram-budget 'abc'"),
    (["--ram-budget=-5%"], "cannot read --ram-budget '-5%'"),
    (["--ram-budget", "200%"], "--ram-budget '200%' is over 100%"),
    (["--ram-budget", "1e400GiB"], "--ram-budget '1e400GiB' is too large"),
    (["--vram-budget", "lots", "--emulate-link", "pcie4"], "cannot read --vram-budget"),
    (["--ram-budget", "1GiB", "--emulate-link", "warp"], "cannot read link 'warp'"),
    (["--pin-hot-fraction", "2"], "--pin-hot-fraction"),
    (["--predictor", "psychic"], "unknown predictor 'psychic'"),
    (["--kv-cache", "int3"], "unknown KV cache type 'int3'"),
])
def test_store_and_model_flags_are_checked_before_loading(unloadable, capsys, flags, needle):
    assert_one_line_error(cli(capsys, "info", "-m", unloadable, *flags), needle)


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--max-tokens", "-3"], "max_tokens must be >= 0"),
    (["--seed", str(2**64)], "seed must be in [0, 2**64)"),
    (["--speculative", "mtp", "--draft-tokens", "many"], "--draft-tokens must be an integer or auto"),
])
def test_sampling_flags_are_checked_before_loading(unloadable, capsys, flags, needle):
    assert_one_line_error(cli(capsys, "generate", "-m", unloadable, "hi", *flags), needle)


@pytest.mark.parametrize("budget", ["abc", "-5%", "200%", -5, math.nan])
def test_budgets_are_checked_when_the_options_are_made(budget):
    with pytest.raises(MoerunError, match="--ram-budget"):
        StoreOptions(ram_budget=budget)


@pytest.mark.parametrize("change,needle", [
    ({"eos_token": 5}, "eos_token must be a string"),
    ({"bos_token": {"content": ["x"]}}, "bos_token must be a string"),
    ({"chat_template": [{"name": "default"}]}, "chat_template must be a string or a list"),
    ({"chat_template": 7}, "chat_template must be a string or a list"),
    ({"chat_template": "{% for m in messages %}{{ m.content }"}, "chat template is not valid Jinja"),
], ids=["eos-int", "bos-list", "named-without-template", "template-int", "template-syntax"])
def test_malformed_tokenizer_config(tiny, tmp_path, capsys, change, needle):
    d = copy(tiny, tmp_path)
    edit_json(d / "tokenizer_config.json", **change)
    assert_refused(capsys, d, needle)


def test_a_template_that_raises_is_one_moerun_error(tiny, tmp_path):
    d = copy(tiny, tmp_path)
    edit_json(d / "tokenizer_config.json", chat_template="{{ raise_exception('roles must alternate') }}")
    llm = moerun.load(d, threads=1)
    with pytest.raises(MoerunError, match="roles must alternate"):
        llm.encode_prompt([{"role": "user", "content": "hi"}])
