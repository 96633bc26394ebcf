"""Text generation over a Session: chunked prefill, then one token per forward."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np

from mlx_pte.runtime.cache import CacheRefused, Step

from .sampling import Sampler, SamplingParams
from .session import Session
from .text import IncrementalDecoder, TextCodec


class GenerationError(ValueError):
    """A generation that cannot start (empty prompt, no room in the cache)."""


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "eos" | "length" | "capacity"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens per second of the decode loop (the first token comes from the prefill)."""
        steps = len(self.tokens) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


def _room(session: Session, seq_id: Optional[int], n: int) -> Optional[str]:
    """Why ``n`` more tokens of this sequence do not fit, or None."""
    if not session.batched:
        return session.cache.can_extend(n).reason
    start = session.cache.pos(seq_id)
    return session.cache.check_step(Step.run(start, min(n, session.max_step), seq_id)).reason


def generate(
    session: Session,
    prompt: Union[str, Sequence[int]],
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    on_text: Optional[Callable[[str], None]] = None,
    stop_on_eos: bool = True,
) -> GenerationResult:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens.

    Args:
        session: where to run; a batched session gets a fresh sequence, removed at the end.
        prompt: text (needs the embedded tokenizer) or token ids.
        on_text: called with each new piece of text as it is generated.
    Returns:
        The generated tokens and text, why generation stopped, and timings.
    """
    codec = TextCodec(session.manifest) if (isinstance(prompt, str) or on_text) else None
    ids = codec.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise GenerationError("the prompt is empty; give at least one token")
    seq_id = session.cache.seq_new() if session.batched else None
    try:
        return _generate(session, ids, seq_id, max_new_tokens, sampling, codec, on_text, stop_on_eos)
    finally:
        if seq_id is not None:
            session.cache.seq_rm(seq_id)


def _generate(session, ids, seq_id, max_new_tokens, sampling, codec, on_text, stop_on_eos):
    reason = _room(session, seq_id, len(ids))
    if reason:
        raise GenerationError(f"the prompt ({len(ids)} tokens) does not fit: {reason}")
    result = GenerationResult(prompt_tokens=len(ids))
    sampler = Sampler(sampling)
    eos = set(session.manifest.eos_token_ids) if stop_on_eos else set()
    decoder = IncrementalDecoder(codec) if codec else None

    t0 = time.perf_counter()
    logits = None
    for at in range(0, len(ids), session.max_step):
        chunk = ids[at : at + session.max_step]
        try:
            logits = session.forward(chunk, seq_ids=seq_id, rows=[len(chunk) - 1])
        except CacheRefused as refused:
            raise GenerationError(f"the prompt does not fit: {refused.reason}") from None
    token = sampler(np.array(logits[0]))
    result.prefill_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    while True:
        result.tokens.append(token)
        if decoder and on_text:
            piece = decoder.push(token)
            if piece:
                on_text(piece)
        if token in eos:
            result.finish_reason = "eos"
            break
        if len(result.tokens) >= max_new_tokens:
            result.finish_reason = "length"
            break
        if _room(session, seq_id, 1):
            result.finish_reason = "capacity"
            break
        logits = session.forward([token], seq_ids=seq_id)
        token = sampler(np.array(logits[0]))
    result.decode_seconds = time.perf_counter() - t1
    if decoder and on_text:
        tail = decoder.flush()
        if tail:
            on_text(tail)
    if codec:
        result.text = codec.decode(result.tokens)
    return result
