"""Text generation over a Session: chunked prefill, then one token per forward."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from mlx_pte.runtime.cache import CacheRefused

from .sampling.device import TokenStream, draw
from .sampling.params import SamplingParams
from mlx_pte.interpreter.session import Session
from mlx_pte.interpreter.text import TextCodec

from .text.detokenizer import IncrementalDecoder


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


def generate(
    session: Session,
    prompt: Union[str, Sequence[int]],
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    on_text: Optional[Callable[[str], None]] = None,
    stop_on_eos: bool = True,
    seq_id: Optional[int] = None,
) -> GenerationResult:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens.

    Args:
        session: where to run.
        prompt: text (needs the embedded tokenizer) or token ids.
        on_text: called with each new piece of text as it is generated.
        seq_id: a live sequence to continue (the prompt follows what it holds, and it
            keeps the result); by default a fresh sequence, removed at the end.
    Returns:
        The generated tokens and text, why generation stopped, and timings.
    Raises:
        GenerationError: an empty prompt, one that does not fit, or no sequence free.
    """
    codec = TextCodec(session.manifest) if (isinstance(prompt, str) or on_text) else None
    ids = codec.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise GenerationError("the prompt is empty; give at least one token")
    if seq_id is not None:
        return _generate(session, ids, seq_id, max_new_tokens, sampling, codec, on_text, stop_on_eos)
    try:
        fresh = session.cache.seq_new()
    except CacheRefused as refused:
        raise GenerationError(f"no sequence is free for the prompt: {refused.reason}") from None
    try:
        return _generate(session, ids, fresh, max_new_tokens, sampling, codec, on_text, stop_on_eos)
    finally:
        session.cache.seq_rm(fresh)


def _generate(session, ids, seq_id, max_new_tokens, sampling, codec, on_text, stop_on_eos):
    cache = session.cache
    reason = cache.can_extend(seq_id, len(ids)).reason
    if reason:
        raise GenerationError(f"the prompt ({len(ids)} tokens) does not fit: {reason}")
    result = GenerationResult(prompt_tokens=len(ids))
    stream = TokenStream.start(sampling)
    eos = set(session.manifest.eos_token_ids) if stop_on_eos else set()
    decoder = IncrementalDecoder(codec) if codec else None

    launcher = session.launcher
    t0 = time.perf_counter()
    logits = None
    with launcher.building():
        for at in range(0, len(ids), session.max_step):
            chunk = ids[at : at + session.max_step]
            try:
                logits = session.forward(chunk, seq_ids=seq_id, rows=[len(chunk) - 1], evaluate=False)
            except CacheRefused as refused:
                raise GenerationError(f"the prompt does not fit: {refused.reason}") from None
        # Tokens are chosen on the device: only their ids come back, never the logits.
        pending = draw(logits, [stream])
    launched = launcher.launch([pending], readable=[pending])
    t1 = 0.0
    while True:
        # The next step is built from the still-unevaluated token, so the host builds step
        # n+1 while the device computes step n; the cache needs only its position.
        more = len(result.tokens) + 1 < max_new_tokens and bool(cache.can_extend(seq_id, 1))
        if more:
            with launcher.building():
                following = draw(session.forward(pending, seq_ids=seq_id, evaluate=False), [stream])
            following_launched = launcher.launch([following], readable=[following])
        token = int(launched.read().item())
        if not result.tokens:
            t1 = time.perf_counter()
            result.prefill_seconds = t1 - t0
        result.tokens.append(token)
        if decoder and on_text:
            piece = decoder.push(token)
            if piece:
                on_text(piece)
        if token in eos:
            result.finish_reason = "eos"
            if more:  # it was fed already; the cache ends before the last token, as always
                cache.rewind(seq_id, cache.pos(seq_id) - 1)
            break
        if not more:
            result.finish_reason = "length" if len(result.tokens) >= max_new_tokens else "capacity"
            break
        pending, launched = following, following_launched
    result.decode_seconds = time.perf_counter() - t1
    if decoder and on_text:
        tail = decoder.flush()
        if tail:
            on_text(tail)
    if codec:
        result.text = codec.decode(result.tokens)
    return result
