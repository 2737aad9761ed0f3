"""Shared helpers: compare a moerun model with the transformers reference it mirrors."""

from __future__ import annotations

import pytest
import torch

import moerun


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread. A second OpenMP thread on a busy 2-core machine stalls for
    milliseconds per op, which turns seconds of tests into minutes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_and_load(hf_model, path, dtype="float32"):
    """Save a transformers model to `path` and load it back with moerun."""
    hf_model.save_pretrained(path)
    return moerun.load(path, dtype=dtype, threads=1)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max absolute difference relative to the reference's largest magnitude."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )
    return out[0, len(prompt):].tolist()


def check_against_reference(hf_model, llm, vocab: int, seed: int = 0, seq: int = 23, greedy: int = 32):
    """fp32 logits within 1e-4 relative, 32 greedy tokens identical, cached == full, batch == single
    (in float32 and in bf16)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    assert rel_err(llm.forward(ids), hf_logits(hf_model, ids)) < 1e-4

    prompt = ids[0, :7].tolist()
    ours = llm.generate_ids([prompt], max_tokens=greedy, temperature=0.0)[0]
    assert ours == hf_greedy(hf_model, prompt, greedy)

    check_cache_consistency(llm, ids)
    prompts = [ids[0, :5].tolist(), ids[1, :11].tolist(), ids[0, 3:6].tolist()]
    check_batch_equals_rows(llm, prompts)
    check_batch_equals_rows(moerun.load(llm.path, dtype="bfloat16", threads=1), prompts, tokens=12)


def check_batch_equals_rows(llm, prompts: list[list[int]], tokens: int = 6):
    """A batch of rows of different lengths gives each row the greedy tokens it gets alone."""
    batched = llm.generate_ids(prompts, max_tokens=tokens, temperature=0.0)
    singles = [llm.generate_ids([p], max_tokens=tokens, temperature=0.0)[0] for p in prompts]
    assert batched == singles


def check_cache_consistency(llm, ids: torch.Tensor):
    """Prefill + token-by-token cached decode gives the logits of one full uncached pass."""
    from moerun.layers.cache import Cache

    net = llm.net
    full = llm.forward(ids)
    B, T = ids.shape
    cache = Cache(net.cache_spec(), B, T, llm.dtype)
    split = T // 2
    with torch.inference_mode():
        steps = [net(ids[:, :split], cache)]
        for t in range(split, T):
            steps.append(net(ids[:, t : t + 1], cache))
    cached = torch.cat(steps, dim=1).float()
    assert rel_err(cached, full) < 1e-4


def make_tokenizer(path, vocab_size: int = 300) -> None:
    """A small byte-level BPE tokenizer with a ChatML template, written into `path`."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. ", "héllo wörld ✓ 日本"] * 50
    tok.train_from_iterator(text, trainer)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": template})
    )


def make_tiny_model(path, max_position_embeddings: int = 64, seed: int = 0):
    """A tiny random qwen3_moe model with a real tokenizer; returns the transformers model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=max_position_embeddings,
        experts_implementation="eager",
    )
    ref = Qwen3MoeForCausalLM(cfg).eval()
    ref.save_pretrained(path)
    make_tokenizer(path)
    return ref


def cli(capsys, *args):
    """`moerun ARGS` in process, on one thread: (exit code, stderr lines)."""
    from moerun.cli import main

    try:
        rc = main([*map(str, args), "--threads", "1"])
    except SystemExit as e:  # argparse errors
        rc = e.code
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def assert_one_line_error(result, *needles):
    """`cli`'s result is a failure said in one line holding every needle, no traceback."""
    rc, lines = result
    assert rc != 0 and len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
