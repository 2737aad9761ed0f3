"""`moerun bench`: prefill and decode tokens/s on random token ids."""

from __future__ import annotations

import time

import torch

from ..layers.cache import Cache, kv_cache_summary
from ..engine.generate import run_plans
from ..layers.stack import decode_path
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
        # warm-up on the cache and decode program the timed run then takes (built before the
        # first pass: `run_plans`): first calls allocate and pick kernels
        def step(ids, cache, plans):
            return net(ids, cache, last_only=True, **plans)[:, -1].argmax(-1, keepdim=True)

        cache = Cache(net.cache_spec(), 1, max(prompt_tokens + gen_tokens, 7), llm.dtype, llm.kv_dtype)  # (warm-up: 7)
        plans = run_plans(net, cache, (1,))
        tok = step(torch.randint(0, vocab, (1, 4), generator=g), cache, plans)
        for _ in range(3):
            tok = step(tok, cache, plans)
        cache.reset(0)
        t0 = time.perf_counter()
        logits = net(prompt, cache, last_only=True, **plans)
        prefill_s = time.perf_counter() - t0
        tok = logits[:, -1].argmax(-1, keepdim=True)
        before = decode_path(plans.get("plans"))
        t0 = time.perf_counter()
        for _ in range(gen_tokens):
            tok = step(tok, cache, plans)
        decode_s = time.perf_counter() - t0
        path = decode_path(plans.get("plans"))  # the timed passes' alone
        for k in ("native_stack_passes", "module_passes"):
            if path[k] is not None:
                path[k] -= before[k]
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
        "decode_path": path,
    }


def bench_speculative(llm, prompt_tokens: int, gen_tokens: int, seed: int, speculative: str, draft_tokens,
                      draft_vocab: int | None = None) -> dict:
    """Greedy generation through the speculative loop; stops early at EOS like a user would.
    A short run first warms it up (kernels, allocations); the timed run builds its own decode
    program when it starts, as a user's run does."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, llm.net.args.vocab_size, (prompt_tokens,), generator=g).tolist()
    kw = dict(temperature=0.0, speculative=speculative, draft_tokens=draft_tokens, draft_vocab=draft_vocab)
    llm.generate_ids([prompt[:4]], max_tokens=min(gen_tokens, 8), **kw)
    llm.generate_ids([prompt], max_tokens=gen_tokens, **kw)
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
