"""Paging in, at load, the mapped file pages a net reads (`moerun.loaders.populate`): which
bytes, that they end up in this process's page table, the cases where it does nothing (too
big for memory, the expert store, `info`, without --populate: it is off by default)."""

from __future__ import annotations

import mmap
import struct
import sys

import pytest
import torch
from torch import nn

import moerun
from moerun.loaders import populate as pop

from conftest import cli

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page tables")

PAGE = mmap.PAGESIZE


def present(lo: int, hi: int) -> list[bool]:
    """Per page of [lo, hi): is it mapped in this process's page table (pagemap bit 63)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo // PAGE * 8)
        raw = f.read((hi - lo) // PAGE * 8)
    return [bool(e >> 63) for e in struct.unpack(f"<{len(raw) // 8}Q", raw)]


@pytest.fixture
def mapped(tmp_path):
    """A module whose weights are views of a private map of a 2 MiB file, never touched."""
    path = tmp_path / "w.bin"
    path.write_bytes(torch.arange(1 << 21, dtype=torch.int32).to(torch.uint8).numpy().tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    net = nn.Module()
    net.lin = nn.Module()
    net.lin.register_buffer("qweight", flat[256 * PAGE:].view(-1, PAGE))  # pages 256..511
    net.emb = nn.Embedding(16, PAGE // 4)
    net.emb.weight = nn.Parameter(flat[:16 * PAGE].view(torch.float32).view(16, -1), requires_grad=False)
    net.copy = nn.Module()
    net.copy.register_buffer("w", torch.zeros(1 << 16))  # anonymous memory: never a file range
    base = flat.data_ptr()
    yield net, base, mm
    del net, flat


def test_ranges_are_the_file_views_less_the_embedding(mapped):
    net, base, _ = mapped
    assert pop.file_ranges(net) == [(base + 256 * PAGE, base + 512 * PAGE)]


def test_populate_maps_exactly_those_pages(mapped):
    net, base, _ = mapped
    assert not any(present(base, base + 512 * PAGE))  # a fresh map: nothing faulted in yet
    done = pop.populate(net, progress=False)
    assert done["bytes"] == 256 * PAGE and done["how"] in ("madvise", "touch")
    assert all(present(base + 256 * PAGE, base + 512 * PAGE))
    # (the embedding's pages are not asked for, file_ranges says; whether the kernel maps them
    # too depends on its page-cache folio sizes and fault-around, so it is not asserted here)
    assert int(net.lin.qweight[3, 5]) == (259 * PAGE + 5) % 256  # the bytes are the file's


def test_touch_fallback_maps_the_pages_too(mapped, monkeypatch):
    net, base, _ = mapped
    monkeypatch.setattr(pop, "_madvise", lambda addr, n, advice: 22 if advice == pop.MADV_POPULATE_READ else 0)
    done = pop.populate(net, progress=False)
    assert done["how"] == "touch" and all(present(base + 256 * PAGE, base + 512 * PAGE))


def test_nothing_when_it_does_not_fit_in_memory(mapped, monkeypatch):
    net, base, _ = mapped
    monkeypatch.setattr(pop, "mem_available", lambda: pop.MARGIN + 100 * PAGE)
    done = pop.populate(net, progress=False)
    assert done == {"bytes": 0, "seconds": 0.0, "how": "bigger than available memory"}
    assert not any(present(base + 256 * PAGE, base + 512 * PAGE))


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    from moerun.loaders.gguf_write import write_random

    from test_bigger_than_ram import TINY

    out = tmp_path_factory.mktemp("pop") / "r.gguf"
    write_random(out, TINY, "q8_0", progress=False)
    return out


def test_gguf_load_populates_its_views(q8_gguf):
    llm = moerun.load(q8_gguf, threads=1, populate=True)
    ranges = pop.file_ranges(llm.net)
    assert ranges and all(all(present(a, b)) for a, b in ranges)
    lazy = moerun.load(q8_gguf, threads=1, populate=False)
    assert torch.equal(llm.forward(torch.tensor([[1, 2, 3]])), lazy.forward(torch.tensor([[1, 2, 3]])))


def calls(monkeypatch):
    seen = []
    real = pop.populate
    monkeypatch.setattr(pop, "populate", lambda net, **kw: seen.append(net) or real(net, **kw))
    return seen


def test_cli_populates_only_when_asked_never_for_info_and_refuses_the_store(q8_gguf, monkeypatch, capsys):
    seen = calls(monkeypatch)
    rc, _ = cli(capsys, "bench", "-m", q8_gguf, "--prompt-tokens", "4", "--gen-tokens", "1")
    assert rc == 0 and len(seen) == 0  # off by default
    rc, _ = cli(capsys, "bench", "-m", q8_gguf, "--prompt-tokens", "4", "--gen-tokens", "1", "--populate")
    assert rc == 0 and len(seen) == 1
    rc, _ = cli(capsys, "info", "-m", q8_gguf, "--populate")
    assert rc == 0 and len(seen) == 1  # info runs no weights
    rc, err = cli(capsys, "bench", "-m", q8_gguf, "--prompt-tokens", "4", "--gen-tokens", "1", "--ram-budget", "50%",
                  "--populate")
    # the expert store reads its experts by pread: no map to page in, so the pair is refused
    assert rc != 0 and len(seen) == 1 and len(err) == 1 and "--populate pages in the weights' file maps" in err[0]
