import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from conftest import check_against_reference, save_and_load


@pytest.mark.parametrize(
    "overrides",
    [
        dict(norm_topk_prob=True),
        dict(norm_topk_prob=False, mlp_only_layers=[1]),
        dict(norm_topk_prob=True, decoder_sparse_step=2, hidden_size=36, head_dim=12, moe_intermediate_size=13),
    ],
)
def test_matches_transformers(tmp_path, overrides):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=7, num_experts_per_tok=3,
    )
    cfg.update(overrides)
    ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg, experts_implementation="eager")).eval()
    llm = save_and_load(ref, tmp_path)
    check_against_reference(ref, llm, cfg["vocab_size"])
