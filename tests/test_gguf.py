"""GGUF files: each architecture written by `export-gguf` and read back by `-m FILE.gguf`
gives the logits of the checkpoint it came from (f32: to float rounding; q8_0/q4_0: exactly
those of moerun's own int8/int4 quantization, the same blocks), split files, the tokenizer
and chat template from the file, and the K recipes' raw formats run in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import moerun
from conftest import rel_err
from moerun.loaders.gguf import GGUFFile
from moerun.loaders.gguf_write import export

DEMO = Path(moerun.__file__).parent / "demo_model"

CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2),
    "mixtral": dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    rope_theta=1e6),
    "olmoe": dict(model_type="olmoe", vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, num_experts=6, num_experts_per_tok=2,
                  tie_word_embeddings=True),  # tied: no output.weight in the file
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", vocab_size=256, hidden_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                        moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=6,
                        num_experts_per_tok=2, mtp_num_hidden_layers=1,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    # Qwen3-Next: the checkpoint in its own fused layout (in_proj_qkvz, in_proj_ba; `fuse_qwen3_next`),
    # a dense layer, top-k weights not renormalised, an MTP layer
    "qwen3_next": dict(model_type="qwen3_next", vocab_size=256, hidden_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=32,
                       linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                       moe_intermediate_size=32, shared_expert_intermediate_size=64, intermediate_size=96,
                       num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[2],
                       layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=96,
                        moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
                        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
                        qk_nope_head_dim=32, v_head_dim=32, n_group=2, topk_group=1, first_k_dense_replace=1,
                        n_shared_experts=1, num_nextn_predict_layers=1, max_position_embeddings=256,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
}


def random_checkpoint(path: Path, cfg: dict, seed: int = 0) -> Path:
    """A float32 checkpoint of random weights under moerun's own names (which the HF loader
    reads as they are): norms around 1 (zero-centred ones around 0), the rest small."""
    from moerun.models import module_for

    module = module_for(cfg["model_type"])
    torch.manual_seed(seed)
    net = module.Model(module.ModelArgs.from_dict(cfg))
    state = {}
    for name, p in net.state_dict().items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        t = torch.randn(p.shape) * 0.08
        if name.endswith("norm.weight") and not torch.all(p == 0):
            t += 1  # a plain RMSNorm's weight (a zero-centred one stays around 0)
        state[name] = t.contiguous()
    if cfg["model_type"] == "qwen3_next":
        state = fuse_qwen3_next(state, net.args)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    return path


def fuse_qwen3_next(state: dict, args) -> dict:
    """Qwen3-Next's checkpoint layout: each DeltaNet layer's in_proj_qkv/z and in_proj_b/a
    fused into in_proj_qkvz and in_proj_ba, their rows where `fused_rows` reads them."""
    from moerun.models.qwen3_next import fused_rows

    rows = fused_rows(args)
    out = dict(state)
    for name in [n for n in state if n.endswith("linear_attn.in_proj_qkv.weight")]:
        prefix = name[: -len("in_proj_qkv.weight")]
        for fused, parts in (("in_proj_qkvz", ("in_proj_qkv", "in_proj_z")), ("in_proj_ba", ("in_proj_b", "in_proj_a"))):
            ws = [out.pop(f"{prefix}{p}.weight") for p in parts]
            w = torch.empty(sum(len(x) for x in ws), ws[0].shape[1])
            for p, x in zip(parts, ws):
                w[rows[p]] = x
            out[f"{prefix}{fused}.weight"] = w
    return out


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp(request.param), CONFIGS[request.param])


def ids_for(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(seed))


def quantized_reference(path, recipe: str):
    """moerun's own quantization of the checkpoint as the recipe says, with the embedding
    rows the GGUF file's quantized token_embd gives."""
    from moerun.loaders.gguf_write import _recipe_policy
    from moerun.quant import compute_in_float32, quantize_model
    from moerun.kernels.formats import dequantize, quantize

    llm = moerun.load(path, dtype="float32", threads=1)
    quantize_model(llm.net, _recipe_policy(recipe))
    compute_in_float32(llm.net)
    emb = llm.net.model.embed_tokens
    fmt = "int8" if recipe == "q8_0" or llm.args.tie_word_embeddings else "int4"  # tied: the head's format
    w = emb.weight.detach().float()
    emb.weight = torch.nn.Parameter(dequantize(*quantize(w, fmt), fmt, w.shape[1]), requires_grad=False)
    return llm


def test_f32_round_trip(checkpoint, tmp_path):
    out = tmp_path / "m.gguf"
    export(checkpoint, out, "f32")
    ref, ours = moerun.load(checkpoint, threads=1), moerun.load(out, threads=1)
    assert ours.dtype == torch.float32 and ours.args == ref.args
    ids = ids_for(ref.args.vocab_size)
    assert rel_err(ours.forward(ids), ref.forward(ids)) < 1e-5
    assert ours.generate_ids([ids[0, :5].tolist()], max_tokens=8, temperature=0) == \
        ref.generate_ids([ids[0, :5].tolist()], max_tokens=8, temperature=0)
    if hasattr(ref.net, "has_mtp") or getattr(ref.net, "mtp", None) is not None:
        assert bool(getattr(ours.net, "mtp", None)) == bool(getattr(ref.net, "mtp", None))


def test_qwen3next_file_holds_the_converters_tensors(tmp_path):
    """A qwen3_next export holds what llama.cpp's converter writes, worked out here from the
    checkpoint's fused tensors without moerun's tables: attn_qkv (all q, all k, all v) and
    attn_gate (z) from in_proj_qkvz split per key head, ssm_ba as in_proj_ba, -exp(A_log),
    zero-centred norms + 1 (not ssm_norm), the conv squeezed, the MTP layer as nextn block 4."""
    from safetensors.torch import load_file

    cfg = CONFIGS["qwen3_next"]
    ck = random_checkpoint(tmp_path / "ck", cfg)
    out = tmp_path / "m.gguf"
    export(ck, out, "f32")
    hf, f = load_file(ck / "model.safetensors"), GGUFFile(out)

    def g(name):
        return f.floats(f.tensors[name]).float()

    nk, dk, dv, r = 2, 32, 32, 2
    q, k, v, z = hf["model.layers.0.linear_attn.in_proj_qkvz.weight"].view(nk, 2 * dk + 2 * r * dv, -1).split(
        [dk, dk, r * dv, r * dv], dim=1)
    assert torch.equal(g("blk.0.attn_qkv.weight"), torch.cat([x.reshape(-1, 64) for x in (q, k, v)]))
    assert torch.equal(g("blk.0.attn_gate.weight"), z.reshape(-1, 64))
    assert torch.equal(g("blk.2.ssm_ba.weight"), hf["model.layers.2.linear_attn.in_proj_ba.weight"])
    assert torch.equal(g("blk.0.ssm_a"), -torch.exp(hf["model.layers.0.linear_attn.A_log"]))
    assert torch.equal(g("blk.0.ssm_conv1d.weight"), hf["model.layers.0.linear_attn.conv1d.weight"].squeeze(1))
    assert torch.equal(g("blk.0.ssm_norm.weight"), hf["model.layers.0.linear_attn.norm.weight"])
    assert torch.equal(g("blk.1.attn_q_norm.weight"), hf["model.layers.1.self_attn.q_norm.weight"] + 1)
    assert torch.equal(g("output_norm.weight"), hf["model.norm.weight"] + 1)
    assert torch.equal(g("blk.4.nextn.enorm.weight"), hf["mtp.pre_fc_norm_embedding.weight"] + 1)
    assert torch.equal(g("blk.4.nextn.hnorm.weight"), hf["mtp.pre_fc_norm_hidden.weight"] + 1)
    assert torch.equal(g("blk.2.ffn_down.weight"), hf["model.layers.2.mlp.down_proj.weight"])  # the dense layer
    assert "blk.2.ffn_gate_inp.weight" not in f.tensors and "blk.0.ssm_in.weight" not in f.tensors
    assert f.get("general.architecture", "str") == "qwen3next"
    assert f.get("qwen3next.block_count", "int") == 5 and f.get("qwen3next.nextn_predict_layers", "int") == 1
    assert f.get("qwen3next.rope.dimension_count", "int") == 8 and f.get("qwen3next.ssm.group_count", "int") == nk
    assert f.get("qwen3next.expert_weights_norm", "bool") is False


@pytest.mark.parametrize("recipe", ["f32", "q8_0"])
def test_qwen3next_fused_ssm_in_is_read(tmp_path, monkeypatch, recipe):
    """The older qwen3next form, the checkpoint's in_proj_qkvz kept whole as `ssm_in` (written
    here by the writer with a table that says so): read as the split form's model."""
    from dataclasses import replace

    from moerun.loaders import gguf as g
    from moerun.models.qwen3_next import fused_rows

    ck = random_checkpoint(tmp_path / "ck", CONFIGS["qwen3_next"])
    arch = g.ARCHS["qwen3next"]
    fused = {**arch.layer, "linear_attn.in_proj_qkv.weight": "ssm_in.weight", "linear_attn.in_proj_z.weight": "ssm_in.weight"}

    def part(p):
        return lambda a: g.Transform(gather=fused_rows(a)[p])
    old = replace(arch, layer=fused, transforms={**arch.transforms, "linear_attn.in_proj_qkv.weight": part("in_proj_qkv"),
                                                 "linear_attn.in_proj_z.weight": part("in_proj_z")})
    with monkeypatch.context() as m:
        m.setitem(g.ARCHS, "qwen3next", old)
        export(ck, tmp_path / "old.gguf", recipe)
    export(ck, tmp_path / "new.gguf", recipe)
    names = set(GGUFFile(tmp_path / "old.gguf").tensors)
    assert "blk.0.ssm_in.weight" in names and "blk.0.attn_qkv.weight" not in names
    ids = ids_for(256)
    assert torch.equal(moerun.load(tmp_path / "old.gguf", threads=1).forward(ids),
                       moerun.load(tmp_path / "new.gguf", threads=1).forward(ids))


@pytest.mark.parametrize("recipe", ["q8_0", "q4_0"])
def test_quantized_round_trip_is_moerun_quantization(checkpoint, tmp_path, recipe):
    out = tmp_path / "m.gguf"
    export(checkpoint, out, recipe)
    types = {t.type for t in GGUFFile(out).tensors.values()}
    assert {"Q8_0" if recipe == "q8_0" else "Q4_0"} <= types
    ours, ref = moerun.load(out, threads=1), quantized_reference(checkpoint, recipe)
    ids = ids_for(ref.args.vocab_size)
    assert torch.equal(ours.forward(ids), ref.forward(ids))


@pytest.mark.parametrize("recipe, tol", [("q8_0", 0.1), ("q4_0", 0.2)])
def test_quantized_demo_model_stays_close_to_float(tmp_path, recipe, tol):
    """(On the trained demo model: a random tiny model's routes flip under quantization.)"""
    out = tmp_path / "demo.gguf"
    export(DEMO, out, recipe)
    ids = ids_for(4096)
    assert rel_err(moerun.load(out, threads=1).forward(ids), moerun.load(None, dtype="float32", threads=1).forward(ids)) < tol


def test_bf16_demo_model_is_exact_and_tokenizes_the_same(tmp_path):
    out = tmp_path / "demo.gguf"
    export(DEMO, out, "bf16")
    ref, ours = moerun.load(None, threads=1), moerun.load(out, threads=1)
    assert ours.dtype == torch.bfloat16 and ours.net.has_mtp
    ids = ids_for(4096)
    assert torch.equal(ours.forward(ids), ref.forward(ids))
    text = ("Grüße aus Köln! Ça va? Привет, мир. 你好，世界。こんにちは 🎉👍🏽\n"
            "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n  # base\n    return fib(n-1)+fib(n - 2)\n"
            "for (int i = 0; i < 10; ++i) { x[i] = i*i; }  // C\n$ ls -la | grep '^d' && echo \"ok\"\n"
            "<|im_start|>user\n1234567 + 0.5e-3 = ?<|im_end|>   trailing   ")
    assert ours.tokenizer.encode(text) == ref.tokenizer.encode(text)
    assert ours.tokenizer.decode(ours.tokenizer.encode(text), skip_special_tokens=False) == text
    msgs = [{"role": "user", "content": "hi <|im_end|> there"}]
    assert ours.tokenizer.chat_template == ref.tokenizer.chat_template
    assert ours.encode_prompt(msgs) == ref.encode_prompt(msgs)
    assert ours.eos_ids() == ref.eos_ids()
    assert ours.sampling_params() == ref.sampling_params()
    assert list(ours.generate("def add(a, b):", max_tokens=12, temperature=0)) == \
        list(ref.generate("def add(a, b):", max_tokens=12, temperature=0))


def test_quantized_checkpoint_is_written_bit_exact(tmp_path):
    """A `moerun quantize` checkpoint's int8/int4 blocks become Q8_0/Q4_0 as they are."""
    from moerun.loaders.quantized_write import quantize_checkpoint

    q = tmp_path / "q"
    quantize_checkpoint(DEMO, q, "int4")
    out = tmp_path / "q.gguf"
    s = export(q, out)
    assert s["types"]["Q4_0"] > 0 and s["types"]["Q8_0"] > 0
    ref, ours = moerun.load(q, threads=1), moerun.load(out, threads=1)
    ids = ids_for(4096)
    assert torch.equal(ours.forward(ids), ref.forward(ids))
    ref_state, our_state = ref.net.state_dict(), ours.net.state_dict()
    for name, t in ref_state.items():
        if name.endswith(("qweight", "_q", "scales")):
            assert torch.equal(our_state[name], t), name


def test_split_files(tmp_path):
    export(DEMO, tmp_path / "demo.gguf", "q8_0", split_bytes=4 << 20)
    parts = sorted(tmp_path.glob("demo-*-of-*.gguf"))
    assert len(parts) == 3 and not (tmp_path / "demo.gguf").exists()
    one = tmp_path / "one" / "demo.gguf"
    export(DEMO, one, "q8_0")
    ids = ids_for(4096)
    assert torch.equal(moerun.load(parts[0], threads=1).forward(ids), moerun.load(one, threads=1).forward(ids))


def test_quantized_token_embeddings_read_only_the_looked_up_rows(tmp_path):
    from moerun.loaders.gguf import GgmlEmbedding

    out = tmp_path / "demo.gguf"
    export(DEMO, out, "q8_0")
    llm = moerun.load(out, threads=1)
    emb = llm.net.model.embed_tokens
    assert isinstance(emb, GgmlEmbedding) and emb.qweight.dtype == torch.uint8
    assert emb.qweight.shape == (4096, 128 // 32 * 34)  # the file's bytes, not a float table


def test_cli_export_and_generate(tmp_path):
    from moerun.cli import main

    out = tmp_path / "demo.gguf"
    assert main(["export-gguf", "-m", str(DEMO), "-o", str(out), "--type", "q4_0", "--threads", "1"]) == 0
    assert main(["generate", "-m", str(out), "def add", "--max-tokens", "4", "--threads", "1"]) == 0
    assert main(["export-gguf", "-m", str(DEMO), "-o", str(out), "--threads", "1"]) == 1  # exists, no --force


def test_cli_export_split(tmp_path, capsys):
    from moerun.cli import main

    out = tmp_path / "demo.gguf"
    for bad in ("30%", "0", "lots"):
        assert main(["export-gguf", "-m", str(DEMO), "-o", str(out), "--split-max-size", bad]) == 1
        assert "--split-max-size" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert main(["export-gguf", "-m", str(DEMO), "-o", str(out), "--type", "q8_0", "--split-max-size", "4MiB",
                 "--threads", "1"]) == 0
    parts = sorted(tmp_path.glob("demo-*-of-*.gguf"))
    assert len(parts) == 3 and "in 3 files" in capsys.readouterr().err
    assert main(["generate", "-m", str(parts[0]), "def add", "--max-tokens", "4", "--threads", "1"]) == 0


# rows of 256 (a multiple of the K-quants' super-block), so the K recipes give K types
K_CONFIG = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=256,
                moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, num_experts=2, num_experts_per_tok=2, norm_topk_prob=True)  # no routes to flip


@pytest.mark.parametrize("recipe", ["q4_k_m", "q5_k_m", "q6_k"])
def test_k_recipes_run_the_file_blocks_in_place(tmp_path, recipe):
    """A K recipe's file: each tensor has the type llama-quantize's rule gives it; loaded, every
    raw-format module's qweight holds the file's bytes (scales empty), and the native kernels
    give the torch reference's outputs over them."""
    from moerun import kernels
    from moerun.quant.gguf_types import tensor_type

    ck = random_checkpoint(tmp_path / "ck", K_CONFIG)
    out = tmp_path / "k.gguf"
    export(ck, out, recipe)
    f = GGUFFile(out)
    for t in f.tensors.values():
        if len(t.shape) >= 2 and "ffn_gate_inp" not in t.name:
            assert t.type == tensor_type(recipe, t.name, t.shape, 2).upper(), t.name
    expect = {"q4_k_m": {"Q4_K", "Q6_K"}, "q5_k_m": {"Q5_K", "Q6_K"}, "q6_k": {"Q6_K"}}[recipe]
    assert expect <= {t.type for t in f.tensors.values()}
    llm = moerun.load(out, threads=1)
    raw = {n: m for n, m in llm.net.named_modules() if getattr(m, "fmt", None) in ("q4_k", "q5_k", "q6_k")}
    assert raw
    lin = next(m for m in raw.values() if hasattr(m, "qweight"))
    assert lin.scales.shape[-1] == 0
    assert any(torch.equal(lin.qweight.reshape(-1), f.raw(t).reshape(-1)) for t in f.tensors.values()
               if t.nbytes == lin.qweight.numel())
    x = torch.randn(3, K_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(0))
    compared = 0
    for name, m in raw.items():  # the file's blocks through the native kernels and the torch reference
        if hasattr(m, "qweight") and m.in_features == x.shape[1]:
            native = m(x)
            with kernels.use_isa("torch"):
                assert rel_err(native, m(x)) < 1e-5, name
            compared += 1
    assert compared >= 3  # q, k, v of a layer at least


def test_k_recipes_err_from_float_as_their_bits_say(tmp_path):
    """Against the float model, each file errs by what its blocks' precision says (a tensor
    read with a wrong layout or name would err by ~1): Q8_0 < Q6_K < Q5_K_M < Q4_K_M < Q4_0.
    (This random model magnifies weight error: Q4_0 gives ~0.45.)"""
    ck = random_checkpoint(tmp_path / "ck", K_CONFIG)
    ids = ids_for(512)
    ref = moerun.load(ck, dtype="float32", threads=1).forward(ids)
    err = {}
    for recipe in ("q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0"):
        export(ck, tmp_path / f"{recipe}.gguf", recipe)
        err[recipe] = rel_err(moerun.load(tmp_path / f"{recipe}.gguf", threads=1).forward(ids), ref)
    assert err["q8_0"] < err["q6_k"] < err["q5_k_m"] < err["q4_k_m"] < err["q4_0"] < 0.6, err


def test_demo_model_q4_k_m_falls_back_where_rows_are_not_whole_super_blocks(tmp_path):
    """The demo model's rows are 128 and 64 wide: Q4_K_M gives them llama.cpp's fallbacks
    (Q5_0, Q8_0), which moerun runs too (its MTP eh_proj, 256 wide, is Q4_K)."""
    out = tmp_path / "demo.gguf"
    export(DEMO, out, "q4_k_m")
    f = GGUFFile(out)
    assert f.tensors["blk.0.ffn_gate_exps.weight"].type == "Q5_0" and f.tensors["output.weight"].type == "Q8_0"
    ids = ids_for(4096)
    assert rel_err(moerun.load(out, threads=1).forward(ids), moerun.load(None, dtype="float32", threads=1).forward(ids)) < 0.2


@pytest.mark.parametrize("recipe", ["f32", "q8_0"])
def test_tiled_value_heads_kept_with_expanded_key_heads(tmp_path, monkeypatch, recipe):
    """The form a K-quant ssm_out needs (Qwen3.6 Q4_K_M): the file's tiled value-head order
    kept, each value head given its own copy of its key head. Same logits as the permuted form."""
    import moerun.loaders.gguf as g

    out = tmp_path / "demo.gguf"
    export(DEMO, out, recipe)
    ids = ids_for(4096)
    plain = moerun.load(out, threads=1)
    monkeypatch.setattr(g, "EXPAND_KEY_HEADS", "always")
    expanded = moerun.load(out, threads=1)
    assert expanded.args.linear_num_key_heads == expanded.args.linear_num_value_heads == 4
    assert plain.args.linear_num_key_heads == 2
    assert rel_err(expanded.forward(ids), plain.forward(ids)) < 1e-5
    p = ids[0, :6].tolist()
    assert expanded.generate_ids([p], max_tokens=10, temperature=0) == plain.generate_ids([p], max_tokens=10, temperature=0)


@pytest.mark.parametrize("recipe", ["q4_k_m", "f32"])
def test_expert_store_reads_experts_from_the_gguf_file(tmp_path, recipe):
    """`--ram-budget` on a GGUF file: the store reads each expert's byte ranges from the file
    (raw K-quant rows, or float), and the logits and greedy tokens are those of the file
    loaded whole; a smaller budget misses and reads from disk."""
    from moerun.experts.attach import load as load_with_store
    from moerun.experts.store import StoreOptions

    ck = random_checkpoint(tmp_path / "ck", dict(K_CONFIG, num_experts=8, num_experts_per_tok=2))
    out = tmp_path / "k.gguf"
    export(ck, out, recipe)
    whole = moerun.load(out, threads=1)
    ids = ids_for(512)
    want = whole.forward(ids)
    for budget in ("100%", "30%"):
        llm = load_with_store(out, threads=1, options=StoreOptions(ram_budget=budget))
        assert llm.store.fmt == (None if recipe == "f32" else "q4_k")
        assert torch.equal(llm.forward(ids), want)
        p = ids[0, :5].tolist()
        assert llm.generate_ids([p], max_tokens=6, temperature=0) == whole.generate_ids([p], max_tokens=6, temperature=0)
        st = llm.store.stats()
        if budget == "30%":  # (100%: the experts were read at start, before the counts)
            assert st["demand_misses"] > 0 and st["tiers"]["disk"]["bytes_read"] > 0
        llm.store.close()


def test_info_shows_the_files_architecture_and_tensor_types(tmp_path, capsys):
    import gguf

    from moerun.cli import main

    out = tmp_path / "demo.gguf"
    export(DEMO, out, "q8_0")
    assert main(["info", "-m", str(out), "--json", "--threads", "1"]) == 0
    got = json.loads(capsys.readouterr().out)["gguf"]
    want: dict[str, int] = {}
    for t in gguf.GGUFReader(str(out)).tensors:  # the gguf package's own reading of the file
        want[t.tensor_type.name] = want.get(t.tensor_type.name, 0) + int(t.n_bytes)
    assert got["architecture"] == "qwen35moe" and got["tensor_bytes"] == want and "Q8_0" in want
    assert main(["info", "-m", str(out), "--threads", "1"]) == 0
    assert "qwen35moe" in next(line for line in capsys.readouterr().out.splitlines() if line.startswith("GGUF"))
