import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

import moerun
from conftest import check_against_reference



@pytest.mark.parametrize(
    "overrides",
    [
        dict(norm_topk_prob=False),
        # odd sizes (hidden 36, 3 heads of 12), a dense layer in the middle, no qkv bias
        dict(norm_topk_prob=True, mlp_only_layers=[1], hidden_size=36, num_attention_heads=3, moe_intermediate_size=13,
             shared_expert_intermediate_size=11, qkv_bias=False, num_key_value_heads=1),
        # dense layers by decoder_sparse_step, sliding window on layers 0 and 2
        dict(norm_topk_prob=True, decoder_sparse_step=2, use_sliding_window=True, sliding_window=6,
             max_window_layers=3, num_experts_per_tok=1),
    ],
)
def test_matches_transformers(tmp_path, overrides):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=97, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=7, num_experts_per_tok=3,
    )
    cfg.update(overrides)
    ref = Qwen2MoeForCausalLM(Qwen2MoeConfig(**cfg, experts_implementation="eager")).eval()
    # random init leaves biases at zero; make the q/k/v bias count
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0, 0.5)
    ref.save_pretrained(tmp_path)
    llm = moerun.load(tmp_path, dtype="float32", threads=1)
    if overrides.get("use_sliding_window"):
        assert [layer.self_attn.window for layer in llm.net.model.layers] == [6, None, 6]
    check_against_reference(ref, llm, cfg["vocab_size"])


def test_hub_config_fields():
    """Qwen1.5-MoE-A2.7B's config.json: no qkv_bias key (bias on), rope_theta at top level,
    use_sliding_window false with a stale sliding_window."""
    from moerun.models.qwen2_moe import ModelArgs

    hub = {
        "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "rope_theta": 1e6, "use_sliding_window": False,
        "sliding_window": 32768, "max_window_layers": 21, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    }
    a = ModelArgs.from_dict(hub)
    assert a.qkv_bias and a.head_dim == 128 and a.mlp_only_layers == ()
    assert a.rope["rope_theta"] == 1e6 and a.window(0) is None
    assert all(a.is_sparse(i) for i in range(24))
    with pytest.raises(moerun.errors.MoerunError):
        ModelArgs.from_dict({k: v for k, v in hub.items() if k != "shared_expert_intermediate_size"})
