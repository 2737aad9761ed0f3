"""OpenAI-compatible HTTP server: `serve(llm, ...)` runs it, `create_app(llm, ...)` builds the ASGI app.

Imports of FastAPI and uvicorn happen inside these functions, so `import moerun.server`
stays cheap.
"""

from __future__ import annotations

from .limits import DEFAULT_MAX_BODY


def create_app(llm, *, api_key: str | None = None, max_concurrency: int = 4, max_queue: int = 64,
               max_len: int | None = None, model_name: str | None = None, prefill_budget: int = 512,
               speculative: str | None = None, draft_tokens: int | str = 1, draft_vocab: int | None = None,
               max_body: int = DEFAULT_MAX_BODY, max_prompt_tokens: int | None = None,
               allowed_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = ()):
    """The FastAPI app serving `llm` (see app.py); its scheduler runs while the app runs."""
    from .app import create_app as _create

    return _create(llm, api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue,
                   max_len=max_len, model_name=model_name, prefill_budget=prefill_budget,
                   speculative=speculative, draft_tokens=draft_tokens, draft_vocab=draft_vocab,
                   max_body=max_body, max_prompt_tokens=max_prompt_tokens, allowed_hosts=allowed_hosts,
                   cors_origins=cors_origins)


def check_settings(**settings) -> None:
    """The server's settings checked (one MoerunError), before any model loads."""
    from .app import check_settings as _check

    _check(**settings)


def serve(llm, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
          max_concurrency: int = 4, max_queue: int = 64, max_len: int | None = None,
          model_name: str | None = None, prefill_budget: int = 512, log_level: str = "info",
          speculative: str | None = None, draft_tokens: int | str = 1, draft_vocab: int | None = None,
          max_body: int = DEFAULT_MAX_BODY, max_prompt_tokens: int | None = None,
          allowed_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
          shutdown_timeout: float = 30.0) -> None:
    """Serve `llm` over HTTP until SIGTERM or Ctrl-C (blocks), then shut down gracefully.

    max_concurrency: cache slots, i.e. requests decoded together in one batch;
    max_queue: requests waiting for a slot beyond those, after which the server answers 429;
    max_len: tokens per slot (prompt + completion), default min(model context, 8192), never more
    than the model's context; the KV cache for all slots is allocated at start;
    model_name: the id clients must send as `model` (default: the model directory's name);
    prefill_budget: prompt tokens prefilled per scheduler step while others decode (long
    prompts go in as chunks of this size between decode steps);
    speculative="mtp": MTP self-speculative decoding with draft_tokens 1..4 or "auto" per
    step (draft_vocab N: drafts among the first N token ids); requests then run one at a
    time (scheduler.py);
    max_body: the largest request body in bytes (413 past it); max_prompt_tokens: the
    longest prompt (default: what a slot holds);
    allowed_hosts: Host names answered besides loopback's (and `host`, when it is one
    address); cors_origins: origins whose pages may call the API ("*" for any);
    shutdown_timeout: on SIGTERM or Ctrl-C no new request is taken and those running get
    this many seconds to finish; the rest then end with an error (docs/security.md).
    """
    import signal

    import uvicorn

    check_settings(api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue, max_len=max_len,
                   max_body=max_body, max_prompt_tokens=max_prompt_tokens, shutdown_timeout=shutdown_timeout,
                   port=port)
    if host not in ("0.0.0.0", "::", ""):
        allowed_hosts = (*allowed_hosts, host)
    app = create_app(llm, api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue,
                     max_len=max_len, model_name=model_name, prefill_budget=prefill_budget,
                     speculative=speculative, draft_tokens=draft_tokens, draft_vocab=draft_vocab,
                     max_body=max_body, max_prompt_tokens=max_prompt_tokens, allowed_hosts=allowed_hosts,
                     cors_origins=cors_origins)

    class _Server(uvicorn.Server):
        """uvicorn, with a shutdown that drains (Server.drain) and then exits 0, where
        uvicorn's own re-raises the signal after its shutdown and cuts streams after its
        graceful timeout with no word to the client."""

        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: now
                return
            app.state.server.drain(shutdown_timeout)
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + 10)  # a backstop past the drain's own
    _Server(config).run()


__all__ = ["serve", "create_app", "check_settings"]
