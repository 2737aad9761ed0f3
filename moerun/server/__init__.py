"""OpenAI-compatible HTTP server: `serve(llm, ...)` runs it, `create_app(llm, ...)` builds the ASGI app.

Imports of FastAPI and uvicorn happen inside these functions, so `import moerun.server`
stays cheap.
"""

from __future__ import annotations


def create_app(llm, *, api_key: str | None = None, max_concurrency: int = 4, max_queue: int = 64,
               max_len: int | None = None, model_name: str | None = None, prefill_budget: int = 512,
               speculative: str | None = None, draft_tokens: int | str = 1, draft_vocab: int | None = None):
    """The FastAPI app serving `llm` (see app.py); its scheduler runs while the app runs."""
    from .app import create_app as _create

    return _create(llm, api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue,
                   max_len=max_len, model_name=model_name, prefill_budget=prefill_budget,
                   speculative=speculative, draft_tokens=draft_tokens, draft_vocab=draft_vocab)


def serve(llm, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
          max_concurrency: int = 4, max_queue: int = 64, max_len: int | None = None,
          model_name: str | None = None, prefill_budget: int = 512, log_level: str = "info",
          speculative: str | None = None, draft_tokens: int | str = 1, draft_vocab: int | None = None) -> None:
    """Serve `llm` over HTTP until interrupted (blocks).

    max_concurrency: cache slots, i.e. requests decoded together in one batch;
    max_queue: requests waiting for a slot beyond those, after which the server answers 429;
    max_len: tokens per slot (prompt + completion), default min(model context, 8192), never more
    than the model's context; the KV cache for all slots is allocated at start;
    model_name: the id clients must send as `model` (default: the model directory's name);
    prefill_budget: prompt tokens prefilled per scheduler step while others decode (long
    prompts go in as chunks of this size between decode steps);
    speculative="mtp": MTP self-speculative decoding with draft_tokens 1..4 or "auto" per
    step (draft_vocab N: drafts among the first N token ids); requests then run one at a
    time (scheduler.py).
    """
    import uvicorn

    app = create_app(llm, api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue,
                     max_len=max_len, model_name=model_name, prefill_budget=prefill_budget,
                     speculative=speculative, draft_tokens=draft_tokens, draft_vocab=draft_vocab)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


__all__ = ["serve", "create_app"]
