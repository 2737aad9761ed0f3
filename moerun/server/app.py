"""The OpenAI-compatible HTTP API over a `Scheduler`: chat and text completions (plain and
server-sent events), models, health, Prometheus metrics, and a small chat page at `/`.

What it refuses and why (hostile pages, large bodies, fields it cannot honour) is written
up in docs/security.md. In short: every request passes `_Guard` (Host allow-list, same
origin unless --cors-origin, JSON content type, a body cap) before any endpoint; a body is
parsed, validated, templated and tokenized on a small worker pool, never on the event loop;
and every field is checked against its domain by the pydantic models below.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import MoerunError, one_line
from .limits import DEFAULT_MAX_BODY
from .metrics import ServerMetrics
from .scheduler import Event, Overloaded, Scheduler, ShuttingDown
from ..engine.speculative import check_options
from ..tokenizer import IncrementalDecoder

log = logging.getLogger("moerun.server")
MAX_INT = 2**31 - 1  # counts and sizes a request may name
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

STATIC = Path(__file__).resolve().parent / "static"


class APIError(Exception):
    """An error returned in the OpenAI shape {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# -- request bodies -----------------------------------------------------------------------


def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode text (it holds a lone surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]  # JSON can spell a lone surrogate ("\ud800")
StopText = Annotated[str, Field(min_length=1, max_length=1000), AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Part(_Strict):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # image_url and the like: refused by type
    type: Text
    text: Text | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # name, tool_call_id: not shown to the model
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[_Part] | None = None


class StreamOptions(_Strict):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    include_usage: bool = False


class _Common(BaseModel):
    # unknown fields are kept so that they can be logged (once per name), then ignored
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: Text | None = None
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_INT)  # beyond OpenAI, as vLLM and llama-server accept
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    stop: StopText | list[StopText] | None = Field(None, max_length=4)
    seed: int | None = Field(None, ge=0, lt=2**64)  # torch.Generator's domain
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    # accepted, and change nothing about the answer
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    parallel_tool_calls: bool | None = None
    # would change the answer, and are not implemented: refused unless at their no-op value
    # (`_UNSUPPORTED`), so that a client never takes prose for the JSON or tool call it asked for
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[Text, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[Text, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Text | dict[Text, Any] | None = None
    functions: list[Any] | None = None
    function_call: Text | dict[Text, Any] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_INT)


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[Annotated[int, Field(ge=0, le=MAX_INT)]]
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None


# field -> whether its value asks for nothing beyond a plain answer
_UNSUPPORTED = {
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or v == 0,
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: not v,
    "frequency_penalty": lambda v: not v,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "tools": lambda v: not v,
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: not v,
    "function_call": lambda v: v is None or v == "none",
    "echo": lambda v: v is False,
    "suffix": lambda v: not v,
    "best_of": lambda v: v is None or v == 1,
}


# -- helpers ------------------------------------------------------------------------------


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = one_line(err.get("msg", "invalid request"))
    return APIError(400, f"invalid value for '{loc}': {msg}" if loc else msg, param=loc or None, code="invalid_value")


def _json_body(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer of thousands of digits
        raise APIError(400, f"the request body is not valid JSON: {one_line(e)}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def _message_text(m: ChatMessage) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        texts = []
        for p in content:
            if p.type != "text" or p.text is None:
                raise APIError(400, f"message content parts of type '{p.type}' are not supported (text only)",
                               param="messages", code="invalid_value")
            texts.append(p.text)
        content = "".join(texts)
    return {"role": m.role, "content": content or ""}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Server:
    """Everything one app holds: the model, its scheduler, its figures and settings."""

    def __init__(self, llm, api_key: str | None, max_concurrency: int, max_queue: int, max_len: int | None,
                 model_name: str | None, prefill_budget: int = 512, speculative: str | None = None,
                 draft_tokens: int | str = 1, draft_vocab: int | None = None, max_body: int = DEFAULT_MAX_BODY,
                 max_prompt_tokens: int | None = None, allowed_hosts: tuple[str, ...] = (),
                 cors_origins: tuple[str, ...] = (), workers: int = 2):
        check_settings(api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue, max_len=max_len,
                       max_body=max_body, max_prompt_tokens=max_prompt_tokens, workers=workers)
        if llm.tokenizer is None:
            raise MoerunError(f"{llm.path} has no tokenizer.json; the server needs one")
        self.llm = llm
        self.api_key = api_key
        self.max_body = max_body
        self.max_prompt_tokens = max_prompt_tokens
        self.allowed_hosts = {h.lower().strip("[]") for h in (*LOOPBACK_HOSTS, *allowed_hosts)}
        self.cors_origins = tuple(cors_origins)
        self.workers = workers
        self.limiter: anyio.CapacityLimiter | None = None  # made in the app's event loop
        self.preparing = 0  # bodies waiting for, or on, the worker pool
        self.draining = False
        self._unknown_logged: set[str] = set()
        vocab = llm.tokenizer.tok.get_vocab(with_added_tokens=True)
        # no token covers more bytes of text than this (twice its longest piece: a normalizer
        # may fold a few bytes into fewer, as NFKC folds ligatures): a text longer than
        # max_prompt_tokens times it is too long without tokenizing it
        self.max_token_bytes = 2 * max((len(t.encode("utf-8", "replace")) for t in vocab), default=1)
        self.model_name = model_name or Path(str(llm.path)).name
        self.created = int(time.time())
        self.sched_args = dict(max_concurrency=max_concurrency, max_queue=max_queue, max_len=max_len,
                               prefill_budget=prefill_budget, speculative=speculative, draft_tokens=draft_tokens,
                               draft_vocab=draft_vocab)
        if speculative is not None:  # a bad choice fails here, before the server starts

            check_options(llm.net, speculative, draft_tokens, draft_vocab)
        self.scheduler: Scheduler | None = None
        self.metrics = ServerMetrics(llm, lambda: self.scheduler)

    def start(self) -> None:
        if self.scheduler is None:
            self.scheduler = Scheduler(self.llm, metrics=self.metrics, **self.sched_args)
        if self.limiter is None:
            self.limiter = anyio.CapacityLimiter(self.workers)

    @property
    def prompt_limit(self) -> int:
        """The most tokens a prompt may have: --max-prompt-tokens, and room for one token."""
        room = self.scheduler.max_len - 1
        return room if self.max_prompt_tokens is None else min(room, self.max_prompt_tokens)

    def drain(self, timeout: float) -> None:
        """Shut down gracefully (on SIGTERM): take no new requests, let those running finish
        for up to `timeout` seconds, then end the rest with an error (a stream's last chunk
        then has finish_reason "error")."""
        if self.draining:
            return
        self.draining = True
        s = self.scheduler
        if s is None:
            return
        s.stop_admitting()
        timer = threading.Timer(timeout, s.abort)
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
            self.scheduler = None

    # -- checks ---------------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if not auth:
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    async def offload(self, fn, *args):
        """fn(*args) on the worker pool (parsing, templating, tokenizing: work that grows with
        the body and would otherwise stall every stream on the event loop). Past
        max_concurrency + max_queue bodies waiting for it, 429."""
        s = self.scheduler
        if self.preparing >= s.max_concurrency + s.max_queue:
            raise APIError(429, "the server is busy preparing other requests", type="server_overloaded",
                           code="rate_limit_exceeded")
        self.preparing += 1
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        finally:
            self.preparing -= 1

    def parse(self, raw: bytes, cls):
        """The request body, validated (on the worker pool)."""
        try:
            body = cls.model_validate(_json_body(raw), strict=True)  # "yes" is no bool, "3" no int
        except ValidationError as e:
            raise _validation_error(e) from None
        for name, harmless in _UNSUPPORTED.items():
            if name in cls.model_fields and not harmless(getattr(body, name)):
                raise APIError(400, f"'{name}' is not supported by this server; leave it out (or at its default)",
                               param=name, code="unsupported_parameter")
        for name in body.model_extra or {}:
            if name not in self._unknown_logged and len(self._unknown_logged) < 1000:
                self._unknown_logged.add(name)
                log.warning("ignoring the unknown request field %r (logged once)", name[:100])
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return body

    def check_text_size(self, text_bytes: int, param: str) -> None:
        """Refuse a text that must have more tokens than a prompt may, before tokenizing it."""
        if text_bytes > self.prompt_limit * self.max_token_bytes:
            raise APIError(400, f"the prompt is longer than this server takes ({self.prompt_limit} tokens)",
                           param=param, code="context_length_exceeded")

    def prepare_chat(self, raw: bytes):
        body = self.parse(raw, ChatRequest)
        messages = [_message_text(m) for m in body.messages]
        self.check_text_size(sum(len(m["content"].encode()) for m in messages), "messages")
        try:
            ids = self.llm.encode_prompt(messages)
        except MoerunError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        except Exception as e:  # noqa: BLE001 - a chat template that rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {one_line(e)}", param="messages",
                           code="invalid_value") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return (body, ids, *self.prepare(ids, body, max_tokens))

    def prepare_completion(self, raw: bytes):
        body = self.parse(raw, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt", code="invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.check_text_size(len(prompt.encode()), "prompt")
            try:
                ids = self.llm.encode_prompt(prompt)
            except MoerunError as e:
                raise APIError(400, str(e), param="prompt", code="invalid_value") from None
        else:
            ids = list(prompt)
        return (body, ids, *self.prepare(ids, body, body.max_tokens))

    def prepare(self, prompt_ids: list[int], body, max_tokens: int | None):
        """Check the prompt against the context and build the sampling settings."""

        limit = self.scheduler.max_len
        param = "messages" if isinstance(body, ChatRequest) else "prompt"
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
        vocab = self.llm.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        if len(prompt_ids) >= limit:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context window holds {limit} "
                           "(prompt and completion together)", param=param, code="context_length_exceeded")
        if len(prompt_ids) > self.prompt_limit:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server takes at most "
                           f"{self.prompt_limit}", param=param, code="context_length_exceeded")
        room = limit - len(prompt_ids)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            params = self.llm.sampling_params(
                max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed, stop=stop,
            )
        except MoerunError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        return params, IncrementalDecoder(self.llm.tokenizer, prompt_ids)

    def submit(self, prompt_ids, params, decoder, body):
        try:
            return self.scheduler.submit(prompt_ids, params, decoder, ignore_eos=body.ignore_eos)
        except Overloaded as e:
            raise APIError(429, str(e), type="server_overloaded", code="rate_limit_exceeded") from None
        except ShuttingDown as e:
            raise APIError(503, str(e), type="server_error", code="server_shutting_down") from None

    # -- the guard: what every request must pass before an endpoint sees it ----------------
    def refuse(self, method: str, path: str, headers: Headers) -> APIError | None:
        """Why a request is refused before any endpoint runs (None: it may go on)."""
        host = _host_name(headers.get("host", ""))
        if "*" not in self.allowed_hosts and host not in self.allowed_hosts:
            return APIError(403, f"the Host header {headers.get('host', '')[:100]!r} is not one this server answers "
                            "to; start it with --allowed-hosts to add one", type="forbidden", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, headers.get("host", "")):
            return APIError(403, f"cross-origin requests (from {origin[:100]!r}) are refused; start the server with "
                            "--cors-origin to allow an origin", type="forbidden", code="origin_not_allowed")
        if method == "POST" and path.startswith("/v1/"):
            if self.draining:
                return APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return APIError(415, "send the request body as JSON, with 'Content-Type: application/json'",
                                type="invalid_request_error", code="unsupported_media_type")
        return None

    def origin_allowed(self, origin: str, host_header: str) -> bool:
        if "*" in self.cors_origins or origin in self.cors_origins:
            return True
        try:  # the same origin: the page this server served (the chat page at /)
            return urlsplit(origin).netloc.lower() == host_header.lower() and urlsplit(origin).scheme in ("http", "https")
        except ValueError:
            return False


def _host_name(host: str) -> str:
    """A Host header's name, without its port: 'localhost:8000' -> 'localhost', '[::1]:80' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def check_settings(*, api_key=None, max_concurrency=4, max_queue=64, max_len=None, max_body=DEFAULT_MAX_BODY,
                   max_prompt_tokens=None, workers=2, shutdown_timeout=30.0, port=8000) -> None:
    """Each server setting in its domain (checked before a model loads); one MoerunError."""
    if api_key is not None and not api_key.strip():
        raise MoerunError("--api-key is empty: give a key, or leave the option out")
    for name, value, lo in (("--max-concurrency", max_concurrency, 1), ("--max-queue", max_queue, 0),
                            ("--max-len", max_len, 2), ("--max-body", max_body, 1024),
                            ("--max-prompt-tokens", max_prompt_tokens, 1), ("workers", workers, 1),
                            ("--port", port, 0)):
        if value is not None and not lo <= value <= (65535 if name == "--port" else MAX_INT):
            raise MoerunError(f"{name} is {value}; it must be at least {lo}"
                              + (" and at most 65535" if name == "--port" else ""))
    if not 0 <= shutdown_timeout <= 24 * 3600:
        raise MoerunError(f"--shutdown-timeout is {shutdown_timeout}; it must be 0..86400 seconds")


def create_app(llm, *, api_key: str | None = None, max_concurrency: int = 4, max_queue: int = 64,
               max_len: int | None = None, model_name: str | None = None, prefill_budget: int = 512,
               speculative: str | None = None, draft_tokens: int | str = 1, draft_vocab: int | None = None,
               max_body: int = DEFAULT_MAX_BODY, max_prompt_tokens: int | None = None,
               allowed_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = ()) -> FastAPI:
    """The ASGI app for `llm`; its scheduler thread starts with the app and stops with it."""
    srv = Server(llm, api_key, max_concurrency, max_queue, max_len, model_name, prefill_budget, speculative,
                 draft_tokens, draft_vocab, max_body=max_body, max_prompt_tokens=max_prompt_tokens,
                 allowed_hosts=tuple(allowed_hosts), cors_origins=tuple(cors_origins))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.start()
        try:
            yield
        finally:
            srv.stop()

    app = FastAPI(title="moerun", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.error("internal error on %s: %s", request.url.path, one_line(e))
        return APIError(500, "internal error", type="server_error").response()

    if srv.cors_origins:  # innermost: the guard has let only these origins through
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(srv.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(_Guard, srv=srv)
    app.add_middleware(_CountRequests, metrics=srv.metrics)

    @app.get("/health")
    async def health():
        s = srv.scheduler
        body = {"status": "draining" if srv.draining else "ok", "model": srv.model_name,
                "running": s.running if s else 0, "queued": s.queue_depth if s else 0}
        return JSONResponse(body, status_code=503 if srv.draining else 200)

    @app.get("/metrics")
    async def metrics(request: Request):
        srv.check_key(request)
        return Response(srv.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @app.get("/")
    async def index():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/v1/models")
    async def models(request: Request):
        srv.check_key(request)
        return {"object": "list", "data": [_model_card(srv)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        srv.check_key(request)
        if model_id != srv.model_name:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return _model_card(srv)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        srv.check_key(request)
        body, ids, params, decoder = await srv.offload(srv.prepare_chat, await request.body())
        return await _respond(srv, request, body, srv.submit(ids, params, decoder, body), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        srv.check_key(request)
        body, ids, params, decoder = await srv.offload(srv.prepare_completion, await request.body())
        return await _respond(srv, request, body, srv.submit(ids, params, decoder, body), chat=False)

    return app


class _Guard:
    """Every HTTP request first passes `Server.refuse` (Host, Origin, content type, draining);
    a POST's body is then read here up to --max-body (413 past it, without reading the rest)
    and handed on whole. Plain ASGI, like `_CountRequests`."""

    def __init__(self, app, srv: Server):
        self.app, self.srv = app, srv

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        err = self.srv.refuse(scope["method"], scope["path"], headers)
        if err is None and scope["method"] == "POST":
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.srv.max_body):
                err = self.too_large()
        if err is not None:
            return await err.response()(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.srv.max_body:
                return await self.too_large().response()(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then only the client's disconnect

        return await self.app(scope, replay, send)

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server takes ({self.srv.max_body} bytes)",
                        code="request_too_large")


_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models"}


class _CountRequests:
    """Counts /v1/ requests by path and status. Plain ASGI on purpose: Starlette's
    BaseHTTPMiddleware reports a disconnect to the app once a streamed response starts,
    which would cancel every stream."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        path = scope["path"]
        if path.startswith("/v1/models/"):
            path = "/v1/models/{id}"
        elif path not in _ROUTES:
            path = "other"  # unknown paths do not each make a new series

        async def send_counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_counted)


def _model_card(srv: Server) -> dict:
    return {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "moerun",
            "max_model_len": srv.scheduler.max_len if srv.scheduler else srv.llm.context_length}


async def _next_event(srv: Server, request: Request, req) -> Event | None:
    """The request's next event, or None once the client has gone away (generation cancelled).

    The connection is looked at every half second even while events keep coming: for a
    non-streamed answer nothing else would notice that the client has left."""
    while True:
        now = time.monotonic()
        if now - req.checked_at >= 0.5:
            req.checked_at = now
            if await request.is_disconnected():
                _cancel(srv, req)
                return None
        try:
            return await asyncio.wait_for(req.events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            pass


def _cancel(srv: Server, req) -> None:
    if srv.scheduler is not None:  # None once the server has stopped
        srv.scheduler.cancel(req)


async def _respond(srv: Server, request: Request, body, req, chat: bool):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model = srv.model_name
    if not body.stream:
        text = []
        try:
            while True:
                ev = await _next_event(srv, request, req)
                if ev is None:  # nobody is listening any more
                    return Response(status_code=499)
                if ev.kind == "piece":
                    text.append(ev.text)
                elif ev.kind == "error":
                    raise _event_error(ev)
                else:
                    break
        except asyncio.CancelledError:
            _cancel(srv, req)
            raise
        usage = _usage(ev)
        content = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                      "finish_reason": ev.finish_reason}
            return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [choice], "usage": usage, "system_fingerprint": None}
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": ev.finish_reason}
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [choice], "usage": usage, "system_fingerprint": None}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_or_text, finish_reason=None) -> dict:
        if chat:
            choice = {"index": 0, "delta": delta_or_text, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": finish_reason}
        c = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
             "system_fingerprint": None}
        if include_usage:
            c["usage"] = None
        return c

    async def events():
        done = False
        try:
            if chat:
                yield _sse(chunk({"role": "assistant", "content": ""}))
            while True:
                ev = await _next_event(srv, request, req)
                if ev is None:
                    done = True
                    return
                if ev.kind == "piece":
                    yield _sse(chunk({"content": ev.text} if chat else ev.text))
                elif ev.kind == "error":  # a last chunk that says so, then the error itself
                    done = True
                    yield _sse(chunk({} if chat else "", "error"))
                    yield _sse(_event_error(ev).body())
                    break
                else:
                    done = True
                    yield _sse(chunk({} if chat else "", ev.finish_reason))
                    if include_usage:
                        yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                    "usage": _usage(ev), "system_fingerprint": None})
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away: free the slot
                _cancel(srv, req)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event_error(ev: Event) -> APIError:
    if ev.reason == "request":
        return APIError(400, ev.text, code="invalid_value")
    if ev.reason == "shutdown":
        return APIError(503, ev.text, type="server_error", code="server_shutting_down")
    return APIError(500, ev.text, type="server_error")


def _usage(ev: Event) -> dict:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens}
