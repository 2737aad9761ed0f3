"""The expert store holding packed experts (a checkpoint written by `moerun quantize`): the
native kernel's per-pair arithmetic does not depend on which other experts are in the
stack, so the store's outputs are bit-identical to the plain quantized model whatever the
tiers hold; budgets count packed bytes; bad files and flags are one clear error."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

import moerun
from moerun import kernels
from moerun.bench.random_model import write_random_model
from moerun.cli import main
from moerun.errors import MoerunError
from moerun.experts import StoreOptions, attach_store, load
from moerun.experts.placement import CpuSpeed
from moerun.experts.store import ExpertStore, LayerExperts, quantized_expert_pieces
from moerun.loaders.safetensors import Checkpoint
from moerun.loaders.quantized_write import quantize_checkpoint
from moerun.layers.quantized import QuantizedExperts
from test_expert_store import _hint_next_layer
from test_quantize_checkpoint import TINY_QWEN3, assert_one_line_error, cli, demo_int4  # noqa: F401 (demo_int4 is a fixture)

TINY = dict(TINY_QWEN3, num_hidden_layers=3)  # MoE layers 0 and 2
MOE_LAYERS = (0, 2)


def random_experts(E=8, H=64, I=40, fmt="int4", seed=0) -> QuantizedExperts:
    g = torch.Generator().manual_seed(seed)
    m = QuantizedExperts(E, H, I, fmt)
    for name, b in m.named_buffers():
        if name.endswith("_scales"):
            b.copy_((torch.rand(b.shape, generator=g) * 0.02 + 0.001).half())
        else:
            b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8).view(b.dtype))
    return m


# -- the kernel on a stack of only the needed experts ----------------------------------------


@pytest.mark.parametrize("isa", ["native", "torch"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_kernel_pairs_independent_of_other_experts(fmt, isa):
    if isa == "native" and kernels.isa() == "torch":
        pytest.skip("native extension not loaded")
    m = random_experts(fmt=fmt)
    bufs = [b for _, b in m.named_buffers()]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(5)])  # [T, K]: 3 distinct per token
    ids[:, 0] = 6  # one expert shared by every token
    w = torch.rand(5, 3, generator=g)
    needed = ids.unique()  # ascending
    junk = random_experts(fmt=fmt, seed=9)  # experts no token asks for, interleaved with the needed ones
    with kernels.use_isa(kernels.isa() if isa == "native" else "torch"):
        full = kernels.moe_experts(x, ids, w, *bufs, fmt, 40)
        local = torch.empty(8, dtype=torch.long)
        local[needed] = torch.arange(len(needed))
        only = kernels.moe_experts(x, local[ids], w, *[b[needed] for b in bufs], fmt, 40)
        mixed = [torch.stack([t for e in needed for t in (b[e], j[e])]) for b, j in zip(bufs, junk.buffers())]
        spread = kernels.moe_experts(x, 2 * local[ids], w, *mixed, fmt, 40)
    assert torch.equal(full, only) and torch.equal(full, spread)
    # and it is the experts' arithmetic, not a constant: another expert changes the result
    other = ids.clone()
    other[:, 0] = 7
    assert not torch.equal(full, kernels.moe_experts(x, other, w, *bufs, fmt, 40))


# -- a tiny quantized checkpoint through the store ----------------------------------------------


@pytest.fixture(scope="module")
def qmodel(tmp_path_factory):
    root = tmp_path_factory.mktemp("qstore")
    src = write_random_model(root / "float", dict(TINY))
    q = root / "int4"
    quantize_checkpoint(src, q, "int4", dtype="float32")
    plain = moerun.load(q, threads=1)
    assert any(isinstance(m, QuantizedExperts) for m in plain.net.modules())
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(0))
    prompts = [ids[0, :5].tolist(), ids[1, :3].tolist()]
    return src, q, ids, plain.forward(ids), prompts, plain.generate_ids(prompts, max_tokens=8, temperature=0.0)


def expert_file_bytes(path) -> int:
    """The packed expert tensors' bytes, from the checkpoint's header."""
    return sum(r.nbytes for n, r in Checkpoint(path).tensors.items() if ".experts." in n)


@pytest.mark.parametrize("opts, hint", [
    (dict(), False),
    (dict(ram_budget="50%"), False),
    (dict(ram_budget="25%"), True),  # less than a layer: disk streaming and transient loads
    (dict(ram_budget="50%", pin_hot=2), False),
    (dict(vram_budget="25%", emulate_link="pcie4"), True),
    (dict(ram_budget="50%", vram_budget="25%", emulate_link="pcie4", execute="cpu"), False),
    (dict(vram_budget="25%", emulate_link="pcie4", execute="auto"), True),
])
def test_bit_identical_to_the_plain_quantized_model(qmodel, opts, hint):
    from moerun.experts.attach import QuantStoreExperts

    _, q, ids, logits, prompts, greedy = qmodel
    llm = load(q, threads=1, options=StoreOptions(**opts))
    try:
        assert sum(isinstance(m, QuantStoreExperts) for m in llm.net.modules()) == len(MOE_LAYERS)
        if hint:
            _hint_next_layer(llm)
        assert torch.equal(llm.forward(ids), logits)
        assert llm.generate_ids(prompts, max_tokens=8, temperature=0.0) == greedy
        st = llm.store.stats()
        total = expert_file_bytes(q)
        assert st["experts_bytes"] == total  # the budgets' 100%: packed bytes, not float ones
        per_expert = total // (8 * len(MOE_LAYERS))
        for name, t in st["tiers"].items():
            if "budget_bytes" in t:
                assert t["peak_bytes"] <= t["budget_bytes"]
                assert t["used_bytes"] == t["resident_experts"] * per_expert
        if "ram_budget" in opts:
            assert st["tiers"]["host"]["budget_bytes"] == int(total * int(opts["ram_budget"][:-1]) / 100)
            assert st["tiers"]["disk"]["bytes_read"] == st["tiers"]["disk"]["reads"] * per_expert > 0
        if opts.get("execute") == "cpu":
            assert st["cpu_executed"] > 0 and st["link_bytes_avoided"] == st["cpu_executed"] * per_expert
        if hint:
            assert st["prefetch_issued"] > 0
    finally:
        llm.store.close()


def test_cost_model_uses_packed_bytes(qmodel):
    _, q, *_ = qmodel
    llm = load(q, threads=1, options=StoreOptions(vram_budget="50%", emulate_link="pcie4", execute="auto"))
    try:
        s = llm.store
        weights = 3 * 64 * 40 * 8 * len(MOE_LAYERS)
        assert s.fmt == "int4" and s.cost.itemsize == s.total_bytes / weights < 1
        assert s.cost.cpu.a > 0  # timed on the native kernel over one packed expert
    finally:
        llm.store.close()
    speed = CpuSpeed.calibrate(64, 40, torch.float32, "int8")
    assert speed.seconds(1, 1000) > 0


def test_truncated_quantized_shard_names_the_tensor(qmodel, tmp_path):
    _, q, *_ = qmodel
    d = tmp_path / "q"
    shutil.copytree(q, d)
    names = Checkpoint(d).tensors
    layers = [LayerExperts(l, 8, 64, 40, quantized_expert_pieces(names, f"model.layers.{l}.mlp.experts", 8, 64, 40,
                                                                 "int4"), "int4") for l in MOE_LAYERS]
    last = max(((l.layer, e, p) for l in layers for e, ps in enumerate(l.pieces) for p in ps),
               key=lambda t: t[2].offset)
    layer, e, piece = last
    with ExpertStore(layers, torch.float32, StoreOptions(ram_budget="25%"), top_k=2) as s:
        os.truncate(d / "model.safetensors", piece.offset + piece.nbytes // 2)
        with pytest.raises(MoerunError, match=re.escape(piece.name) + ".*truncated"):
            s.get(layer, [e])
        w = s.get(layer, [0])  # an expert whose bytes are all there still loads
        s.release(layer, [0])
        assert len(w[0]) == 6 and all(ent.in_use == 0 for ent in s.entries.values())


def test_missing_quantized_tensor_names_it(qmodel):
    _, q, *_ = qmodel
    names = dict(Checkpoint(q).tensors)
    del names["model.layers.2.mlp.experts.up_scales"]
    with pytest.raises(MoerunError, match=r"model\.layers\.2\.mlp\.experts\.up_scales"):
        quantized_expert_pieces(names, "model.layers.2.mlp.experts", 8, 64, 40, "int4")


def test_quantized_at_load_cannot_be_streamed(qmodel):
    src, *_ = qmodel
    llm = moerun.load(src, threads=1, quant="int4")
    with pytest.raises(MoerunError, match="moerun quantize"):
        attach_store(llm.net, src, StoreOptions(ram_budget="50%"))
    assert sum(isinstance(m, QuantizedExperts) for m in llm.net.modules()) == len(MOE_LAYERS)  # left as it was


# -- the command line ---------------------------------------------------------------------------


def test_cli_generate_with_store_on_quantized_demo(demo_int4, capsys):
    args = ["generate", "-m", str(demo_int4), "def fib(n):", "--max-tokens", "12", "--temperature", "0", "--threads", "1"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert plain.strip()
    assert main([*args, "--ram-budget", "50%", "--stats"]) == 0
    stored, err = capsys.readouterr()
    err = err.splitlines()
    assert stored == plain  # the demo model's MTP head and DeltaNet layers included
    assert any(line.startswith("experts: hit rate") for line in err), err
    host = next(line for line in err if line.strip().startswith("host:"))
    assert "of" in host and "evictions" in host


def test_cli_bad_quant_with_store(qmodel, demo_int4, capsys):
    src, q, *_ = qmodel
    assert_one_line_error(cli(capsys, "info", "-m", src, "--quant", "int4", "--ram-budget", "50%"),
                          "needs a quantized checkpoint", "moerun quantize")
    assert_one_line_error(cli(capsys, "info", "-m", q, "--quant", "int8", "--ram-budget", "50%"),
                          "written quantized with policy int4")
    rc, err = cli(capsys, "info", "-m", q, "--quant", "int4", "--ram-budget", "50%")  # the stored policy: fine
    assert rc == 0, err
    assert_one_line_error(cli(capsys, "info", "-m", q, "--ram-budget", "lots"), "cannot read --ram-budget")
    d = demo_int4.parent / "cut"
    shutil.copytree(demo_int4, d)
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1000)
    assert_one_line_error(cli(capsys, "generate", "-m", d, "x", "--ram-budget", "50%"), "model.safetensors")
