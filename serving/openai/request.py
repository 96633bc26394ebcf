"""OpenAI request bodies (completions and chat) parsed and checked into engine Requests.

No HTTP here: the app and ``run --prompts`` share it. Every field a request may carry is
either honoured or refused with a 400 naming it (``request_fields`` lists what each endpoint
takes); nothing is silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from mlx_pte.interpreter.text import TokenizerMissing

from .chat_messages import template_messages
from ..engine.requests import Request
from .output_options import parse_logprobs, parse_response_format
from .request_body import BodyError, check_value
from .request_fields import CHAT_FIELDS, COMPLETION_FIELDS, FieldError, check_fields
from ..sampling.params import SamplingError, SamplingParams
from ..text.model_text import ModelText, TextError
from ..text.stops import StopStringError, StopStrings
from .tool_calls import call_marker
from .tool_grammar import tool_call_grammar
from .tool_request import ToolUse, parse_tool_use

if TYPE_CHECKING:
    from ..sampling.grammar import Grammar

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 256


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
    tools: Optional[ToolUse] = None  # chat only


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


def _prompt(body: Mapping, model: ModelText) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return model.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")


def chat_text(model: ModelText, messages: Any, tools: Sequence[dict] = (), add_generation_prompt: bool = True) -> str:
    """A chat body's ``messages`` (and ``tools``) rendered through the model's chat template.

    Raises:
        ApiError: malformed messages, no tokenizer or template, or a template that refused them.
    """
    try:
        rendered = template_messages(messages)
    except FieldError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    if model.codec is None:
        raise ApiError(400, "this model embeds no tokenizer, so it cannot chat; use /v1/completions "
                            "with token ids", "messages")
    from jinja2 import TemplateError  # chat templates are jinja; only chat needs it

    try:
        return model.codec.render_chat(rendered, add_generation_prompt, tools=tools)
    except TokenizerMissing as exc:
        raise ApiError(400, str(exc), "messages") from None
    except TemplateError as exc:  # e.g. the template's own raise_exception on role order
        raise ApiError(400, f"the model's chat template refused these messages: {exc}", "messages") from None


def tool_use(body: Mapping, model: ModelText) -> ToolUse:
    """The tool fields of a chat body, checked against the model's chat template and tokenizer."""
    template = model.codec.chat_template if model.codec is not None else None
    try:
        use = parse_tool_use(body, template.source if template is not None else None)
    except FieldError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    marker = call_marker(use.format) if use.parses else None
    if marker is not None and model.codec is not None and model.codec.drops(marker):
        raise ApiError(400, f"this model's tokenizer makes {marker} a special token, which decoded replies leave "
                            "out, so its tool calls cannot be parsed; remove 'tools'", "tools")
    return use


def _reply_grammar(tools: Optional[ToolUse], response_format: Optional[Grammar]) -> Optional[Grammar]:
    """The grammar of the reply: ``response_format``'s, or the one that keeps tool calls valid
    (forced, or strict), never both."""
    try:
        calls = tool_call_grammar(tools) if tools is not None else None
    except FieldError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    if calls is None:
        return response_format
    if response_format is not None:
        why = (f"'tool_choice' {tools.choice!r} makes it tool calls" if tools.enforced
               else "tool calls are strict")
        raise ApiError(400, f"'response_format' cannot shape a reply whose {why}; remove one of them",
                       "response_format")
    return calls


def _informational(body: Mapping) -> None:
    """Fields taken but not used must still be well-formed."""
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "'user' must be a string", "user")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise ApiError(400, "'metadata' must be an object", "metadata")


def checked_body(body: Any, fields: frozenset[str], endpoint: str) -> dict:
    """``body`` if it is a JSON object holding only fields ``endpoint`` takes, checked for
    depth and lone surrogates before any field is used.

    Raises:
        ApiError: naming what is wrong (and the field, if one is).
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        check_value(body)
        check_fields(body, fields, endpoint)
    except BodyError as exc:
        raise ApiError(exc.status, str(exc)) from None
    except FieldError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    return body


def parse_request(body: Any, model: ModelText, chat: bool) -> ApiRequest:
    """An OpenAI completion (``chat=False``) or chat completion body as an engine Request.

    Tokenizes (and renders the chat template): call it off the event loop.

    Raises:
        ApiError: a malformed body, an unsupported parameter, or a prompt plus
            ``max_tokens`` longer than the model's context.
    """
    body = checked_body(body, CHAT_FIELDS if chat else COMPLETION_FIELDS,
                        "/v1/chat/completions" if chat else "/v1/completions")
    _informational(body)
    tools = tool_use(body, model) if chat else None
    try:
        ids = model.encode(chat_text(model, body.get("messages"), tools.tools)) if chat else _prompt(body, model)
    except (TextError, TokenizerMissing) as exc:
        raise ApiError(400, str(exc), "messages" if chat else "prompt") from None
    token_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    # Unasked, a completion takes the default or what is left of the context, if less.
    default = min(DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS, model.max_context - len(ids))
    max_tokens = _number(body, token_name, max(default, 1), int, 1)
    if len(ids) + max_tokens > model.max_context:
        raise ApiError(
            400,
            f"This model's maximum context length is {model.max_context} tokens, but {len(ids) + max_tokens} "
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
    except FieldError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    grammar = _reply_grammar(tools, grammar)
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
    return ApiRequest(request, stream, bool(options.get("include_usage")), tools)

