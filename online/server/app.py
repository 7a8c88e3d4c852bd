"""FastAPI app: OpenAI-compatible chat/text completions over one engine.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` -> server-sent
events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
Every error is answered as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status
(5xx only for real server faults).
OpenAI features (logprobs, ``response_format``, ``tools``): parsed in online/server/features.py,
decoded through online.constrain (llguidance), shaped in online/server/responses.py.

Example::

    app = create_app(Engine.load("smollm2"), api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from online.server.batch_config import BatchConfig
from online.constrain import grammar_tokenizer
from online.server.features import chat_prompt
from online.server.metrics import Metrics
from online.server.responses import JobStreamingResponse, Reply
from online.server.scheduler import GenerationJob, QueueFullError, Scheduler, SchedulerClosedError, timeout_error
from online.server.schemas import ApiError, ChatCompletionRequest, CompletionRequest, parse_request
from tandem.core.errors import TandemError

log = logging.getLogger("tandem.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
DRAIN_LIMIT_BYTES = 64 << 20  # an oversized body is read and dropped up to this size, so the client sees the 413
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def create_app(engine: Any, api_key: str | None = None, max_queue: int = 64, request_timeout_s: float = 300.0,
               served_model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               batch: BatchConfig | None = None) -> FastAPI:
    """Build the server app for ``engine``; the generation worker starts with the app's lifespan.
    ``batch``: KV pool budget, prefill budget per step, batch cap and schedule (defaults: BatchConfig())."""
    if max_queue < 1:
        raise TandemError(f"max_queue must be at least 1, got {max_queue}")
    if not request_timeout_s > 0:
        raise TandemError(f"request timeout must be positive, got {request_timeout_s}")
    if api_key is not None and not api_key.strip():
        raise TandemError("the API key must not be empty")
    model_name = served_model_name or engine.model_id
    model_names = {model_name, engine.model_id}
    max_context = int(getattr(engine, "max_context", 0) or engine.config.max_context)
    metrics = Metrics()
    scheduler = Scheduler(engine, max_queue=max_queue, request_timeout_s=request_timeout_s, metrics=metrics,
                          batch=batch)
    created_s = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, scheduler.close)

    app = FastAPI(title="Tandem", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)  # "/v1/models/" is a 404 with a JSON body, not a bodiless 307
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    _install_error_handlers(app)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(name: str | None) -> None:
        if name is not None and name not in model_names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    async def serve(request: Request, req: Any, prompt: Any, chat: bool) -> Response:
        max_tokens = req.requested_max_tokens()
        if max_tokens is not None and max_tokens > max_context:
            field = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
            raise ApiError(400, f"{field} ({max_tokens}) exceeds the model's context of {max_context} tokens",
                           param=field)
        if max_tokens is None and not chat:
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        tools = req.tools if chat and req.tool_mode()[0] != "none" else None
        try:
            job = scheduler.submit(prompt, max_tokens, req.sampling(), stream_pieces=req.stream,
                                   loop=asyncio.get_running_loop(), n=req.n)
        except QueueFullError as exc:
            metrics.count("rejected")
            raise ApiError(429, f"the server is busy ({exc}); retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except SchedulerClosedError as exc:
            raise ApiError(503, str(exc), type="server_error", code="shutting_down") from None
        try:
            first = await next_event(job, request, request_timeout_s)
        except BaseException:
            job.cancel()
            raise
        if first is None:  # the client went away while waiting: nobody reads this answer
            job.cancel()
            return Response(status_code=499)
        kind, value = first
        if kind == "error":
            raise value
        token_bytes = None
        if (req.logprobs if chat else req.logprobs is not None):
            ll_tokenizer = grammar_tokenizer(engine)
            token_bytes = lambda token_id: ll_tokenizer.decode_bytes([token_id])  # noqa: E731
        reply = Reply(request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model=model_name, chat=chat,
                      token_bytes=token_bytes, tools=tools,
                      parallel_tool_calls=not chat or req.parallel_tool_calls is not False)
        if not req.stream:
            return JSONResponse(reply.full(value))
        return JobStreamingResponse(reply.events(job, first, req.include_usage(), request_timeout_s),
                                    job=job, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req = parse_request(ChatCompletionRequest, await read_json(request, max_body_bytes))
        check_model(req.model)
        return await serve(request, req, chat_prompt(engine, req), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req = parse_request(CompletionRequest, await read_json(request, max_body_bytes))
        check_model(req.model)
        return await serve(request, req, req.prompt, chat=False)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created_s, "owned_by": "tandem",
                "max_model_len": max_context}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> dict[str, Any]:
        authorize(request)
        check_model(name)
        return model_card()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        ok = scheduler.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": model_name,
                             "queue_depth": scheduler.queue_depth, "running": scheduler.running,
                             "max_queue": max_queue, "batching": scheduler.describe()},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(queue_depth=scheduler.queue_depth, running=scheduler.running),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def next_event(job: GenerationJob, request: Request, timeout_s: float) -> tuple[str, Any] | None:
    """The job's next event; ``None`` if the client disconnects first; a timeout error past the deadline."""
    get = asyncio.ensure_future(job.events.get())
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({get, gone}, timeout=max(job.deadline_s - time.monotonic(), 0.0),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (get, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(get, gone, return_exceptions=True)
    if get.done() and not get.cancelled():
        return get.result()
    if gone.done() and not gone.cancelled():
        return None
    job.cancel("timeouts")
    return "error", timeout_error(timeout_s)


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def read_json(request: Request, max_body_bytes: int) -> Any:
    """The body as JSON: 413 past ``max_body_bytes``, 400 for empty, non-UTF-8 or malformed input."""
    declared = request.headers.get("content-length")
    too_big = False
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid Content-Length header")
        too_big = int(declared) > max_body_bytes
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            too_big = too_big or size > max_body_bytes
            if too_big:
                chunks.clear()
                if size > DRAIN_LIMIT_BYTES:
                    break
                continue
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body") from None
    if too_big:
        raise ApiError(413, f"the request body is larger than the limit of {max_body_bytes} bytes",
                       code="request_too_large")
    body = b"".join(chunks)
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (bad byte at offset {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "malformed JSON: nested too deeply") from None
    except ValueError as exc:
        raise ApiError(400, f"malformed JSON: {exc}") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _install_error_handlers(app: FastAPI) -> None:
    def answer(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(TandemError)
    async def _tandem_error(_request: Request, exc: TandemError) -> JSONResponse:
        return answer(ApiError(400, str(exc).splitlines()[0] if str(exc) else "invalid request"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(ApiError(400, f"invalid request: {exc.errors()[0].get('msg', '')}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return answer(ApiError(exc.status_code, message, code=codes.get(exc.status_code)))

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return answer(ApiError(500, f"internal server error ({type(exc).__name__})", type="server_error"))


class MetricsMiddleware:
    """Pure ASGI middleware: counts every HTTP request by endpoint and status, with its latency."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start_s = time.perf_counter()
        status = 500

        async def send_and_record_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record_status)
        finally:
            self.metrics.observe_request(scope.get("path", ""), status, time.perf_counter() - start_s)
