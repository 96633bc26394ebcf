"""Text in and out through the tokenizer embedded in the manifest (no transformers)."""
from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence

from tokenizers import Tokenizer

from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.manifest import Manifest

from .chat_template import DEFAULT_BUDGET, ChatTemplate, ChatTemplateError

__all__ = ["ChatTemplateError", "TextCodec", "TokenizerError", "TokenizerMissing", "checked_manifest"]


class TokenizerMissing(ValueError):
    """The program carries no tokenizer, so it takes token ids, not text."""


class TokenizerError(ValueError):
    """The manifest's tokenizer.json does not build a tokenizer."""


class TextCodec:
    """Encoding, decoding and chat rendering through a manifest's tokenizer and template.

    ``template_budget``: the CPU seconds one chat render may take (``render_chat`` reads it
    on each call, so a server sets it from ``serve --template-budget``).

    Raises:
        TokenizerMissing: the manifest has no tokenizer.
        TokenizerError: the manifest's tokenizer JSON does not build a tokenizer.
        ChatTemplateError: the manifest's chat template does not compile.
    """

    def __init__(self, manifest: Manifest, template_budget: float = DEFAULT_BUDGET) -> None:
        if not manifest.tokenizer:
            raise TokenizerMissing(
                "this .pte embeds no tokenizer (upstream ExecuTorch exports carry none): pass "
                "--tokenizer HF_DIR (load(path, tokenizer=HF_DIR)) naming the model's checkpoint "
                "directory, or give token ids"
            )
        self._tokenizer = build_tokenizer(manifest.tokenizer)
        self.chat_template = ChatTemplate(manifest.chat_template) if manifest.chat_template else None
        self.template_budget = template_budget
        self.bos_token_id = manifest.bos_token_id
        self.eos_token_ids = manifest.eos_token_ids
        self.pad_token_id = manifest.pad_token_id
        self.byte_tokens = _byte_fallback_tokens(self._tokenizer)
        # decode() drops these before the decoder sees the rest.
        self.skipped_tokens = frozenset(
            t["id"] for t in json.loads(self._tokenizer.to_str())["added_tokens"] if t.get("special")
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids as HF's tokenizer gives them (with ``add_special_tokens``, those its
        post-processor adds, such as a bos token)."""
        # encode_batch releases the GIL (encode does not), so a long prompt tokenized on a
        # worker thread does not stall the server's event loop.
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def drops(self, token_text: str) -> bool:
        """Whether ``token_text`` is one special token, whose text decoding leaves out."""
        token_id = self._tokenizer.token_to_id(token_text)
        return token_id is not None and token_id in self.skipped_tokens

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Optional[Sequence[dict]] = None) -> str:
        """The prompt text for a chat, through the manifest's chat template (sandboxed).

        ``tools`` (OpenAI function tools) reach the template as HF passes them: the list as
        given, or None when there are none.

        Raises:
            TokenizerMissing: the model has no chat template.
            ChatTemplateError: the template failed, refused these messages, or ran past
                ``template_budget``.
        """
        if self.chat_template is None:
            raise TokenizerMissing("this model has no chat template; send a plain completion prompt")
        # The special tokens HF passes a template (its special_tokens_map), as far as the manifest has them.
        special = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            "pad_token": self._token_text(self.pad_token_id),
        }
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         tools=list(tools) if tools else None, budget=self.template_budget,
                                         **special)

    def _token_text(self, token_id: Optional[int]) -> str:
        if token_id is None:
            return ""
        return self._tokenizer.id_to_token(token_id) or ""


@lru_cache(maxsize=8)
def build_tokenizer(tokenizer_json: str) -> Tokenizer:
    """The tokenizer of a manifest's tokenizer.json text, built once per text (building a real
    tokenizer takes a noticeable fraction of a second; every codec of a program shares it).

    Raises:
        TokenizerError: the text is not a tokenizer.json the ``tokenizers`` library accepts.
    """
    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # tokenizers raises plain Exception for a malformed file
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenizerError(f"the manifest's tokenizer does not build: {first_line}") from None


def checked_manifest(fields: Mapping[str, Any]) -> Manifest:
    """The manifest of ``fields`` as the loader accepts it: every field's type and range
    (``Manifest.from_dict``), a tokenizer that builds and a chat template that compiles (both
    are cached for the codecs made later, and a broken one is refused at load rather than at
    the first request).

    The exporter calls this on a manifest before it writes a file, so a file it writes loads.

    Raises:
        FormatError: naming the field and what is wrong with it.
    """
    manifest = Manifest.from_dict(fields)
    try:
        if manifest.tokenizer:
            build_tokenizer(manifest.tokenizer)
        if manifest.chat_template:
            ChatTemplate(manifest.chat_template)
    except (TokenizerError, ChatTemplateError) as exc:
        raise FormatError(str(exc)) from None
    return manifest


def _byte_fallback_tokens(tokenizer: Tokenizer) -> frozenset[int]:
    """The ``<0xNN>`` tokens, when the decoder joins runs of them (ByteFallback): a run
    decodes as a whole, to its UTF-8 text or to one U+FFFD per byte if invalid, so text
    that ends in one is final only once the run ends."""
    if "ByteFallback" not in json.dumps(json.loads(tokenizer.to_str()).get("decoder")):
        return frozenset()
    return frozenset(i for t, i in tokenizer.get_vocab().items() if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t))
