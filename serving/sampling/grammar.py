"""Constraining generated text to a grammar: JSON schemas, any JSON object, Lark, regex.

The engine is llguidance (chosen by ``bench/grammar_engines.py``: sub-millisecond compiles,
a mask in ~10 µs per token at the median on a 49k vocabulary, and no torch). Three pieces:

``Grammar``
    What the text must match, checked when built (a bad schema or grammar is a
    ``GrammarError`` naming the problem, before any request reaches the engine)::

        Grammar.json_object()                        # any JSON object
        Grammar.json_schema({"type": "object", ...}) # an instance of this schema
        Grammar.regex(r"(yes|no)")
        Grammar.lark('start: "<tool_call>" call "</tool_call>"\\n'
                     f"call: {json_schema_rule(schema)}")

    ``json_schema_rule(schema)`` is the Lark right-hand side matching one instance of
    ``schema`` (llguidance's ``%json`` directive), so a format that wraps JSON in fixed
    text, such as a tool call, is one Lark grammar. Lark syntax (llguidance's dialect):
    https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md. Quoted strings
    match text; a model's special tokens are written ``<|name|>`` or ``<[id]>``.

``TokenVocabulary``
    A program's tokenizer as the grammar engine sees it (token bytes, eos ids), built
    once per tokenizer (``TokenVocabulary.of(tokenizer_json, vocab_size, eos_ids)``
    caches it; building takes ~0.3 s on a 49k vocabulary).

``Matcher``
    One sample's position in the grammar: ``vocabulary.matcher(grammar)``. Per token:
    ``fill_mask(row)`` writes the allowed-token bitmask (int32 words, bit ``t % 32`` of
    word ``t // 32`` set when token ``t`` may come next; eos is allowed only where the
    grammar accepts), then ``consume(token)`` advances. ``done`` says that nothing but eos
    may follow. ``masks(matchers, vocabulary)`` stacks the rows of a batch (None: no
    constraint, every bit set) for ``token_masks.apply_masks`` on the device.

JSON is generated in the layout of ``json.dumps``'s defaults (``", "``, ``": "``, no other
whitespace), so a model cannot pad its output with whitespace forever.
"""
from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

__all__ = ["Grammar", "GrammarError", "Matcher", "TokenVocabulary", "json_schema_rule", "masks", "mask_words"]

# How generated JSON is laid out: one fixed layout keeps a model from emitting whitespace
# without end; json.dumps's defaults are what models have seen most.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar the engine cannot use, or a token the grammar does not allow."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError(
            "structured output needs llguidance: pip install 'mlx-pte[serve]' (or pip install llguidance)"
        ) from None
    return llguidance


@contextlib.contextmanager
def _engine_errors(what: str):
    """llguidance's Rust panics arrive as pyo3's PanicException, a BaseException that
    would get past every ``except Exception``: they become GrammarErrors."""
    try:
        yield
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise GrammarError(f"{what}: the grammar engine failed ({exc})") from None


def mask_words(vocab_size: int) -> int:
    """int32 words in one token bitmask row."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class Grammar:
    """A constraint on generated text, in llguidance's serialized form.

    Build one with the class methods; ``description`` names it in messages.
    """

    serialized: str
    description: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> "Grammar":
        """Text that parses as JSON and validates against ``schema`` (a JSON Schema object).

        Raises:
            GrammarError: the schema is not an object, or uses what the engine cannot
                enforce (the message names it).
        """
        if not isinstance(schema, Mapping):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        llg = _llguidance()
        try:
            with _engine_errors("the JSON schema cannot be used"):
                serialized = llg.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_LAYOUT)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema cannot be used: {exc}") from None
        return cls._checked(serialized, "the JSON schema")

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """Text matching a Lark grammar (start rule ``start``); see the module docstring."""
        return cls._checked(_llguidance().LLMatcher.grammar_from_lark(text), "the Lark grammar")

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """Text matching a regular expression as a whole (Rust ``regex`` syntax)."""
        return cls._checked(_llguidance().LLMatcher.grammar_from_regex(pattern), "the regular expression")

    @classmethod
    def _checked(cls, serialized: str, description: str) -> "Grammar":
        with _engine_errors(f"{description} cannot be used"):
            error = _llguidance().LLMatcher.validate_grammar(serialized, None)
        if error:
            raise GrammarError(f"{description} cannot be used: {error.strip()}")
        return cls(serialized, description)


def json_schema_rule(schema: Mapping[str, Any]) -> str:
    """The Lark rule body matching one JSON instance of ``schema``, laid out as
    ``Grammar.json_schema`` lays it out (for a Lark grammar that embeds JSON)."""
    return "%json " + json.dumps({**dict(schema), "x-guidance": _JSON_LAYOUT})


class TokenVocabulary:
    """A tokenizer as the grammar engine sees it: every token's bytes and the eos ids."""

    _cache: dict[tuple[str, int, tuple[int, ...]], "TokenVocabulary"] = {}
    _cache_lock = threading.Lock()

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        if not eos_ids:
            raise GrammarError("structured output needs the model's eos token ids, and this program has none")
        llg = _llguidance()
        try:
            self._tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        except Exception as exc:  # llguidance raises plain exceptions for tokenizers it cannot read
            raise GrammarError(f"the grammar engine cannot read this tokenizer: {exc}") from None
        self._llg = llg
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)

    @classmethod
    def of(cls, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> "TokenVocabulary":
        """The vocabulary of this tokenizer, built on first use and then shared."""
        key = (tokenizer_json, vocab_size, tuple(eos_ids))
        with cls._cache_lock:
            if key not in cls._cache:
                cls._cache[key] = cls(tokenizer_json, vocab_size, eos_ids)
            return cls._cache[key]

    def matcher(self, grammar: Grammar) -> "Matcher":
        """A fresh matcher at the start of ``grammar``.

        Raises:
            GrammarError: the grammar does not compile against this vocabulary.
        """
        with _engine_errors(f"{grammar.description} cannot be used"):
            inner = self._llg.LLMatcher(self._tokenizer, grammar.serialized, log_level=0)
        if inner.is_error():
            raise GrammarError(f"{grammar.description} cannot be used: {inner.get_error()}")
        return Matcher(inner, self.vocab_size)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token ``token`` stands for (special tokens: their text)."""
        return self._tokenizer.decode_bytes([token])


class Matcher:
    """One sample's progress through a grammar; used by one thread at a time."""

    def __init__(self, inner, vocab_size: int) -> None:
        self._inner = inner
        self.vocab_size = vocab_size

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (C-contiguous int32 ``[mask_words(V)]``)."""
        if row.dtype != np.int32 or row.shape != (mask_words(self.vocab_size),) or not row.flags.c_contiguous:
            raise ValueError(f"a mask row is C-contiguous int32 of shape ({mask_words(self.vocab_size)},)")
        with _engine_errors("the grammar failed"):
            self._inner.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._inner.is_error():
            raise GrammarError(f"the grammar failed: {self._inner.get_error()}")

    def consume(self, token: int) -> None:
        """Advance by ``token``. Raises GrammarError if the grammar does not allow it."""
        with _engine_errors(f"token {token} could not be taken"):
            taken = self._inner.consume_token(token)
        if not taken:
            raise GrammarError(f"token {token} is not allowed here: {self._inner.get_error()}")

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match."""
        return self._inner.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing but eos may follow (the match is complete and cannot grow)."""
        return self._inner.is_stopped()


def masks(matchers: Sequence[Optional[Matcher]], vocab_size: int,
          on_error: Optional[Callable[[int, GrammarError], None]] = None) -> np.ndarray:
    """The bitmask rows of a batch of draws (int32 ``[N, mask_words(V)]``); a row without a
    matcher allows every token.

    A matcher that fails raises its GrammarError, or, given ``on_error``, is reported as
    ``on_error(row index, error)`` and its row left allowing every token, so the other
    rows still get their masks.
    """
    out = np.full((len(matchers), mask_words(vocab_size)), -1, dtype=np.int32)
    for i, (row, matcher) in enumerate(zip(out, matchers)):
        if matcher is None:
            continue
        try:
            matcher.fill_mask(row)
        except GrammarError as exc:
            if on_error is None:
                raise
            on_error(i, exc)
            row[:] = -1
    return out
