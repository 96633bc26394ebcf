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
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Optional

from .engine import Completion, Engine, EngineError, Event, Request
from .sampling import SamplingError, SamplingParams
from .text import TokenizerMissing

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 256
MAX_STOPS = 4
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
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return tuple(stops)


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

    Raises:
        ApiError: a malformed body, an unsupported parameter, or a prompt plus
            ``max_tokens`` longer than the model's context.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
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


def create_app(engine: Engine, model_id: str):
    """The starlette app serving ``engine`` as ``model_id``; it starts and stops the engine."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())

    async def run(http: HttpRequest, chat: bool):
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
        if isinstance(body, dict) and body.get("model") not in (None, model_id):
            raise ApiError(404, f"the model {body['model']!r} does not exist; this server serves "
                                f"{model_id!r}", "model", "model_not_found")
        parsed = parse_request(body, engine, chat)
        listener = _Listener(parsed.request.n)
        try:
            handle = engine.submit(parsed.request, on_event=listener)
        except EngineError as exc:  # malformed, or can never fit this engine
            raise ApiError(400, str(exc)) from None
        reply = Reply.new(model_id, chat)
        if not parsed.stream:
            try:
                async for _ in listener.events():
                    pass
            finally:
                if not handle.done:  # the client went away
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
            finally:
                if not handle.done:
                    handle.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def completions(http: HttpRequest):
        return await run(http, chat=False)

    async def chat_completions(http: HttpRequest):
        return await run(http, chat=True)

    async def models(_: HttpRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-pte"}]})

    async def health(_: HttpRequest):
        return JSONResponse({"status": "ok"})

    async def api_error(_: HttpRequest, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(_: HttpRequest, exc: HTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    async def server_error(_: HttpRequest, exc: Exception):
        error = ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            engine.stop(timeout=30)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )


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
    add_batching_arguments(parser)


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

    engine = build_engine(args.model, args.cache, args.capacity, args.max_batch_tokens, args.max_seqs,
                          args.kv_dtype, args.tokenizer)
    app = create_app(engine, args.model_id or Path(args.model).stem)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
