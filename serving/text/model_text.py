"""A program's text side, as request parsing, ``/tokenize`` and the engine read it: the
codec (tokenizer and chat template), the vocabulary the grammar engine sees, and the
limits a prompt is checked against (vocabulary size, context).

Built from the manifest alone, without the program's weights or a device; the tokenizer
and the template compile when it is built (``TextCodec``), so a bad one is refused at
load, not on the first request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

from mlx_pte.interpreter.text import TextCodec

if TYPE_CHECKING:
    from mlx_pte.interpreter.chat_template import ChatTemplate
    from mlx_pte.ir.manifest import Manifest

    from ..sampling.grammar import TokenVocabulary


class TextError(ValueError):
    """Text or token ids this model cannot take; the message says what to send instead."""


@dataclass(frozen=True)
class ModelText:
    codec: Optional[TextCodec]  # None: the program embeds no tokenizer
    vocab_size: int
    eos_ids: frozenset[int]
    max_context: int
    tokenizer_json: Optional[str] = None

    @classmethod
    def of(cls, manifest: "Manifest") -> "ModelText":
        return cls(TextCodec(manifest) if manifest.tokenizer else None, manifest.vocab_size,
                   frozenset(manifest.eos_token_ids), manifest.max_context, manifest.tokenizer or None)

    @property
    def chat_template(self) -> Optional["ChatTemplate"]:
        return self.codec.chat_template if self.codec is not None else None

    def encode(self, text: str) -> list[int]:
        if self.codec is None:
            raise TextError(
                "this program embeds no tokenizer; send token ids, or re-export from a checkpoint "
                "directory that has tokenizer.json"
            )
        return self.codec.encode(text)

    def prompt_ids(self, prompt: Union[str, Sequence[int]]) -> list[int]:
        """``prompt`` as token ids, checked: not empty, every id inside the vocabulary."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise TextError("the prompt is empty; give at least one token")
        bad = self.outside(ids)
        if bad:
            raise TextError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def outside(self, ids: Sequence[int]) -> list[int]:
        """The ids in ``ids`` that name no token."""
        return [t for t in ids if not 0 <= t < self.vocab_size]

    def vocabulary(self) -> "TokenVocabulary":
        """The tokenizer as the grammar engine sees it (token bytes, eos), built on first
        use and shared.

        Raises:
            TextError: the program has no tokenizer, or the grammar engine cannot read it.
        """
        from ..sampling.grammar import GrammarError, TokenVocabulary

        if not self.tokenizer_json:
            raise TextError("structured output and logprobs need the program's tokenizer, and it embeds none")
        try:
            return TokenVocabulary.of(self.tokenizer_json, self.vocab_size, sorted(self.eos_ids))
        except GrammarError as exc:
            raise TextError(str(exc)) from None
