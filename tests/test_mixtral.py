import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

import moerun
from conftest import check_against_reference



@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        # odd sizes, head_dim not hidden/heads, one kv head, tied embeddings
        dict(hidden_size=36, head_dim=10, num_key_value_heads=1, intermediate_size=13,
             num_local_experts=7, num_experts_per_tok=3, tie_word_embeddings=True),
        # a window shorter than the prompt: prefill, cached decode and batches all cross it
        dict(sliding_window=5, num_experts_per_tok=1),
    ],
)
def test_matches_transformers(tmp_path, overrides):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2,
    )
    cfg.update(overrides)
    ref = MixtralForCausalLM(MixtralConfig(**cfg, eos_token_id=None, experts_implementation="eager")).eval()
    ref.save_pretrained(tmp_path)
    llm = moerun.load(tmp_path, dtype="float32", threads=1)
    check_against_reference(ref, llm, cfg["vocab_size"])


def test_hub_config_fields():
    """Mixtral-8x7B's config.json: num_local_experts, rope_theta at top level, sliding_window null."""
    from moerun.models.mixtral import ModelArgs

    hub = {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "sliding_window": None,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "router_aux_loss_coef": 0.02,
    }
    a = ModelArgs.from_dict(hub)
    assert (a.num_local_experts, a.head_dim, a.sliding_window) == (8, 128, None)
    assert a.rope["rope_theta"] == 1e6
    # no theta anywhere: MixtralConfig's default, not the generic 10000
    no_theta = {k: v for k, v in hub.items() if k != "rope_theta"}
    assert ModelArgs.from_dict(no_theta).rope["rope_theta"] == 1e6
    with pytest.raises(moerun.errors.MoerunError):
        ModelArgs.from_dict({**hub, "num_experts_per_tok": 9})


def test_fused_expert_checkpoint(tmp_path):
    """Checkpoints in transformers 5's in-memory naming (mlp.experts.gate_up_proj [E, 2I, H],
    no block_sparse_moe) load too."""
    import json

    from safetensors.torch import save_file

    from conftest import rel_err

    torch.manual_seed(1)
    cfg = MixtralConfig(vocab_size=61, hidden_size=24, intermediate_size=20, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        experts_implementation="eager")
    ref = MixtralForCausalLM(cfg).eval()
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    llm = moerun.load(tmp_path, dtype="float32", threads=1)
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        assert rel_err(llm.forward(ids), ref(ids).logits) < 1e-4
