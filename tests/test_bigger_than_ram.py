"""A model bigger than RAM (issue 37): the random GGUF writer (streamed Q8_0/Q4_0 blocks, no
partial file on failure), and the expert store reading a GGUF file's Q8_0 experts from disk
(O_DIRECT reads, `--ram-budget auto`, a file changed under the store refused). Tiny shapes
only; the full Qwen3.6-35B-A3B shape is measured by benchmarks/bigger_than_ram.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import moerun
from conftest import assert_one_line_error, cli
from moerun.errors import MoerunError
from moerun.loaders import gguf_write
from moerun.loaders.gguf import GGUFFile
from moerun.loaders.gguf_write import write_random

sys.path.insert(0, str(Path(__file__).parent))
from test_gguf import CONFIGS  # noqa: E402

TINY = dict(CONFIGS["qwen3_5_moe"], num_experts=8, num_experts_per_tok=2)


def _blocks(f: GGUFFile, name: str, per: int) -> np.ndarray:
    t = f.tensors[name]
    return f.raw(t).reshape(-1).numpy().reshape(-1, 2 + per)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_random_gguf_has_the_shape_and_loads(tmp_path, qtype):
    out = tmp_path / "r.gguf"
    info = write_random(out, TINY, qtype, progress=False)
    gt = qtype.upper()
    assert info["bytes"] == out.stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name != "r.gguf"]  # no temporary left
    f = GGUFFile(out)
    try:
        ts = f.tensors
        # quantized: experts, attention, DeltaNet projections, embedding, head; float: the rest
        for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight", "blk.1.attn_q.weight",
                     "blk.0.attn_qkv.weight", "token_embd.weight"):
            assert ts[name].type == gt, name
        assert ts["output.weight"].type == "Q8_0"  # the head stays Q8_0 under q4_0 (llama-quantize's rule)
        for name in ("blk.0.ffn_gate_inp.weight", "blk.0.attn_norm.weight", "blk.0.ssm_a", "output_norm.weight"):
            assert ts[name].type == "F32", name
        assert ts["blk.0.ffn_gate_exps.weight"].shape[0] == 8
        assert any(".nextn." in n for n in ts)  # the MTP layer
        per = 32 if qtype == "q8_0" else 16
        b = _blocks(f, "blk.0.ffn_up_exps.weight", per)
        d = b[:, :2].copy().view(np.float16).astype(np.float32).ravel()
        lo, hi = gguf_write.SCALE_RANGE[gt]
        assert d.min() >= np.float16(lo) * 0.999 and d.max() <= np.float16(hi) * 1.001
        q = b[:, 2:].view(np.int8)
        if qtype == "q8_0":
            assert q.min() == -127 and q.max() == 127  # -128 is no Q8_0 level
        assert len(np.unique(q)) > 100  # random, not a constant fill
        a = f.floats(ts["blk.0.ssm_a"])
        assert bool((a < 0).all())  # A = -exp(A_log), through the converter's transform
    finally:
        f.close()
    llm = moerun.load(out, threads=1)
    logits = llm.forward(torch.tensor([[1, 2, 3, 4]]))
    assert logits.shape == (1, 4, TINY["vocab_size"]) and bool(torch.isfinite(logits).all())


def test_random_gguf_is_streamed_in_chunks(tmp_path, monkeypatch):
    """No tensor is made whole: blocks come at most CHUNK_BLOCKS at a time."""
    sizes = []
    real = gguf_write.random_blocks

    def spy(gtype, n, rng):
        sizes.append(n)
        return real(gtype, n, rng)

    monkeypatch.setattr(gguf_write, "CHUNK_BLOCKS", 64)
    monkeypatch.setattr(gguf_write, "random_blocks", spy)
    out = tmp_path / "r.gguf"
    write_random(out, TINY, "q8_0", progress=False)
    assert max(sizes) == 64 and len(sizes) > 50
    f = GGUFFile(out)
    try:
        blocks = sum(t.nbytes // 34 for t in f.tensors.values() if t.type == "Q8_0")
    finally:
        f.close()
    assert sum(sizes) == blocks


@pytest.mark.parametrize("when", [0, 5])
def test_random_gguf_failure_leaves_no_file(tmp_path, monkeypatch, when):
    """A full disk (the writer failing at its first or a later chunk) leaves no partial file,
    not even the temporary one, and the CLI says so in one line."""
    calls = []
    real = gguf_write.random_blocks

    def failing(gtype, n, rng):
        calls.append(n)
        if len(calls) > when:
            raise OSError(28, "No space left on device")
        return real(gtype, n, rng)

    monkeypatch.setattr(gguf_write, "CHUNK_BLOCKS", 64)
    monkeypatch.setattr(gguf_write, "random_blocks", failing)
    with pytest.raises(OSError, match="No space"):
        write_random(tmp_path / "r.gguf", TINY, "q8_0", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_random_model_cli_refusals(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.gguf"
    out.write_bytes(b"x")
    assert_one_line_error(cli(capsys, "random-model", "qwen3.6-35b-a3b", "--layers", "1", "--quant", "q8_0",
                              "-o", out), "exists")
    assert out.read_bytes() == b"x"

    class Usage:
        free = 10**9

    monkeypatch.setattr(gguf_write.shutil, "disk_usage", lambda p: Usage)
    assert_one_line_error(cli(capsys, "random-model", "qwen3.6-35b-a3b", "--quant", "q8_0", "-o", tmp_path / "big.gguf"),
                          "1.0 GB free", "needs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.gguf"]
    rc, _ = cli(capsys, "random-model", "qwen3.6-35b-a3b", "--quant", "q3_k", "-o", tmp_path / "x.gguf")
    assert rc != 0
