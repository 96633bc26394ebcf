"""OpenAI response objects: whole replies, streamed chunks, usage, server-sent events."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..engine import Completion, SampleResult
from .output_options import TokenBytes, chat_logprobs, completion_logprobs
from .tool_calls import ToolCall, ToolCallStream, parse_reply
from .tool_request import ToolUse

# Finish reasons in OpenAI's vocabulary: running out of cache is a length limit too.
FINISH_REASONS = {"stop": "stop", "length": "length", "capacity": "length"}


@dataclass(frozen=True)
class Reply:
    """Builds the response objects of one request (ids and timestamps shared by chunks).

    With ``vocabulary`` (the request asked for logprobs) each choice carries its tokens'
    log-probabilities, spelled through the vocabulary's token bytes.
    """

    model: str
    chat: bool
    id: str
    created: int
    vocabulary: Optional[TokenBytes] = None

    @classmethod
    def new(cls, model: str, chat: bool, vocabulary: Optional[TokenBytes] = None) -> "Reply":
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(model, chat, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), vocabulary)

    def _logprobs(self, records: Sequence, before: bytes = b"") -> Optional[dict]:
        if self.vocabulary is None:
            return None
        if self.chat:
            return chat_logprobs(records, self.vocabulary)
        return completion_logprobs(records, self.vocabulary, before)

    def _object(self, kind: str, choices: list, **extra: Any) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def full(self, completion: Completion, tools: Optional[ToolUse] = None) -> dict:
        """The whole reply; with ``tools`` that parse, each chat message's calls in ``tool_calls``."""
        choices = []
        for s in completion.samples:
            reason = FINISH_REASONS.get(s.finish_reason, s.finish_reason)
            if self.chat:
                message, reason = _message(s, reason, tools)
                choices.append({"index": s.index, "message": message, "logprobs": self._logprobs(s.logprobs),
                                "finish_reason": reason})
            else:
                choices.append({"index": s.index, "text": s.text, "logprobs": self._logprobs(s.logprobs),
                                "finish_reason": reason})
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, choices, usage=usage(completion))

    def chunk(self, index: int, text: Optional[str], finish_reason: Optional[str] = None,
              role: bool = False, calls: Sequence[tuple[int, ToolCall]] = (), logprobs: Sequence = (),
              before: bytes = b"") -> dict:
        """A streamed chunk of sample ``index``; ``calls``: (its index among the sample's
        calls, the call) for each call complete in this chunk; ``logprobs``: the records of
        the tokens it carries, and ``before`` the bytes of the choice's earlier tokens (for
        text offsets)."""
        reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
        shaped = self._logprobs(logprobs, before) if logprobs else None
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [{"index": i, **call.openai()} for i, call in calls]
            choice = {"index": index, "delta": delta, "logprobs": shaped, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": shaped, "finish_reason": reason}
        return self._object("text_completion", [choice])

    def sample_chunks(self, index: int, tools: Optional[ToolUse]) -> "SampleChunks":
        return SampleChunks(self, index, ToolCallStream(tools.format, tools.max_calls)
                            if tools is not None and tools.parses else None)

    def usage_chunk(self, completion: Completion) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=usage(completion))


class SampleChunks:
    """The chunks of one streamed sample: text as it comes, each tool call once complete
    (OpenAI's clients accept a call's arguments in one delta), and each token's logprobs
    in the first chunk its event makes (one of its own if the event's text is held back)."""

    def __init__(self, reply: Reply, index: int, calls: Optional[ToolCallStream]) -> None:
        self._reply = reply
        self._index = index
        self._calls = calls
        self._sent = 0  # calls sent so far
        self._bytes = b""  # the bytes of the tokens whose logprobs were sent (text offsets)

    def on(self, text: str, finish_reason: Optional[str], logprobs: Sequence = ()) -> list[dict]:
        """The chunks an event (new ``text``, the sample's end if ``finish_reason``, and
        its token's ``logprobs`` records) makes."""
        if self._calls is None:
            out = [self._reply.chunk(self._index, text, finish_reason)] if text or finish_reason else []
        else:
            out = []
            for piece in self._calls.feed(text) + (self._calls.finish() if finish_reason else []):
                if isinstance(piece, str):
                    out.append(self._reply.chunk(self._index, piece))
                else:
                    out.append(self._reply.chunk(self._index, None, calls=[(self._sent, piece)]))
                    self._sent += 1
            if finish_reason:
                out.append(self._reply.chunk(self._index, None, _called(finish_reason, self._sent > 0)))
        if logprobs:
            if not out:
                out.append(self._reply.chunk(self._index, None))
            first = out[0]["choices"][0]
            first["logprobs"] = self._reply._logprobs(logprobs, self._bytes)
            vocabulary = self._reply.vocabulary
            if vocabulary is not None:
                self._bytes += b"".join(vocabulary.token_bytes(r.token) for r in logprobs)
        return out


def _called(reason: str, called: bool) -> str:
    """OpenAI's finish reason for a sample that ended with tool calls."""
    return "tool_calls" if called and FINISH_REASONS.get(reason, reason) == "stop" else reason


def _message(sample: SampleResult, reason: str, tools: Optional[ToolUse]) -> tuple[dict, str]:
    """A chat choice's message and finish reason ("tool_calls" when it called)."""
    if tools is None or not tools.parses:
        return {"role": "assistant", "content": sample.text}, reason
    parsed = parse_reply(tools.format, sample.text, tools.max_calls)
    message: dict = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [call.openai() for call in parsed.calls]
    return message, _called(reason, bool(parsed.calls))


def usage(completion: Completion) -> dict:
    """Token counts; ``cached_tokens``: leading prompt tokens forked from a retained prompt."""
    generated = sum(len(s.tokens) for s in completion.samples)
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": generated,
            "total_tokens": completion.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": completion.stats.cached_tokens}}


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"

