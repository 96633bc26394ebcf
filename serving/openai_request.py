"""OpenAI request bodies (completions and chat) parsed and checked into engine Requests.

No HTTP here: the app and ``run --prompts`` share it. Every field a request may carry is
either honoured or refused with a 400 naming it; nothing is silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from mlx_pte.interpreter.text import TokenizerMissing

from .engine import Engine, EngineError, Request
from .output_options import OptionError, parse_logprobs, parse_response_format
from .request_body import BodyError, check_value
from .sampling import SamplingError, SamplingParams
from .stops import StopStringError, StopStrings

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 256
# Parameters this server cannot honour: a request asking for them is refused, not ignored.
UNSUPPORTED = ("echo", "logit_bias", "tools", "functions", "suffix")
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
    try:
        grammar = parse_response_format(body.get("response_format"))
        logprobs = parse_logprobs(body, chat)
    except OptionError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    request = Request(
        prompt=ids,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stops(body),
        n=_number(body, "n", 1, int, 1),
        ignore_eos=ignore_eos,
        grammar=grammar,
        logprobs=logprobs,
    )
    return ApiRequest(request, stream, bool(options.get("include_usage")))

