"""OpenAI response objects: whole replies, streamed chunks, usage, server-sent events."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .engine import Completion
from .output_options import TokenBytes, chat_logprobs, completion_logprobs

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

    def full(self, completion: Completion) -> dict:
        choices = []
        for s in completion.samples:
            reason = FINISH_REASONS.get(s.finish_reason, s.finish_reason)
            if self.chat:
                choices.append({"index": s.index, "message": {"role": "assistant", "content": s.text},
                                "logprobs": self._logprobs(s.logprobs), "finish_reason": reason})
            else:
                choices.append({"index": s.index, "text": s.text, "logprobs": self._logprobs(s.logprobs),
                                "finish_reason": reason})
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, choices, usage=usage(completion))

    def chunk(self, index: int, text: Optional[str], finish_reason: Optional[str] = None,
              role: bool = False, logprobs: Sequence = (), before: bytes = b"") -> dict:
        """One streamed choice; ``logprobs``: the records of the tokens it carries, and
        ``before`` the bytes of the choice's earlier tokens (for text offsets)."""
        reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
        shaped = self._logprobs(logprobs, before) if logprobs else None
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": shaped, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": shaped, "finish_reason": reason}
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

