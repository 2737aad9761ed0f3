"""benchmarks/read_layout.py (issue 37, item 2): the expert-major cache file holds each
expert's gate|up|down bytes as the GGUF file has them, a failed build leaves no file, every
read method reads those bytes, and bad input is one line."""

from __future__ import annotations

import errno
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "read_layout.py"


def script():
    spec = importlib.util.spec_from_file_location("read_layout", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from test_gguf import CONFIGS, random_checkpoint

    from moerun.loaders.gguf_write import export

    d = tmp_path_factory.mktemp("layout")
    ck = random_checkpoint(d / "ck", dict(CONFIGS["qwen3_moe"], mlp_only_layers=[]))
    out = d / "m.gguf"
    export(ck, out, "q8_0")
    return out


def source_bytes(path, ranges, key) -> bytes:
    with open(path, "rb") as f:
        return b"".join(os.pread(f.fileno(), n, o) for o, n in ranges[key])


def test_cache_records_are_the_experts_bytes(gguf, tmp_path):
    m = script()
    ranges, per, E, layers = m.expert_ranges(gguf, [0, 2])
    assert layers == [0, 1, 2] and E == 6 and len(ranges) == 12
    # gate and up are [I, H] = 32 rows of 64 Q8_0 weights (2 blocks of 34 bytes), down [H, I]: 64 rows of 1 block
    assert [n for _, n in ranges[(0, 0)]] == [32 * 68, 32 * 68, 64 * 34] and per == 3 * 2176
    info = m.build_cache(gguf, ranges, per, tmp_path / "c.bin")
    rec = info["record_bytes"]
    assert rec == 8192 and (tmp_path / "c.bin").stat().st_size == 12 * rec
    assert not list(tmp_path.glob("*.partial"))
    data = (tmp_path / "c.bin").read_bytes()
    for k, i in info["index"].items():
        want = source_bytes(gguf, ranges, k)
        assert data[i * rec: i * rec + per] == want
        assert data[i * rec + per: (i + 1) * rec] == bytes(rec - per)
    # experts differ (the check would not pass on a file of copies)
    assert source_bytes(gguf, ranges, (0, 0)) != source_bytes(gguf, ranges, (0, 1))


def test_a_failed_build_leaves_no_file(gguf, tmp_path, monkeypatch):
    m = script()
    ranges, per, _, _ = m.expert_ranges(gguf, [1])
    calls, real = [], os.pwritev

    def full(fd, bufs, off):  # the disk fills up at the third record
        calls.append(off)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, off)
    monkeypatch.setattr(m.os, "pwritev", full)
    with pytest.raises(OSError):
        m.build_cache(gguf, ranges, per, tmp_path / "c.bin")
    assert len(calls) == 3 and list(tmp_path.iterdir()) == []


def test_every_method_reads_the_expert(gguf):
    """Each method's reads, run on one expert, land its bytes in the buffers it reads into."""
    m = script()
    ranges, per, _, _ = m.expert_ranges(gguf, [2])
    key = (2, 5)  # the last expert of the last layer: its widened span may pass the end of the file
    want = source_bytes(gguf, ranges, key)
    fd = os.open(gguf, os.O_RDONLY | os.O_DIRECT)
    try:
        got = []
        for (o, n) in ranges[key]:
            start, length = m.span(o, n)
            b = m.aligned_buffer(length)
            m.read_range(fd, b, o, n)
            got.append(bytes(b[o - start:o - start + n]))
        assert b"".join(got) == want
        maxlen = max(m.span(o, n)[1] for o, n in ranges[key])
        for fn in (m.three_serial, m.three_pool):
            assert fn(fd, [ranges[key]] * 4, 2, maxlen) > 0
        try:
            import liburing  # noqa: F401
        except ImportError:
            return
        ba = m.aligned_bytearray(8192)
        assert len(ba) == 8192
        assert m.three_uring(fd, [ranges[key]] * 4, 2, maxlen) > 0
    finally:
        os.close(fd)


def test_bad_input_is_one_line(tmp_path, gguf):
    p = subprocess.run([sys.executable, str(SCRIPT), "-m", str(tmp_path / "none.gguf")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [f"read_layout: error: {tmp_path / 'none.gguf'} is not a file"]
    p = subprocess.run([sys.executable, str(SCRIPT), "-m", str(gguf), "--layers", "0", "--methods", "nope",
                        "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "--methods" in p.stderr
    p = subprocess.run([sys.executable, str(SCRIPT), "-m", str(gguf), "--layers", "9", "--cache-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [f"read_layout: error: {gguf} has no expert tensor "
                                                                     "'blk.9.ffn_gate_exps.weight'"]
