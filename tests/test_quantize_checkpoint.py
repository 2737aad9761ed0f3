"""`moerun quantize`: a written quantized checkpoint loads bit for bit as quantize-at-load,
without re-quantizing; bad input is one line and a non-zero exit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moerun
from moerun.bench.random_model import write_random_model
from moerun.cli import main
from moerun.engine.llm import DEMO_MODEL
from moerun.loaders.safetensors import Checkpoint
from moerun.kernels import formats
from moerun.layers import quantized as modules
from moerun.loaders import quantized as checkpoint
from moerun.loaders import quantized_write
from moerun.loaders.quantized_write import quantize_checkpoint
from moerun.quant import POLICIES, QuantPolicy
from moerun.layers.quantized import QuantizedExperts, QuantizedLinear

from conftest import assert_one_line_error, cli

TINY_QWEN3 = dict(
    model_type="qwen3_moe", vocab_size=120, hidden_size=64, intermediate_size=80, moe_intermediate_size=40,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=64,
    tie_word_embeddings=True,  # lm_head is read from the embedding: quantized or tied again on load
)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Random bf16 qwen3_moe: one MoE layer, one dense MLP layer, tied embeddings."""
    return write_random_model(tmp_path_factory.mktemp("q3") / "m", dict(TINY_QWEN3))


@pytest.fixture(scope="module")
def demo_int4(tmp_path_factory):
    """The bundled qwen3_5_moe_text demo model (DeltaNet, shared experts, MTP), written int4."""
    out = tmp_path_factory.mktemp("demo") / "int4"
    quantize_checkpoint(DEMO_MODEL, out, "int4")
    return out


def ids_for(vocab: int, seed=0):
    return torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(seed))


def assert_same_model(a, b):
    """Identical state dicts (names, dtypes, values) and identical logits."""
    sa, sb = a.net.state_dict(), b.net.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    ids = ids_for(a.args.vocab_size)
    assert torch.equal(a.forward(ids), b.forward(ids))


def load_without_quantizing(path, monkeypatch, **kw):
    """Load `path`, failing if anything gets quantized on the way."""
    def refuse(*_):
        raise AssertionError("a stored checkpoint must not be re-quantized")

    with monkeypatch.context() as m:
        m.setattr(formats, "quantize", refuse)
        return moerun.load(path, threads=1, **kw)


@pytest.mark.parametrize("policy,dtype", [("int4", "auto"), ("int8", "bfloat16"), ("int4-all", "float32")])
def test_qwen3_saved_equals_quantized_at_load(qwen3, tmp_path, monkeypatch, policy, dtype):
    out = tmp_path / "q"
    quantize_checkpoint(qwen3, out, policy, dtype=dtype)
    ref = moerun.load(qwen3, dtype=dtype, quant=policy, threads=1)
    got = load_without_quantizing(out, monkeypatch, dtype=dtype)
    assert got.dtype == ref.dtype == (torch.float32 if dtype == "auto" else getattr(torch, dtype))
    assert_same_model(ref, got)
    assert isinstance(got.net.model.layers[0].mlp.experts, QuantizedExperts)
    assert isinstance(got.net.model.layers[1].mlp.down_proj, QuantizedLinear)  # the dense MLP layer
    # --quant with the policy it was written with is a no-op
    assert_same_model(ref, load_without_quantizing(out, monkeypatch, quant=policy, dtype=dtype))


def test_demo_model_saved_equals_quantized_at_load(demo_int4, monkeypatch):
    ref = moerun.load(DEMO_MODEL, quant="int4", threads=1)
    got = load_without_quantizing(demo_int4, monkeypatch)
    assert got.net.has_mtp
    assert_same_model(ref, got)  # the state dicts include the MTP head's quantized modules


def test_config_entry_and_tensor_names(demo_int4):
    cfg = json.loads((demo_int4 / "config.json").read_text())
    entry = cfg["quantization"]
    assert entry["format_version"] == 2 and entry["group_size"] == 32
    assert entry["components"] == asdict(POLICIES["int4"])
    assert cfg["dtype"] == "bfloat16"
    llm = moerun.load(demo_int4, threads=1)
    quantized = {n: m.fmt for n, m in llm.net.named_modules() if isinstance(m, (QuantizedLinear, QuantizedExperts))}
    assert entry["modules"] == quantized
    assert entry["modules"]["model.layers.0.mlp.experts"] == "int4"
    assert entry["modules"]["model.layers.3.self_attn.q_proj"] == "int8"
    assert any(n.startswith("mtp.") for n in quantized)
    with safe_open(demo_int4 / "model.safetensors", "pt") as f:  # readable by the reference implementation
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.gate_q").dtype == torch.uint8
        assert f.get_tensor("model.layers.3.self_attn.q_proj.scales").dtype == torch.float16
    assert "model.layers.3.self_attn.q_proj.qweight" in names and "model.layers.3.self_attn.q_proj.weight" not in names
    assert "model.layers.0.mlp.gate.weight" in names  # the router stays float
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (demo_int4 / f).read_bytes() == (DEMO_MODEL / f).read_bytes()


def test_cli_component_flags_and_tied_head(qwen3, tmp_path, capsys):
    out = tmp_path / "q"
    rc, lines = cli(capsys, "quantize", "-m", qwen3, "-o", out, "--attention", "none", "--lm-head", "none",
                    "--experts", "int8")
    assert rc == 0 and "wrote" in lines[-1]
    got = moerun.load(out, threads=1)
    net = got.net
    assert isinstance(net.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert isinstance(net.model.layers[0].mlp.experts, QuantizedExperts) and net.model.layers[0].mlp.experts.fmt == "int8"
    assert net.lm_head.weight.data_ptr() == net.model.embed_tokens.weight.data_ptr()  # tied again, stored once
    policy = QuantPolicy(experts="int8", attention=None, lm_head=None)
    assert_same_model(moerun.load(qwen3, quant=policy, threads=1), got)


def test_sharded_output_loads_the_same(qwen3, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(qwen3, out, "int4", shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert_same_model(moerun.load(qwen3, quant="int4", threads=1), moerun.load(out, threads=1))


def test_failure_leaves_nothing_half_written(qwen3, tmp_path, monkeypatch, capsys):
    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(quantized_write, "_write_config", fail)
    with pytest.raises(OSError):
        quantize_checkpoint(qwen3, tmp_path / "new", "int4")
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("x")
    with pytest.raises(OSError):
        quantize_checkpoint(qwen3, old, "int4", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no OUT, no temporary directory
    assert [p.name for p in old.iterdir()] == ["keep.txt"]


def test_existing_output_needs_force(qwen3, tmp_path, capsys):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert_one_line_error(cli(capsys, "quantize", "-m", qwen3, "-o", out), "not empty", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    rc, _ = cli(capsys, "quantize", "-m", qwen3, "-o", out, "--force")
    assert rc == 0 and not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["q"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(capsys, "quantize", "-m", qwen3, "-o", empty)[0] == 0  # an empty directory is fine


def test_cli_bad_input(qwen3, tmp_path, capsys):
    out = tmp_path / "q"
    assert_one_line_error(cli(capsys, "quantize", "-o", out), "-m/--model")
    assert_one_line_error(cli(capsys, "quantize", "-m", qwen3), "-o/--output")
    assert_one_line_error(cli(capsys, "quantize", "-m", qwen3, "-o", out, "--experts", "int3"), "invalid choice", "int3")
    assert_one_line_error(cli(capsys, "quantize", "-m", qwen3, "-o", out, "--policy", "fp8"), "invalid choice")
    assert_one_line_error(cli(capsys, "quantize", "-m", tmp_path / "nope", "-o", out), "does not exist")
    none = ("--experts", "none", "--shared-experts", "none", "--attention", "none", "--lm-head", "none")
    assert_one_line_error(cli(capsys, "quantize", "-m", qwen3, "-o", out, *none), "quantizes nothing")
    assert_one_line_error(cli(capsys, "quantize", "-m", qwen3, "-o", qwen3 / "sub"), "must not be the input")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(cli(capsys, "quantize", "-m", qwen3, "-o", tmp_path / "file"), "not a directory")
    assert not out.exists()
    assert cli(capsys, "quantize", "-m", qwen3, "-o", out)[0] == 0
    assert_one_line_error(cli(capsys, "quantize", "-m", out, "-o", tmp_path / "again"), "already a quantized checkpoint")
    assert_one_line_error(cli(capsys, "info", "-m", out, "--quant", "int8"), "written quantized with policy int4",
                          "cannot be loaded as int8")
    assert_one_line_error(cli(capsys, "info", "-m", qwen3, "--quant", "int4", "--ram-budget", "50%"),
                          "expert store needs a quantized checkpoint", "moerun quantize")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "q"]


def broken_copy(src, tmp_path, mutate):
    d = tmp_path / "broken"
    shutil.copytree(src, d)
    mutate(d)
    return d


def test_corrupt_quantized_checkpoint(qwen3, tmp_path, capsys):
    out = tmp_path / "q"
    quantize_checkpoint(qwen3, out, "int4")

    def truncate(d):
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-500])

    def bad_header(d):
        f = d / "model.safetensors"
        b = bytearray(f.read_bytes())
        b[8:12] = b"\xff\xfe{{"
        f.write_bytes(bytes(b))

    def edit_entry(**changes):
        def mutate(d):
            cfg = json.loads((d / "config.json").read_text())
            cfg["quantization"].update(changes)
            (d / "config.json").write_text(json.dumps(cfg))
        return mutate

    def drop_scales(d):
        with safe_open(d / "model.safetensors", "pt") as f:
            kept = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.0.mlp.experts.down_scales"}
        save_file(kept, str(d / "model.safetensors"))

    cases = [
        (truncate, ("truncated", "model.safetensors")),
        (bad_header, ("corrupt",)),
        (drop_scales, ("missing tensor", "down_scales")),
        (edit_entry(format_version=7), ("format_version 7",)),
        (edit_entry(format_version=1), ("format_version 1", "re-run `moerun quantize`")),
        (edit_entry(modules={"model.layers.9.mlp.experts": "int4"}), ("model.layers.9.mlp.experts", "does not have")),
        (edit_entry(modules={"model.layers.0.mlp.experts": "int5"}), ("modules",)),
    ]
    for mutate, needles in cases:
        assert_one_line_error(cli(capsys, "info", "-m", broken_copy(out, tmp_path, mutate)), *needles)
        shutil.rmtree(tmp_path / "broken")


def test_info_reports_stored_formats_and_bytes(demo_int4, capsys):
    def info(*args):
        rc = main(["info", "--json", "--threads", "1", *map(str, args)])
        assert rc == 0
        return json.loads(capsys.readouterr().out)

    stored, at_load, float_ = info("-m", demo_int4), info("--quant", "int4"), info()
    assert stored["quantized_checkpoint"] and not at_load["quantized_checkpoint"]
    assert stored["quantization"] == at_load["quantization"] == {
        "attention": "int8", "experts": "int4", "shared_experts": "int8", "lm_head": "int8"}
    assert float_["quantization"] is None
    assert stored["bytes_per_token"] == at_load["bytes_per_token"] < float_["bytes_per_token"] / 2
    # routed experts: k/E of the bytes the file stores for them (read from its header)
    ck = Checkpoint(demo_int4)
    expert_bytes = sum(r.nbytes for n, r in ck.tensors.items() if ".mlp.experts." in n and not n.startswith("mtp."))
    per_token = stored["bytes_per_token_by_component"]["routed experts"]
    assert per_token == int(expert_bytes * stored["experts_per_token"] / stored["experts"])
    rc = main(["info", "-m", str(demo_int4), "--threads", "1"])
    assert rc == 0 and "stored in the checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_big_linear_quantized_in_row_chunks(monkeypatch, fmt):
    lin = torch.nn.Linear(70, 11)
    whole = formats.quantize(lin.weight.detach(), fmt)
    monkeypatch.setattr(modules, "CHUNK_ROWS", 4)  # 11 rows: chunks of 4, 4, 3
    q = modules.QuantizedLinear.from_linear(lin, fmt)
    assert torch.equal(q.qweight, whole[0]) and torch.equal(q.scales, whole[1])
    assert torch.equal(q.bias, lin.bias.detach())


def test_generate_from_the_command_line(demo_int4):
    def generate(*args):
        r = subprocess.run([sys.executable, "-m", "moerun.cli", "generate", "def add(a, b):", "--max-tokens", "12",
                            "--temperature", "0", "--threads", "1", *map(str, args)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert generate("-m", demo_int4) == generate("--quant", "int4")


def test_cli_component_flags_are_the_policy_components():
    from dataclasses import fields

    from moerun.cli import QUANT_COMPONENTS
    from moerun.quant import QuantPolicy

    assert QUANT_COMPONENTS == tuple(f.name for f in fields(QuantPolicy))


def test_quantized_net_computes_in_float32_with_an_expert_store(demo_int4):
    from moerun.experts.attach import load as load_with_store
    from moerun.experts.store import StoreOptions

    llm = load_with_store(demo_int4, threads=1, options=StoreOptions(ram_budget="50%"))
    assert llm.dtype == torch.float32 and llm.kv_dtype == torch.bfloat16
    plain = moerun.load(demo_int4, threads=1)
    ids = ids_for(plain.net.args.vocab_size)
    with torch.inference_mode():
        assert torch.equal(llm.net(ids), plain.net(ids))


def test_quantized_net_computes_in_float32():
    # dtype auto on a quantized net: float32 activations, the embedding table and the KV cache
    # kept in the checkpoint's bf16; the logits are those of a float32 load (bf16 values
    # widen exactly, so the quantized weights are the same) with a float32 KV cache
    auto = moerun.load(DEMO_MODEL, quant="int4", threads=1, kv_cache="float32")
    f32 = moerun.load(DEMO_MODEL, quant="int4", threads=1, dtype="float32")
    assert auto.dtype == torch.float32 and auto.kv_dtype == torch.float32
    assert auto.net.model.embed_tokens.weight.dtype == torch.bfloat16
    assert auto.net.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router
    assert auto.net.mtp.fc.weight.dtype == torch.float32
    assert moerun.load(DEMO_MODEL, quant="int4", threads=1).kv_dtype == torch.bfloat16
    ids = ids_for(auto.net.args.vocab_size)
    with torch.inference_mode():
        got, ref = auto.net(ids), f32.net(ids)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    # an explicit dtype is kept, and a float net is left alone
    assert moerun.load(DEMO_MODEL, quant="int4", threads=1, dtype="bfloat16").dtype == torch.bfloat16
    assert moerun.load(DEMO_MODEL, threads=1).dtype == torch.bfloat16
