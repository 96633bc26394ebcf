"""An OpenAI-compatible HTTP API over the batching engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the manifest's chat
template), both streaming as server-sent events when ``"stream": true``; ``GET
/v1/models``; ``GET /health``. The engine runs on one worker thread; each HTTP request
waits on its own handle, so one bad or abandoned request never touches another.

starlette and uvicorn are imported only when an app is built or served: the request
parsing here (shared with ``run_prompts_file``) needs neither.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Optional

from .engine import Completion, Engine, EngineError, Event, Request
from .request_body import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    MAX_DEPTH,
    MAX_INT_DIGITS,
    BodyError,
    BodyLimits,
    ClientGone,
    check_value,
    parse_json,
    read_body,
)
from .sampling import GREEDY_TEMPERATURE, SamplingError, SamplingParams
from .stops import MAX_STOP_CHARS, MAX_STOPS, StopStringError, StopStrings
from .text import TokenizerMissing

log = logging.getLogger("uvicorn.error")  # uvicorn configures it: one line per event in its log

# Kept here (not imported from slow_clients) so the command line does not import uvicorn.
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_KEEP_ALIVE = 5.0  # uvicorn's default
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 256
# Finish reasons in OpenAI's vocabulary: running out of cache is a length limit too.
FINISH_REASONS = {"stop": "stop", "length": "length", "capacity": "length"}
# Parameters this server cannot honour: a request asking for them is refused, not ignored.
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "logit_bias", "tools", "functions", "suffix")
PENALTIES = ("presence_penalty", "frequency_penalty")


class ApiError(Exception):
    """A request answered with an OpenAI-shaped error: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ApiRequest:
    """A parsed completion or chat request."""

    request: Request  # its prompt already tokenized
    stream: bool
    include_usage: bool


# -- parsing (no HTTP here) ---------------------------------------------------------------
def _number(body: Mapping, name: str, default: Any, kind: type, low: Optional[float] = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"'{name}' must be {'a number' if kind is float else 'an integer'}, got {value!r}", name)
    if low is not None and value < low:
        raise ApiError(400, f"'{name}' must be at least {low}, got {value!r}", name)
    return kind(value)


def _flag(body: Mapping, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {value!r}", name)
    return value


def _stops(body: Mapping) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
    try:
        return StopStrings.of(stops).strings
    except StopStringError as exc:
        raise ApiError(400, f"'stop': {exc}", "stop") from None


def _prompt(body: Mapping, engine: Engine) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return engine.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")


def _chat_prompt(body: Mapping, engine: Engine) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content may hold only text parts", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        rendered.append({"role": message["role"], "content": content})
    if engine.codec is None:
        raise ApiError(400, "this model embeds no tokenizer, so it cannot chat; use /v1/completions "
                            "with token ids", "messages")
    from jinja2 import TemplateError  # chat templates are jinja; only chat needs it

    try:
        text = engine.codec.render_chat(rendered)
    except TemplateError as exc:  # e.g. the template's own raise_exception on role order
        raise ApiError(400, f"the model's chat template refused these messages: {exc}", "messages") from None
    return engine.encode(text)


def parse_request(body: Any, engine: Engine, chat: bool) -> ApiRequest:
    """An OpenAI completion (``chat=False``) or chat completion body as an engine Request.

    Tokenizes (and renders the chat template): call it off the event loop.

    Raises:
        ApiError: a malformed body, an unsupported parameter, or a prompt plus
            ``max_tokens`` longer than the model's context.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        check_value(body)  # depth and lone surrogates, before any field is used
    except BodyError as exc:
        raise ApiError(exc.status, str(exc)) from None
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, {}, []):
            raise ApiError(400, f"'{name}' is not supported by this server; remove it", name)
    for name in PENALTIES:
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"'{name}' is not supported by this server; remove it or set it to 0", name)
    try:
        ids = _chat_prompt(body, engine) if chat else _prompt(body, engine)
    except (EngineError, TokenizerMissing) as exc:
        raise ApiError(400, str(exc), "messages" if chat else "prompt") from None
    token_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    # Unasked, a completion takes the default or what is left of the context, if less.
    default = min(DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS, engine.max_context - len(ids))
    max_tokens = _number(body, token_name, max(default, 1), int, 1)
    if len(ids) + max_tokens > engine.max_context:
        raise ApiError(
            400,
            f"This model's maximum context length is {engine.max_context} tokens, but {len(ids) + max_tokens} "
            f"were requested ({len(ids)} in the prompt, {max_tokens} for the completion); "
            f"reduce the prompt or '{token_name}'",
            token_name,
            "context_length_exceeded",
        )
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 1.0, float, 0.0),
            top_k=_number(body, "top_k", 0, int, 0),
            top_p=_number(body, "top_p", 1.0, float),
            seed=_number(body, "seed", None, int),
        )
    except SamplingError as exc:
        raise ApiError(400, str(exc)) from None
    stream, ignore_eos = _flag(body, "stream"), _flag(body, "ignore_eos")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    request = Request(
        prompt=ids,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stops(body),
        n=_number(body, "n", 1, int, 1),
        ignore_eos=ignore_eos,
    )
    return ApiRequest(request, stream, bool(options.get("include_usage")))


# -- responses ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """Builds the response objects of one request (ids and timestamps shared by chunks)."""

    model: str
    chat: bool
    id: str
    created: int

    @classmethod
    def new(cls, model: str, chat: bool) -> "Reply":
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(model, chat, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _object(self, kind: str, choices: list, **extra: Any) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def full(self, completion: Completion) -> dict:
        choices = []
        for s in completion.samples:
            reason = FINISH_REASONS.get(s.finish_reason, s.finish_reason)
            if self.chat:
                choices.append({"index": s.index, "message": {"role": "assistant", "content": s.text},
                                "finish_reason": reason})
            else:
                choices.append({"index": s.index, "text": s.text, "logprobs": None, "finish_reason": reason})
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, choices, usage=usage(completion))

    def chunk(self, index: int, text: Optional[str], finish_reason: Optional[str] = None,
              role: bool = False) -> dict:
        reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        return self._object("text_completion", [choice])

    def usage_chunk(self, completion: Completion) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=usage(completion))


def usage(completion: Completion) -> dict:
    generated = sum(len(s.tokens) for s in completion.samples)
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": generated,
            "total_tokens": completion.prompt_tokens + generated}


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# -- the app ------------------------------------------------------------------------------
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


def _error_response(error: ApiError, close: bool = False):
    from starlette.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers={"connection": "close"} if close else None)


def create_app(engine: Engine, model_id: str, limits: BodyLimits = BodyLimits()):
    """The starlette app serving ``engine`` as ``model_id``; it starts and stops the engine.

    ``limits`` bound each request body (size, and seconds per chunk).
    """
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())

    def parse(raw: bytes, chat: bool) -> ApiRequest:  # on a worker thread: parsing and tokenizing
        try:
            body = parse_json(raw)
        except BodyError as exc:
            raise ApiError(exc.status, str(exc), code=exc.code) from None
        if isinstance(body, dict) and body.get("model") not in (None, model_id):
            raise ApiError(404, f"the model {str(body['model'])[:100]!r} does not exist; this server serves "
                                f"{model_id!r}", "model", "model_not_found")
        return parse_request(body, engine, chat)

    async def run(http: HttpRequest, chat: bool):
        try:
            raw = await read_body(http.receive, http.headers, limits)
        except BodyError as exc:  # the rest of the body is not read: the connection closes
            return _error_response(ApiError(exc.status, str(exc), code=exc.code), close=True)
        parsed = await run_in_threadpool(parse, raw, chat)
        listener = _Listener(parsed.request.n)
        try:
            handle = engine.submit(parsed.request, on_event=listener)
        except EngineError as exc:  # malformed, or can never fit this engine
            raise ApiError(400, str(exc)) from None
        reply = Reply.new(model_id, chat)
        if not parsed.stream:
            try:
                if not await _until_done_or_gone(listener, http.receive):
                    log.info("%s: client disconnected; request %d cancelled", _peer(http), handle.id)
                    return Response(status_code=204)  # nobody reads it
            finally:
                if not handle.done:  # the client went away, or the wait failed
                    handle.cancel()
            return JSONResponse(reply.full(handle.result(timeout=0)))

        async def stream():
            try:
                if chat:
                    for i in range(parsed.request.n):
                        yield sse(reply.chunk(i, None, role=True))
                async for event in listener.events():
                    if event.text or event.finish_reason:
                        yield sse(reply.chunk(event.index, event.text, event.finish_reason))
                if parsed.include_usage:
                    yield sse(reply.usage_chunk(handle.result(timeout=0)))
            except ApiError as exc:
                yield sse(exc.body())
            except Exception as exc:  # headers are sent: the error travels as an event
                log.error("request %d failed while streaming: %s: %s", handle.id, type(exc).__name__, exc)
                yield sse(ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error").body())
            finally:
                if not handle.done:
                    handle.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    def guarded(handler):
        """Every outcome of ``handler`` is a response: errors never reach uvicorn, so the
        connection stays usable and the log gets one line, not a traceback."""

        async def endpoint(http: HttpRequest):
            try:
                return await handler(http)
            except ApiError as exc:
                return _error_response(exc)
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
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )


def _peer(http) -> str:
    client = http.client
    return f"{client.host}:{client.port}" if client else "client"


# -- command line ---------------------------------------------------------------------------
def add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that size the engine (``serve`` and ``run --prompts``)."""
    parser.add_argument("--capacity", type=int, default=None,
                        help="cache capacity in positions (cells for batched-cell); default: 4 x max context")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="most tokens per forward (default: the model's max step)")
    parser.add_argument("--max-seqs", type=int, default=None, help="most live sequences")


def add_tokenizer_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer", metavar="HF_DIR", default=None,
        help="take the tokenizer (and config) from this Hugging Face checkpoint directory; "
        "needed for text with upstream ExecuTorch exports, which carry none",
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the .pte file to serve")
    add_tokenizer_argument(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-id", default=None, help="the name clients use (default: the file's stem)")
    parser.add_argument("--cache", default="batched-sequence", choices=("batched-sequence", "batched-cell"),
                        help="cache kind (default: batched-sequence)")
    parser.add_argument("--kv-dtype", default=None, choices=("float32", "float16", "bfloat16"),
                        help="K/V storage dtype (default: the model's dtype)")
    parser.add_argument("--max-body-bytes", type=_positive(int), default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body; larger ones get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--header-timeout", type=_positive(float), default=DEFAULT_HEADER_TIMEOUT,
                        help="seconds a client has to send a request's headers, else 408 and close "
                             f"(default: {DEFAULT_HEADER_TIMEOUT:g})")
    parser.add_argument("--body-timeout", type=_positive(float), default=DEFAULT_BODY_TIMEOUT,
                        help="seconds to wait for each chunk of a request body, else 408 and close "
                             f"(default: {DEFAULT_BODY_TIMEOUT:g})")
    parser.add_argument("--keep-alive", type=_positive(float), default=DEFAULT_KEEP_ALIVE,
                        help=f"seconds an idle keep-alive connection stays open (default: {DEFAULT_KEEP_ALIVE:g})")
    add_batching_arguments(parser)
    parser.epilog = (
        f"Limits per request: at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters; "
        f"'seed' in [0, 2**63 - 1]; temperatures below {GREEDY_TEMPERATURE:g} are greedy; the body is "
        f"JSON nested at most {MAX_DEPTH} deep, integers of at most {MAX_INT_DIGITS} digits, no lone "
        "surrogates. Bad requests get an OpenAI-shaped 4xx error."
    )


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not 0 < value < float("inf"):  # NaN compares false too
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_engine(model: str, kind: str, capacity: Optional[int] = None, max_batch_tokens: Optional[int] = None,
                 max_seqs: Optional[int] = None, kv_dtype: Optional[str] = None,
                 tokenizer: Optional[str] = None) -> Engine:
    """An engine over the program in the .pte file ``model`` (tokenizer: see ``load``);
    capacity defaults to room for a few full-context requests at once."""
    from .program import load

    program = load(model, tokenizer=tokenizer)
    if capacity is None:
        capacity = 4 * int(program.manifest["max_context"])
    return Engine(program, kind, capacity=capacity, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                  kv_dtype=kv_dtype)


def serve_main(args: argparse.Namespace) -> int:
    """``mlx-pte serve MODEL.pte [...]`` (arguments: ``add_serve_arguments``); serves until interrupted."""
    import uvicorn

    from .slow_clients import header_timeout_protocol

    engine = build_engine(args.model, args.cache, args.capacity, args.max_batch_tokens, args.max_seqs,
                          args.kv_dtype, args.tokenizer)
    app = create_app(engine, args.model_id or Path(args.model).stem,
                     BodyLimits(args.max_body_bytes, args.body_timeout))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                http=header_timeout_protocol(args.header_timeout), timeout_keep_alive=args.keep_alive)
    return 0
