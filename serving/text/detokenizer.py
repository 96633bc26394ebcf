"""Streaming detokenization: token ids in, text pieces out as soon as they are final."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

__all__ = ["Decodes", "IncrementalDecoder"]


class Decodes(Protocol):
    byte_tokens: frozenset[int]
    skipped_tokens: frozenset[int]

    def decode(self, ids: Sequence[int]) -> str: ...


_SPLIT = "\ufffd"  # what a multi-byte character cut between tokens decodes to


@dataclass
class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces, decoding only the newest tokens.

    Each push decodes a short window: the tokens since the last released boundary, plus
    the last tokens released before them that showed text, as context (byte-level BPE
    merges, a sentencepiece word start). Text ending in U+FFFD is held back, since a
    multi-byte character may still be split across tokens, and so is text ending in a
    byte-fallback token; a boundary where the text does not end so
    is a character boundary, so the pieces add up to ``decode(all ids)``. A decoder whose
    window text does not extend its context (it rewrites earlier text) falls back to
    decoding everything.
    """

    codec: Decodes
    ids: list[int] = field(default_factory=list)
    emitted: str = ""
    _context: int = 0  # the window starts here
    _released: int = 0  # text up to here has been released

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (a last character may stay incomplete)."""
        return self._advance(final=True)

    def _in_byte_run(self) -> bool:
        """Whether the last token the decoder sees is a byte-fallback token."""
        if not self.codec.byte_tokens:
            return False
        for token in reversed(self.ids):
            if token not in self.codec.skipped_tokens:
                return token in self.codec.byte_tokens
        return False

    def _advance(self, final: bool) -> str:
        context = self.codec.decode(self.ids[self._context : self._released])
        window = self.codec.decode(self.ids[self._context :])
        if not final and (window.endswith(_SPLIT) or self._in_byte_run()):
            return ""
        if window.startswith(context):
            piece = window[len(context) :]
        else:
            text = self.codec.decode(self.ids)
            piece = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += piece
        # The next window's context must show text: decoders strip the first word's
        # space, so a window starting with invisible tokens would lose the space.
        if piece:
            self._context = self._released
        self._released = len(self.ids)
        return piece
