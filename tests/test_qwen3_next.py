"""qwen3_next against transformers: the fused DeltaNet projections split at load, dense layers,
norm_topk_prob, and the native decode path of the Qwen3.5 layers it runs on."""

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from conftest import check_against_reference, hf_greedy, save_and_load
from moerun.errors import MoerunError

TINY = dict(
    vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16, intermediate_size=20,
    shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
)


def make_reference(**overrides) -> Qwen3NextForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**{**TINY, **overrides}, experts_implementation="eager")
    ref = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers starts every norm at its identity; move them off it
        for name, p in ref.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    return ref


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # three DeltaNet layers then one full-attention layer; two value heads per key head
        dict(  # three value heads per key head, no renormalised top-k, a tied head, another rotary fraction
            num_hidden_layers=5, layer_types=["full_attention", "linear_attention", "linear_attention",
                                              "full_attention", "linear_attention"],
            linear_num_key_heads=1, linear_num_value_heads=3, linear_conv_kernel_dim=3, norm_topk_prob=False,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.5),
        ),
    ],
)
def test_matches_transformers(tmp_path, overrides):
    ref = make_reference(**overrides)
    llm = save_and_load(ref, tmp_path)
    assert llm.net.args.layer_types == tuple(ref.config.layer_types)
    assert not llm.net.has_mtp  # the config assumes one MTP layer; the checkpoint has none
    # 140 tokens: the uncached pass and the cache check cross three 64-token DeltaNet chunks
    check_against_reference(ref, llm, ref.config.vocab_size, seq=140)
    prompt = torch.randint(0, ref.config.vocab_size, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    assert llm.generate_ids([prompt], max_tokens=32, temperature=0.0)[0] == hf_greedy(ref, prompt, 32)
    # decode steps after the first are one native call over the layer stack
    path = llm.probe_decode_path()
    assert path["native_stack_passes"] >= 2 and path["module_passes"] <= 1 and path["why"] is None, path


def test_dense_layers_match_transformers(tmp_path):
    """mlp_only_layers / decoder_sparse_step: dense SwiGLU layers of intermediate_size, whose
    MLP half is one native call on the layer stack too (`mlp_block`)."""
    ref = make_reference(mlp_only_layers=[0], decoder_sparse_step=2)
    llm = save_and_load(ref, tmp_path)
    sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in llm.net.model.layers]
    assert sparse == [False, True, False, True]  # layer 0 listed; layers 1 and 3 by the step
    check_against_reference(ref, llm, ref.config.vocab_size, seq=40)
    path = llm.probe_decode_path()
    assert path["native_stack_passes"] > 0 and path["why"] is None, path


def test_fused_projection_of_the_wrong_size_is_one_error(tmp_path):
    import moerun
    from safetensors.torch import load_file, save_file

    make_reference().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.linear_attn.in_proj_qkvz.weight"
    tensors[name] = tensors[name][:-4].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(MoerunError, match=r"'model.layers.1.linear_attn.in_proj_qkvz.weight' has shape \[124, 32\]"):
        moerun.load(tmp_path, dtype="float32")


def test_mtp_head_loads_and_drafts(tmp_path):
    """The released checkpoints' `mtp.*` layer (no mtp_num_hidden_layers in config.json): loaded,
    and MTP speculative decoding gives plain greedy decoding's tokens."""
    import moerun
    from safetensors.torch import load_file
    from test_gguf import CONFIGS, random_checkpoint

    cfg = {k: v for k, v in CONFIGS["qwen3_next"].items() if k != "mtp_num_hidden_layers"}
    ck = random_checkpoint(tmp_path / "ck", cfg)
    assert "mtp.fc.weight" in load_file(ck / "model.safetensors")
    llm = moerun.load(ck, dtype="float32", threads=1)
    assert llm.net.has_mtp
    assert torch.equal(llm.net.mtp.fc.weight, load_file(ck / "model.safetensors")["mtp.fc.weight"])
    prompt = [5, 17, 99, 3, 42, 8]
    plain = llm.generate_ids([prompt], max_tokens=12, temperature=0.0)
    assert llm.generate_ids([prompt], speculative="mtp", max_tokens=12, temperature=0.0) == plain
