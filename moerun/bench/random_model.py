"""Random checkpoints with the layer shapes of real MoE models, for benchmarks and tests.

Weights are random (N(0, 0.02); norms 1), so outputs are meaningless and routing is close
to uniform: these checkpoints measure speed and memory, never quality. Tensors are written
with Hugging Face names, experts one tensor per expert, in shards of at most 2 GiB.

`write_random_gguf` writes one GGUF file instead (`moerun random-model ... --quant q8_0 -o
FILE.gguf`): quantized blocks made directly and streamed, so a model bigger than RAM can be
written (`loaders.gguf_write.write_random`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import MoerunError

PRESETS: dict[str, dict] = {
    # Qwen3-30B-A3B (config.json of the public checkpoint)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
    ),
    # Qwen3.6-35B-A3B text model: 3 Gated DeltaNet layers then 1 gated full-attention layer
    "qwen3.6-35b-a3b": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts=256, num_experts_per_tok=8, rms_norm_eps=1e-6, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        tie_word_embeddings=False, full_attention_interval=4, mtp_num_hidden_layers=1,
    ),
    # Qwen1.5-MoE-A2.7B (Qwen2-MoE: q/k/v biases, a shared expert with a sigmoid gate)
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
        norm_topk_prob=False, decoder_sparse_step=1, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=8192, use_sliding_window=False, tie_word_embeddings=False,
    ),
    # OLMoE-1B-7B-0924 (q/k norms across all heads)
    "olmoe-1b-7b": dict(
        model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    # Mixtral-8x7B-v0.1 (its config has no sliding window; Mistral's 4096 with sliding_window=4096)
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False,
    ),
    # DeepSeek-V3 (MLA, grouped sigmoid routing, 3 dense layers first). Its MTP module is left
    # out (num_nextn_predict_layers 0): the real checkpoint has one, a whole MoE layer more.
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
        rms_norm_eps=1e-6, max_position_embeddings=163840, num_nextn_predict_layers=0,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        rope_theta=10000, tie_word_embeddings=False, attention_bias=False,
    ),
}

SHARD_BYTES = 2 << 30
POOL = 1 << 24


def preset_config(name: str, layers: int | None = None, **overrides) -> dict:
    if name not in PRESETS:
        raise MoerunError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    cfg = dict(PRESETS[name])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    cfg.update(overrides)
    if cfg["model_type"].startswith("qwen3_5_moe"):
        n, every = cfg["num_hidden_layers"], cfg.pop("full_attention_interval", 4)
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
        ]
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def write_random_model(out: Path, cfg: dict, dtype=torch.bfloat16, seed: int = 0) -> Path:
    """Write config.json and random safetensors for `cfg` into `out`."""
    from safetensors.torch import save_file

    from ..models import build_on_meta, module_for

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    module = module_for(cfg["model_type"])
    args = module.ModelArgs.from_dict(cfg)
    net = build_on_meta(module, args)
    tied = set(getattr(net, "tied_parameters", {})) if cfg.get("tie_word_embeddings") else set()
    shapes = [(n, tuple(p.shape)) for n, p in net.state_dict().items() if n not in tied]
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL, generator=g) * 0.02).to(dtype)

    def tensors():
        for name, shape in shapes:
            prefix, _, proj = name.rpartition(".")
            if prefix.endswith(".experts") and len(shape) == 3:
                for e in range(shape[0]):
                    yield f"{prefix}.{e}.{proj}.weight", _random(shape[1:], pool, g)
            else:
                yield name, _random(shape, pool, g)

    total = sum(torch.Size(s).numel() for _, s in shapes) * dtype.itemsize
    shard: dict[str, torch.Tensor] = {}
    size, files, weight_map = 0, [], {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing random weights") as bar:
        for name, t in tensors():
            if shard and size + t.nbytes > SHARD_BYTES:
                files.append(_flush(out, shard, len(files), weight_map, save_file))
                shard, size = {}, 0
            shard[name] = t
            size += t.nbytes
            bar.update(t.nbytes)
        files.append(_flush(out, shard, len(files), weight_map, save_file))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (out / "config.json").write_text(json.dumps({**cfg, "random_weights": True}, indent=2))
    return out


def _flush(out, shard, i, weight_map, save_file) -> str:
    name = f"model-{i:05d}.safetensors"
    save_file(shard, str(out / name), metadata={"format": "pt"})
    weight_map.update({k: name for k in shard})
    return name


def _random(shape, pool: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """N(0, 0.02) values cut from a shared random pool at random offsets: drawing billions of
    fresh normals takes minutes, and for speed and memory figures any spread will do."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=pool.dtype)  # norms, biases and per-head scalars
    n = torch.Size(shape).numel()
    out = torch.empty(n, dtype=pool.dtype)
    filled = 0
    while filled < n:
        start = int(torch.randint(0, POOL // 2, (1,), generator=g))
        take = min(n - filled, POOL - start)
        out[filled : filled + take] = pool[start : start + take]
        filled += take
    return out.view(shape)


def write_random_gguf(out: Path, cfg: dict, quant: str = "q8_0", seed: int = 0, force: bool = False,
                      progress: bool = True) -> dict:
    """A random-weight GGUF file for `cfg` (llama.cpp and moerun read it), its quantized
    tensors random `quant` blocks written as they are made; returns the writer's summary."""
    from ..loaders.gguf_write import write_random

    return write_random(out, cfg, quant, seed=seed, force=force, progress=progress)
