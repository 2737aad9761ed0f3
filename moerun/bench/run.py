"""`moerun bench`: prefill and decode tokens/s on random token ids."""

from __future__ import annotations

import time

import torch

from ..engine.cache import Cache, kv_cache_summary
from ..engine.generate import run_plans
from ..errors import MoerunError


def bench(llm, prompt_tokens: int = 128, gen_tokens: int = 32, seed: int = 0, speculative: str | None = None,
          draft_tokens: int | str = 1, draft_vocab: int | None = None) -> dict:
    if speculative:
        return bench_speculative(llm, prompt_tokens, gen_tokens, seed, speculative, draft_tokens, draft_vocab)
    if prompt_tokens < 1 or gen_tokens < 1:
        raise MoerunError("--prompt-tokens and --gen-tokens must be at least 1")
    if prompt_tokens + gen_tokens > llm.context_length:
        raise MoerunError(f"{prompt_tokens}+{gen_tokens} tokens exceed the context window of {llm.context_length}")
    net = llm.net
    vocab = net.args.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (1, prompt_tokens), generator=g)
    with torch.inference_mode():
        # warm-up: first calls allocate and pick kernels
        warm_ids = torch.randint(0, vocab, (1, 5), generator=g)  # any prompt length, even 1
        warm = Cache(net.cache_spec(), 1, 8, llm.dtype, llm.kv_dtype)
        net(warm_ids[:, :4], warm, last_only=True)
        net(warm_ids[:, 4:], warm, last_only=True)

        cache = Cache(net.cache_spec(), 1, prompt_tokens + gen_tokens, llm.dtype, llm.kv_dtype)
        plans = run_plans(net)  # as a generation run makes them
        t0 = time.perf_counter()
        logits = net(prompt, cache, last_only=True, **plans)
        prefill_s = time.perf_counter() - t0
        tok = logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(gen_tokens):
            tok = net(tok, cache, last_only=True, **plans)[:, -1].argmax(-1, keepdim=True)
        decode_s = time.perf_counter() - t0
    return {
        "model": str(llm.path),
        "architecture": llm.model_type,
        "dtype": str(llm.dtype).removeprefix("torch."),
        **kv_cache_summary(net.cache_spec(), llm.dtype, llm.kv_dtype),
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "prefill_tok_s": prompt_tokens / prefill_s,
        "decode_tok_s": gen_tokens / decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
    }


def bench_speculative(llm, prompt_tokens: int, gen_tokens: int, seed: int, speculative: str, draft_tokens,
                      draft_vocab: int | None = None) -> dict:
    """Greedy generation through the speculative loop; stops early at EOS like a user would."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, llm.net.args.vocab_size, (prompt_tokens,), generator=g).tolist()
    llm.generate_ids([prompt], max_tokens=gen_tokens, temperature=0.0, speculative=speculative, draft_tokens=draft_tokens,
                     draft_vocab=draft_vocab)
    d = llm.last_stats.as_dict()
    return {
        "model": str(llm.path),
        "architecture": llm.model_type,
        "dtype": str(llm.dtype).removeprefix("torch."),
        **kv_cache_summary(llm.net.cache_spec(), llm.dtype, llm.kv_dtype),
        "prompt_tokens": prompt_tokens,
        "gen_tokens": d["generated_tokens"],
        "speculative": speculative,
        **d,
    }
