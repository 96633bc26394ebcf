"""``/tokenize`` and ``/detokenize``, shaped as vLLM's (llama.cpp's take the same ``tokens``).

``/tokenize``: ``{"prompt": text}`` or ``{"messages": [...], "tools"?, "add_generation_prompt"?}``
(rendered by the chat template exactly as ``/v1/chat/completions`` renders them), with
``add_special_tokens`` (default true, as the server itself tokenizes prompts) →
``{"tokens": [...], "count": n, "max_model_len": context}``.
``/detokenize``: ``{"tokens": [...]}`` → ``{"prompt": text}`` (special tokens skipped, as
generated text is decoded).
"""
from __future__ import annotations

from typing import Any

from ..text.model_text import ModelText
from .request import ApiError, chat_text, checked_body, tool_use
from .request_fields import DETOKENIZE_FIELDS, TOKENIZE_FIELDS


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {value!r}", name)
    return value


def _codec(model: ModelText):
    if model.codec is None:
        raise ApiError(400, "this model embeds no tokenizer, so it cannot tokenize or detokenize text")
    return model.codec


def tokenize(body: Any, model: ModelText) -> dict:
    """The ``/tokenize`` reply to ``body``; tokenizes, so call it off the event loop.

    Raises:
        ApiError: 400 for a malformed body (naming the field).
    """
    body = checked_body(body, TOKENIZE_FIELDS, "/tokenize")
    codec = _codec(model)
    add_special = _flag(body, "add_special_tokens", True)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise ApiError(400, "give exactly one of 'prompt' (a string) or 'messages' (a chat)",
                       "messages" if has_messages else "prompt")
    if has_prompt:
        for name in ("tools", "add_generation_prompt"):
            if body.get(name) is not None:
                raise ApiError(400, f"'{name}' goes with 'messages', not 'prompt'", name)
        if not isinstance(body["prompt"], str):
            raise ApiError(400, "'prompt' must be a string", "prompt")
        text = body["prompt"]
    else:
        tools = tool_use({"tools": body.get("tools")}, model)
        text = chat_text(model, body["messages"], tools.tools, _flag(body, "add_generation_prompt", True))
    tokens = codec.encode(text, add_special_tokens=add_special)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": model.max_context}


def detokenize(body: Any, model: ModelText) -> dict:
    """The ``/detokenize`` reply to ``body``.

    Raises:
        ApiError: 400 for a malformed body or a token id outside the vocabulary.
    """
    body = checked_body(body, DETOKENIZE_FIELDS, "/detokenize")
    codec = _codec(model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
    bad = model.outside(tokens)
    if bad:
        raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {model.vocab_size})", "tokens")
    return {"prompt": codec.decode(tokens)}
