"""The OpenAI-compatible HTTP app over the batching engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the manifest's chat
template; tool calls), both streaming as server-sent events when ``"stream": true``;
``POST /tokenize`` and ``/detokenize``; ``GET /v1/models``, ``/health`` and ``/metrics``
(Prometheus). The engine runs on one worker thread; each HTTP request
waits on its own handle, so one bad or abandoned request never touches another.

starlette and uvicorn are imported only when an app is built or served, so the command
line that parses ``serve``'s flags does not load them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

from mlx_pte.interpreter.template_budget import DEFAULT_BUDGET as DEFAULT_TEMPLATE_BUDGET

from ..engine import Engine, EngineError, Event
from .metrics import ServerMetrics
from .request import ApiError, ApiRequest, parse_request
from .response import Reply, sse
from .request_body import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEP_ALIVE,
    BodyError,
    BodyLimits,
    ClientGone,
    parse_json,
    read_body,
)
from .tokenize_api import detokenize, tokenize

log = logging.getLogger("uvicorn.error")  # uvicorn configures it: one line per event in its log



class _Listener:
    """Carries a request's events from the engine thread into the server's event loop."""

    def __init__(self, n: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.open = n  # samples not yet finished

    def __call__(self, event: Event) -> None:  # on the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self) -> AsyncIterator[Event]:
        """Events until every sample finished; raises ApiError when the request failed."""
        while self.open:
            event = await self.queue.get()
            if event.error is not None:
                raise ApiError(500, event.error, kind="server_error")
            if event.finish_reason is not None:
                self.open -= 1
            yield event


async def _disconnected(receive) -> None:
    """Returns when the client has gone (after its body was read, ``receive`` only reports that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_done_or_gone(listener: _Listener, receive) -> bool:
    """Wait for every event of a non-streaming request; False if the client left first."""

    async def drain() -> None:
        async for _ in listener.events():
            pass

    finished = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (finished, gone):
            task.cancel()
    if finished.done() and not finished.cancelled():
        finished.result()  # raises the request's ApiError, if it failed
        return True
    return False


class _BodyRefused(Exception):
    """A body refused while it was read; ``response`` answers it and closes the connection."""

    def __init__(self, response) -> None:
        super().__init__()
        self.response = response


def _error_response(error: ApiError, close: bool = False):
    from starlette.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers={"connection": "close"} if close else None)


def create_app(engine: Engine, model_id: str, limits: BodyLimits = BodyLimits(),
               template_budget: float = DEFAULT_TEMPLATE_BUDGET):
    """The starlette app serving ``engine`` as ``model_id``; it starts and stops the engine.

    ``limits`` bound each request body (size, and seconds for the whole body); ``template_budget`` is
    the CPU seconds one chat-template render may take (renders run on worker threads, so
    other requests are answered meanwhile).
    """
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())
    if engine.codec is not None:
        engine.codec.template_budget = template_budget
    metrics = ServerMetrics(engine)

    def body_of(raw: bytes):
        try:
            body = parse_json(raw)
        except BodyError as exc:
            raise ApiError(exc.status, str(exc), code=exc.code) from None
        if isinstance(body, dict) and body.get("model") not in (None, model_id):
            raise ApiError(404, f"the model {str(body['model'])[:100]!r} does not exist; this server serves "
                                f"{model_id!r}", "model", "model_not_found")
        return body

    def parse(raw: bytes, chat: bool) -> ApiRequest:  # on a worker thread: parsing and tokenizing
        parsed = parse_request(body_of(raw), engine.text, chat)
        tools = parsed.tools
        needs = ("tool_choice" if tools and tools.enforced else "tools" if tools and tools.strict
                 else "response_format" if parsed.request.grammar is not None
                 else "logprobs" if parsed.request.logprobs is not None else None)
        if needs:  # the grammar engine's vocabulary: built here on first use (~0.3 s), not on the event loop
            try:
                engine.vocabulary()
            except EngineError as exc:
                raise ApiError(400, str(exc), needs) from None
        return parsed

    async def read(http: HttpRequest) -> bytes:
        try:
            return await read_body(http.receive, http.headers, limits)
        except BodyError as exc:  # the rest of the body is not read: the connection closes
            raise _BodyRefused(_error_response(ApiError(exc.status, str(exc), code=exc.code), close=True)) from None

    async def run(http: HttpRequest, chat: bool):
        parsed = await run_in_threadpool(parse, await read(http), chat)
        listener = _Listener(parsed.request.n)
        vocabulary = engine.vocabulary() if parsed.request.logprobs is not None else None  # built by parse
        try:
            handle = engine.submit(parsed.request, on_event=listener)
        except EngineError as exc:  # malformed, or can never fit this engine
            raise ApiError(400, str(exc)) from None
        reply = Reply.new(model_id, chat, vocabulary)
        n = parsed.request.n
        if not parsed.stream:
            try:
                if not await _until_done_or_gone(listener, http.receive):
                    log.info("%s: client disconnected; request %d cancelled", _peer(http), handle.id)
                    metrics.finished(handle, ["cancelled"] * n)
                    return Response(status_code=204)  # nobody reads it
            except ApiError:
                metrics.finished(handle, ["error"] * n)
                raise
            finally:
                if not handle.done:  # the client went away, or the wait failed
                    handle.cancel()
            full = reply.full(handle.result(timeout=0), parsed.tools)
            metrics.finished(handle, [choice["finish_reason"] for choice in full["choices"]])
            return JSONResponse(full)

        async def stream():
            samples = [reply.sample_chunks(i, parsed.tools) for i in range(n)]
            reasons: list[str] = []
            try:
                if chat:
                    for i in range(n):
                        yield sse(reply.chunk(i, None, role=True))
                async for event in listener.events():
                    records = (event.logprob,) if event.logprob is not None else ()
                    for chunk in samples[event.index].on(event.text, event.finish_reason, records):
                        reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
                        yield sse(chunk)
                if parsed.include_usage:
                    yield sse(reply.usage_chunk(handle.result(timeout=0)))
            except ApiError as exc:
                reasons = ["error"] * n
                yield sse(exc.body())
            except Exception as exc:  # headers are sent: the error travels as an event
                reasons = ["error"] * n
                log.error("request %d failed while streaming: %s: %s", handle.id, type(exc).__name__, exc)
                yield sse(ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error").body())
            finally:
                if not handle.done:
                    handle.cancel()
                metrics.finished(handle, reasons + ["cancelled"] * (n - len(reasons)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    def tokenizing(function):
        async def endpoint(http: HttpRequest):
            raw = await read(http)
            return JSONResponse(await run_in_threadpool(lambda: function(body_of(raw), engine.text)))

        return endpoint

    def guarded(handler):
        """Every outcome of ``handler`` is a response: errors never reach uvicorn, so the
        connection stays usable and the log gets one line, not a traceback."""

        async def endpoint(http: HttpRequest):
            try:
                return await handler(http)
            except ApiError as exc:
                return _error_response(exc)
            except _BodyRefused as refused:
                return refused.response
            except ClientGone:
                log.info("%s: client disconnected before its request body was complete", _peer(http))
                return Response(status_code=204)
            except Exception as exc:
                log.error("%s %s failed: %s: %s", http.method, http.url.path, type(exc).__name__, exc)
                return _error_response(ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error"))

        return endpoint

    async def completions(http: HttpRequest):
        return await run(http, chat=False)

    async def chat_completions(http: HttpRequest):
        return await run(http, chat=True)

    async def models(_: HttpRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-pte"}]})

    async def health(_: HttpRequest):
        return JSONResponse({"status": "ok"})

    async def metrics_text(_: HttpRequest):
        text, content_type = metrics.exposition()
        return Response(text, media_type=content_type)

    async def http_error(_: HttpRequest, exc: HTTPException):
        return _error_response(ApiError(exc.status_code, str(exc.detail)))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            engine.stop(timeout=30)

    return Starlette(
        routes=[
            Route("/v1/completions", guarded(completions), methods=["POST"]),
            Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
            Route("/v1/models", guarded(models), methods=["GET"]),
            Route("/health", guarded(health), methods=["GET"]),
            Route("/metrics", guarded(metrics_text), methods=["GET"]),
            Route("/tokenize", guarded(tokenizing(tokenize)), methods=["POST"]),
            Route("/detokenize", guarded(tokenizing(detokenize)), methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )


def _peer(http) -> str:
    client = http.client
    return f"{client.host}:{client.port}" if client else "client"


def serve(engine: Engine, model_id: str, host: str, port: int, limits: BodyLimits = BodyLimits(),
          header_timeout: float = DEFAULT_HEADER_TIMEOUT, keep_alive: float = DEFAULT_KEEP_ALIVE,
          template_budget: float = DEFAULT_TEMPLATE_BUDGET) -> None:
    """Serve ``engine`` as ``model_id`` on ``host:port`` until interrupted.

    ``header_timeout``: seconds a client has to send a request's headers (else 408 and
    close); ``keep_alive``: seconds an idle keep-alive connection stays open;
    ``template_budget``: see ``create_app``.
    """
    import uvicorn

    from .slow_clients import header_timeout_protocol

    uvicorn.run(create_app(engine, model_id, limits, template_budget), host=host, port=port, log_level="info",
                http=header_timeout_protocol(header_timeout), timeout_keep_alive=keep_alive)
