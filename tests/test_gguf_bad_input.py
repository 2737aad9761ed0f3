"""A broken or unsupported GGUF file is one line on stderr and a non-zero exit; a failed
export leaves nothing behind."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

import moerun
from moerun.loaders.gguf_write import export

DEMO = Path(moerun.__file__).parent / "demo_model"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "demo.gguf"
    export(DEMO, out, "q4_0")
    return out


def run(path):
    return subprocess.run([sys.executable, "-m", "moerun.cli", "generate", "-m", str(path), "hi", "--max-tokens", "1",
                           "--threads", "1"], capture_output=True, text=True, timeout=120)


def assert_one_line_error(r, *needles):
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def patched(good: Path, tmp_path: Path, edit) -> Path:
    data = bytearray(good.read_bytes())
    edit(data)
    out = tmp_path / "bad.gguf"
    out.write_bytes(bytes(data))
    return out


def tensor_entry(data: bytearray, name: str) -> int:
    """Offset of tensor `name`'s n_dims field in the tensor table."""
    raw = name.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw)
    return at + 8 + len(raw)


def set_type(data: bytearray, name: str, ggml_type: int) -> None:
    at = tensor_entry(data, name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)


def test_good_file_generates(good):
    r = run(good)
    assert r.returncode == 0, r.stderr


def test_truncated_header(good, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes()[:5000])
    assert_one_line_error(run(bad), "truncated")


def test_truncated_data(good, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert_one_line_error(run(bad), "truncated", "ends at byte")


def test_wrong_magic(good, tmp_path):
    assert_one_line_error(run(patched(good, tmp_path, lambda d: d.__setitem__(slice(0, 4), b"GGML"))), "not a GGUF file")


def test_unsupported_version(good, tmp_path):
    assert_one_line_error(run(patched(good, tmp_path, lambda d: struct.pack_into("<I", d, 4, 7))), "version 7")


def test_huge_counts_are_refused_before_allocating(good, tmp_path):
    assert_one_line_error(run(patched(good, tmp_path, lambda d: struct.pack_into("<Q", d, 16, 1 << 60))),
                          "claims", "metadata entries")


def test_huge_array_is_refused_before_allocating(good, tmp_path):
    def edit(d):
        key = b"tokenizer.ggml.tokens"
        at = d.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4  # the array's count
        struct.pack_into("<Q", d, at, 1 << 50)
    assert_one_line_error(run(patched(good, tmp_path, edit)), "truncated or corrupt", "tokenizer.ggml.tokens")


def test_metadata_value_of_the_wrong_type(good, tmp_path):
    def edit(d):
        key = b"qwen35moe.block_count"
        at = d.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
        struct.pack_into("<I", d, at, 6)  # uint32 -> float32, same size
    assert_one_line_error(run(patched(good, tmp_path, edit)), "qwen35moe.block_count", "expected int")


def test_tensor_past_the_end_of_the_file(good, tmp_path):
    def edit(d):
        at = tensor_entry(d, "output_norm.weight")
        struct.pack_into("<Q", d, at + 4 + 8 + 4, 1 << 40)  # n_dims 1: dims, type, then the offset
    assert_one_line_error(run(patched(good, tmp_path, edit)), "output_norm.weight", "ends at byte")


def test_missing_tensor(good, tmp_path):
    def edit(d):
        at = d.index(b"output_norm.weight")
        d[at : at + len(b"output_norm.weight")] = b"output_norx.weight"
    assert_one_line_error(run(patched(good, tmp_path, edit)), "missing tensor 'output_norm.weight'")


def test_unknown_architecture(good, tmp_path):
    def edit(d):
        key = b"general.architecture"
        at = d.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 8
        d[at : at + 9] = b"qwen99moe"
    assert_one_line_error(run(patched(good, tmp_path, edit)), "'qwen99moe'", "supported:", "deepseek2", "qwen35moe")


@pytest.mark.parametrize("ggml_type, name", [(20, "IQ4_NL"), (39, "MXFP4")])
def test_unsupported_tensor_type(good, tmp_path, ggml_type, name):
    tensor = "blk.0.ffn_gate_exps.weight"
    r = run(patched(good, tmp_path, lambda d: set_type(d, tensor, ggml_type)))
    assert_one_line_error(r, tensor, name)


def test_rows_not_whole_blocks(good, tmp_path):
    r = run(patched(good, tmp_path, lambda d: set_type(d, "blk.0.ffn_gate_exps.weight", 10)))  # Q2_K: 256 per block
    assert_one_line_error(r, "blk.0.ffn_gate_exps.weight", "Q2_K")


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    import moerun.loaders.gguf_write as w

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(w, "_to_ggml", boom)
    with pytest.raises(OSError):
        export(DEMO, tmp_path / "x.gguf", "q8_0")
    assert list(tmp_path.iterdir()) == []


def test_unsupported_tokenizer_kind_stops_text_but_not_the_weights(good, tmp_path):
    """A tokenizer moerun cannot build (here 'bert'): generating text says why in one line,
    while `bench` runs the weights."""
    def edit(d):
        key = b"tokenizer.ggml.model"
        at = d.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 8
        assert d[at : at + 4] == b"gpt2"
        d[at : at + 4] = b"bert"
    bad = patched(good, tmp_path, edit)
    assert_one_line_error(run(bad), "tokenizer model 'bert' is not supported")
    r = subprocess.run([sys.executable, "-m", "moerun.cli", "bench", "-m", str(bad), "--prompt-tokens", "4",
                        "--gen-tokens", "2", "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
