"""A model bigger than RAM (issue 37): the random GGUF writer (streamed Q8_0/Q4_0 blocks, no
partial file on failure), and the expert store reading a GGUF file's Q8_0 experts from disk
(O_DIRECT reads, `--ram-budget auto`, a file changed under the store refused). Tiny shapes
only; the full Qwen3.6-35B-A3B shape is measured by benchmarks/bigger_than_ram.py."""

from __future__ import annotations

import os
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


# -- the store on a GGUF file's Q8_0/Q4_0 experts -------------------------------------------------

@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("q8") / "r.gguf"
    write_random(out, TINY, "q8_0", progress=False)
    return out


def _store_load(path, **kw):
    from moerun.experts.attach import load as load_with_store
    from moerun.experts.store import StoreOptions

    return load_with_store(path, threads=1, options=StoreOptions(**kw))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_store_reads_gguf_block_experts_bit_identical(tmp_path, qtype, q8_file):
    """Q8_0/Q4_0 experts are no longer refused: the store reads each expert's rows of blocks
    (O_DIRECT, or buffered preads) and repacks them; logits and greedy tokens are those of the
    file loaded whole, at every budget."""
    path = q8_file if qtype == "q8_0" else tmp_path / "q4.gguf"
    if qtype == "q4_0":
        write_random(path, TINY, "q4_0", progress=False)
    whole = moerun.load(path, threads=1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    want = whole.forward(ids)
    p = ids[0, :5].tolist()
    greedy = whole.generate_ids([p], max_tokens=6, temperature=0)
    for budget, direct in (("100%", True), ("30%", True), ("30%", False), ("1B", True)):
        llm = _store_load(path, ram_budget=budget, direct_io=direct)
        try:
            assert llm.store.fmt == ("int8" if qtype == "q8_0" else "int4")
            assert torch.equal(llm.forward(ids), want), (budget, direct)
            assert llm.generate_ids([p], max_tokens=6, temperature=0) == greedy
            st = llm.store.stats()
            assert st["io"] == ("direct" if direct else "buffered")
            if budget != "100%":
                assert st["demand_misses"] > 0 and st["tiers"]["disk"]["bytes_read"] > 0
            if direct:  # every read went through O_DIRECT in whole aligned pages
                disk = st["tiers"]["disk"]
                assert llm.store.reader.direct_files == 1
                assert disk["bytes_preads"] % 4096 == 0 and disk["bytes_preads"] >= disk["bytes_read"]
        finally:
            llm.store.close()


def test_gguf_block_experts_are_not_read_at_load(q8_file):
    """The experts' bytes are not read (nor repacked) when the model loads: only the
    non-expert tensors are, so a file bigger than RAM loads."""
    from moerun.experts.attach import gguf_resident_bytes

    llm = _store_load(q8_file, ram_budget="1B")
    try:
        resident = gguf_resident_bytes(q8_file)
        assert llm.store.non_expert_bytes == resident
        assert llm.store.total_bytes > 0
        assert llm.store.stats()["tiers"]["disk"]["bytes_read"] == 0
        f = GGUFFile(q8_file)
        experts = sum(t.nbytes for n, t in f.tensors.items() if "_exps" in n)
        f.close()
        assert experts == llm.store.total_bytes  # the same blocks, repacked at the same size
        assert resident + experts <= q8_file.stat().st_size
    finally:
        llm.store.close()


def _expert_pages_cached(path: Path) -> float:
    """Share of the expert stacks' pages in the page cache."""
    import ctypes
    import mmap

    f = GGUFFile(path)
    spans = [(t.offset, t.nbytes) for n, t in f.tensors.items() if "_exps" in n]
    f.close()
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    n = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    try:
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    pages = [p for off, nb in spans for p in range(off // mmap.PAGESIZE, -(-(off + nb) // mmap.PAGESIZE))]
    return sum(vec[p] & 1 for p in pages) / len(pages)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="needs O_DIRECT")
def test_direct_reads_leave_no_page_cache(tmp_path):
    """With O_DIRECT the experts read never enter the page cache, so the budget is a real
    bound: reading every expert adds none of the expert stacks' pages to it (loading the other
    tensors through the memory map may bring in a few at their edges, before); buffered reads
    without dropping leave them there."""
    path = tmp_path / "r.gguf"
    write_random(path, dict(TINY, hidden_size=128, moe_intermediate_size=256), "q8_0", progress=False)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    for kw, check in ((dict(direct_io=True), lambda before, after: after - before < 0.01),
                      (dict(direct_io=False, drop_page_cache=False), lambda before, after: after > 0.8)):
        llm = _store_load(path, ram_budget="25%", **kw)
        try:
            st = llm.store
            before = _expert_pages_cached(path)
            for layer, n in st.num_experts.items():
                for e in range(n):
                    st.get(layer, [e])
                    st.release(layer, [e])
            assert st.stats()["tiers"]["disk"]["reads"] > 0
            after = _expert_pages_cached(path)
            assert check(before, after), (kw, before, after)
        finally:
            llm.store.close()
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def test_file_changed_under_the_store_is_refused(tmp_path):
    import shutil

    path = tmp_path / "r.gguf"
    write_random(path, TINY, "q8_0", progress=False)
    for direct in (True, False):
        llm = _store_load(path, ram_budget="1B", direct_io=direct)
        try:
            llm.forward(torch.tensor([[1, 2]]))  # reads fine
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place, same size
            with pytest.raises(MoerunError, match="changed on disk"):
                llm.forward(torch.tensor([[3, 4]]))
        finally:
            llm.store.close()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    # appended to: the size moved
    llm = _store_load(path, ram_budget="1B")
    try:
        with open(path, "ab") as fh:
            fh.write(b"\0" * 4096)
        with pytest.raises(MoerunError, match=r"changed on disk .*size"):
            llm.forward(torch.tensor([[5, 6]]))
    finally:
        llm.store.close()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_ram_budget_auto(q8_file, monkeypatch, capsys):
    """`auto` is the free RAM less the non-expert weights and a margin (capped at all the
    experts); when the non-expert weights do not fit it is refused in one line that says how
    much is needed, before any weight loads."""
    from moerun.experts import store as store_mod
    from moerun.experts.attach import gguf_resident_bytes

    resident = gguf_resident_bytes(q8_file)
    margin = 1 << 20
    monkeypatch.setattr(store_mod, "mem_available", lambda: resident + margin + 100_000)
    import moerun.experts.attach as attach_mod

    monkeypatch.setattr(attach_mod, "mem_available", lambda: resident + margin + 100_000)
    llm = _store_load(q8_file, ram_budget="auto", auto_margin=margin)
    try:
        auto = llm.store.stats()["ram_budget_auto"]
        assert auto["budget_bytes"] == 100_000 and llm.store.tiers["host"].budget == 100_000
        assert auto["non_expert_bytes"] == resident
    finally:
        llm.store.close()
    monkeypatch.setattr(attach_mod, "mem_available", lambda: resident // 2)
    import moerun.loaders.gguf as gguf_mod

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the budget was checked")

    monkeypatch.setattr(gguf_mod, "build", no_load)
    with pytest.raises(MoerunError, match="non-expert weights need .* short"):
        _store_load(q8_file, ram_budget="auto", auto_margin=margin)
    assert_one_line_error(cli(capsys, "bench", "-m", q8_file, "--ram-budget", "auto", "--gen-tokens", "1",
                              "--prompt-tokens", "1"), "--ram-budget auto", "non-expert weights need", "short")
    rc, _ = cli(capsys, "bench", "-m", q8_file, "--ram-budget", "autox", "--gen-tokens", "1", "--prompt-tokens", "1")
    assert rc != 0


@pytest.mark.parametrize("fmt,per", [("int8", 32), ("int4", 16)])
def test_repack_at_read_is_the_loaders_repack(fmt, per):
    """The store's repack of GGUF rows (int16/int32 copies, or byte copies at odd addresses)
    gives the bytes the loader's `_repack` gives, for whole groups of 8 blocks and tails."""
    from moerun.experts.store import repack_ggml
    from moerun.loaders.gguf import _repack

    g = torch.Generator().manual_seed(0)
    for rows, nb in ((16, 64), (8, 16), (7, 11), (3, 5)):
        n = rows * nb * (2 + per)
        for shift in (0, 1, 2):
            raw = torch.randint(0, 256, (n + 4,), dtype=torch.uint8, generator=g)[shift : shift + n]
            q0, s0 = _repack(raw.view(rows, -1), fmt)
            for qshift in (0, 1):
                qs = torch.empty(rows * nb * per + 4, dtype=torch.uint8)
                q = qs[qshift : qshift + rows * nb * per].view(rows, nb * per).view(q0.dtype)
                s = torch.empty_like(s0)
                repack_ggml(raw, q, s, fmt)
                assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)), (rows, nb, shift, qshift)
                assert torch.equal(s.view(torch.int16), s0.view(torch.int16))


def test_benchmark_script_refuses_a_missing_file(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bigger_than_ram.py"), "-m", str(tmp_path / "no.gguf")],
                       capture_output=True, text=True, timeout=120)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 1 and len(lines) == 1 and "is not a file" in lines[0], p.stderr
