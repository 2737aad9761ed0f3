"""`moerun bench`: prefill and decode tokens/s on random token ids."""

from __future__ import annotations

import time

import torch

from ..layers.cache import Cache, kv_cache_summary
from ..engine.generate import run_plans
from ..layers.stack import decode_path
from ..errors import MoerunError


WARMUPS = ("full", "short")


def bench(llm, prompt_tokens: int = 128, gen_tokens: int = 32, seed: int = 0, speculative: str | None = None,
          draft_tokens: int | str = 1, draft_vocab: int | None = None, reps: int = 1,
          warmup: str = "full") -> dict:
    """Prefill `prompt_tokens` random ids into an empty cache, then decode `gen_tokens` greedily
    after them; `reps` times, each with fresh ids (llama-bench's `-r`), after one warm-up.

    The warm-up is llama-bench's: `full` (the default) is a prefill pass of the timed prompt's
    size, then 3 decode steps, so the timed passes find what a pass of that size touches
    already touched (the weights' pages of a memory-mapped file, the workspaces grown to its
    size, the kernels picked). `short` is the warm-up moerun bench had before 2026-12-03: a
    4-token pass and 3 steps, so the first timed prefill pays the first touch of every page
    those 4 tokens did not need. prefill_tok_s / decode_tok_s are the means over the reps of
    each rep's tokens/s (llama-bench's avg_ts); `*_reps` hold each rep's."""
    if speculative:
        if reps != 1:
            raise MoerunError("--reps is not taken with --speculative (one generation is timed)")
        return bench_speculative(llm, prompt_tokens, gen_tokens, seed, speculative, draft_tokens, draft_vocab)
    if prompt_tokens < 1 or gen_tokens < 1:
        raise MoerunError("--prompt-tokens and --gen-tokens must be at least 1")
    if reps < 1:
        raise MoerunError(f"--reps must be at least 1, not {reps}")
    if warmup not in WARMUPS:
        raise MoerunError(f"--warmup must be one of {', '.join(WARMUPS)}, not {warmup!r}")
    if prompt_tokens + gen_tokens > llm.context_length:
        raise MoerunError(f"{prompt_tokens}+{gen_tokens} tokens exceed the context window of {llm.context_length}")
    net = llm.net
    vocab = net.args.vocab_size
    g = torch.Generator().manual_seed(seed)
    warm_tokens = prompt_tokens if warmup == "full" else 4
    warm_steps = 3
    with torch.inference_mode():
        # warm-up on the cache and decode program the timed run then takes (built before the
        # first pass: `run_plans`): first calls allocate and pick kernels, first touches fault
        # the weights' pages in
        def step(ids, cache, plans):
            return net(ids, cache, last_only=True, **plans)[:, -1].argmax(-1, keepdim=True)

        cache = Cache(net.cache_spec(), 1, max(prompt_tokens + gen_tokens, warm_tokens + warm_steps), llm.dtype,
                      llm.kv_dtype)
        plans = run_plans(net, cache, (1,))
        tok = step(torch.randint(0, vocab, (1, warm_tokens), generator=g), cache, plans)
        for _ in range(warm_steps):
            tok = step(tok, cache, plans)
        store = getattr(llm, "store", None)
        if store is not None:
            store.reset_stats()  # the store's figures are the timed passes' alone, as decode_path's
        before = decode_path(plans.get("plans"))
        prefill, decode = [], []
        for _ in range(reps):
            cache.reset(0)
            prompt = torch.randint(0, vocab, (1, prompt_tokens), generator=g)
            t0 = time.perf_counter()
            logits = net(prompt, cache, last_only=True, **plans)
            prefill.append(time.perf_counter() - t0)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(gen_tokens):
                tok = step(tok, cache, plans)
            decode.append(time.perf_counter() - t0)
        path = decode_path(plans.get("plans"))  # the timed passes' alone
        for k in ("native_stack_passes", "module_passes"):
            if path[k] is not None:
                path[k] -= before[k]
    pp = [prompt_tokens / s for s in prefill]
    tg = [gen_tokens / s for s in decode]
    return {
        "model": str(llm.path),
        "architecture": llm.model_type,
        "dtype": str(llm.dtype).removeprefix("torch."),
        **kv_cache_summary(net.cache_spec(), llm.dtype, llm.kv_dtype),
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "prefill_tok_s": sum(pp) / reps,
        "decode_tok_s": sum(tg) / reps,
        "prefill_s": sum(prefill) / reps,
        "decode_s": sum(decode) / reps,
        "reps": reps,
        "prefill_tok_s_reps": pp,
        "decode_tok_s_reps": tg,
        "warmup": {"name": warmup, "prefill_tokens": warm_tokens, "decode_steps": warm_steps},
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
