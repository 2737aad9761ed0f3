import pytest
import torch
from transformers import OlmoeConfig, OlmoeForCausalLM

import moerun
from conftest import check_against_reference



@pytest.mark.parametrize(
    "overrides",
    [
        dict(norm_topk_prob=False),
        # odd sizes (hidden 36, 3 heads of 12, one kv head), clipping that bites, biases
        dict(norm_topk_prob=True, clip_qkv=1.5, attention_bias=True, hidden_size=36, num_attention_heads=3,
             num_key_value_heads=1, intermediate_size=13, num_experts=7, num_experts_per_tok=3),
    ],
)
def test_matches_transformers(tmp_path, overrides):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_experts=5, num_experts_per_tok=2,
    )
    cfg.update(overrides)
    ref = OlmoeForCausalLM(OlmoeConfig(**cfg, eos_token_id=None, pad_token_id=None,
                                       experts_implementation="eager")).eval()
    # random init leaves norms at one and biases at zero; make the q/k norms (over the whole
    # projection, one weight per channel of every head) and the biases count
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    if overrides.get("clip_qkv"):
        q = ref.model.layers[0].self_attn.q_norm(ref.model.layers[0].self_attn.q_proj(torch.randn(50, cfg["hidden_size"])))
        assert (q.abs() > overrides["clip_qkv"]).any()  # the clip is exercised
    ref.save_pretrained(tmp_path)
    llm = moerun.load(tmp_path, dtype="float32", threads=1)
    check_against_reference(ref, llm, cfg["vocab_size"])


def test_hub_config_fields():
    """OLMoE-1B-7B-0924's config.json: clip_qkv null, rope_theta at top level, no head_dim."""
    from moerun.models.olmoe import ModelArgs

    hub = {
        "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None, "rope_theta": 10000.0,
        "rope_scaling": None, "attention_bias": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
    }
    a = ModelArgs.from_dict(hub)
    assert (a.head_dim, a.clip_qkv, a.num_experts) == (128, None, 64)
    assert a.rope == {"rope_theta": 10000.0, "rope_type": "default"}
    with pytest.raises(moerun.errors.MoerunError):
        ModelArgs.from_dict({**hub, "head_dim": 64})
