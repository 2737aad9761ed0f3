"""The OpenAI-compatible HTTP API over a `Scheduler`: chat and text completions (plain and
server-sent events), models, health, Prometheus metrics, and a small chat page at `/`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import MoerunError
from .metrics import ServerMetrics
from .scheduler import Event, Overloaded, Scheduler

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


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[_Part] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # beyond OpenAI, as vLLM and llama-server accept
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)  # torch.Generator's domain
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    user: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False


# -- helpers ------------------------------------------------------------------------------


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return APIError(400, f"invalid value for '{loc}': {err.get('msg')}" if loc else err.get("msg", "invalid request"),
                    param=loc or None, code="invalid_value")


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
                 draft_tokens: int | str = 1, draft_vocab: int | None = None):
        if llm.tokenizer is None:
            raise MoerunError(f"{llm.path} has no tokenizer.json; the server needs one")
        self.llm = llm
        self.api_key = api_key
        self.model_name = model_name or Path(str(llm.path)).name
        self.created = int(time.time())
        self.sched_args = dict(max_concurrency=max_concurrency, max_queue=max_queue, max_len=max_len,
                               prefill_budget=prefill_budget, speculative=speculative, draft_tokens=draft_tokens,
                               draft_vocab=draft_vocab)
        if speculative is not None:  # a bad choice fails here, before the server starts
            from ..engine.speculative import check_options

            check_options(llm.net, speculative, draft_tokens, draft_vocab)
        self.scheduler: Scheduler | None = None
        self.metrics = ServerMetrics(llm, lambda: self.scheduler)

    def start(self) -> None:
        if self.scheduler is None:
            self.scheduler = Scheduler(self.llm, metrics=self.metrics, **self.sched_args)

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

    async def parse(self, request: Request, cls):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            body = cls.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n", code="invalid_value")
        return body

    def prepare(self, prompt_ids: list[int], body, max_tokens: int | None):
        """Check the prompt against the context and build the sampling settings."""
        from ..tokenizer import IncrementalDecoder

        limit = self.scheduler.max_len
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        vocab = self.llm.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        if len(prompt_ids) >= limit:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context window holds {limit} "
                           "(prompt and completion together)", param="messages" if isinstance(body, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        room = limit - len(prompt_ids)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > 4:
            raise APIError(400, "at most 4 stop sequences", param="stop", code="invalid_value")
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


def create_app(llm, *, api_key: str | None = None, max_concurrency: int = 4, max_queue: int = 64,
               max_len: int | None = None, model_name: str | None = None, prefill_budget: int = 512,
               speculative: str | None = None, draft_tokens: int | str = 1, draft_vocab: int | None = None) -> FastAPI:
    """The ASGI app for `llm`; its scheduler thread starts with the app and stops with it."""
    srv = Server(llm, api_key, max_concurrency, max_queue, max_len, model_name, prefill_budget, speculative,
                 draft_tokens, draft_vocab)

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
        return APIError(500, f"internal error: {e}", type="server_error").response()

    app.add_middleware(_CountRequests, metrics=srv.metrics)

    @app.get("/health")
    async def health():
        s = srv.scheduler
        return {"status": "ok", "model": srv.model_name, "running": s.running if s else 0,
                "queued": s.queue_depth if s else 0}

    @app.get("/metrics")
    async def metrics():
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
        body: ChatRequest = await srv.parse(request, ChatRequest)
        messages = [_message_text(m) for m in body.messages]
        try:
            ids = llm.encode_prompt(messages)
        except MoerunError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        except Exception as e:  # noqa: BLE001 - a chat template that rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages",
                           code="invalid_value") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params, decoder = srv.prepare(ids, body, max_tokens)
        return await _respond(srv, request, body, srv.submit(ids, params, decoder, body), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        srv.check_key(request)
        body: CompletionRequest = await srv.parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt", code="invalid_value")
            prompt = prompt[0]
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo", code="invalid_value")
        ids = llm.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        params, decoder = srv.prepare(ids, body, body.max_tokens)
        return await _respond(srv, request, body, srv.submit(ids, params, decoder, body), chat=False)

    return app


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
                    raise APIError(500, ev.text, type="server_error")
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
                elif ev.kind == "error":
                    done = True
                    yield _sse(APIError(500, ev.text, type="server_error").body())
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


def _usage(ev: Event) -> dict:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens}
