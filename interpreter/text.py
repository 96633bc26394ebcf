"""Text in and out through the tokenizer embedded in the manifest (no transformers)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from tokenizers import Tokenizer

from mlx_pte.ir.manifest import Manifest


class TokenizerMissing(ValueError):
    """The program carries no tokenizer, so it takes token ids, not text."""


class TextCodec:
    def __init__(self, manifest: Manifest) -> None:
        if not manifest.tokenizer:
            raise TokenizerMissing(
                "this .pte embeds no tokenizer (upstream ExecuTorch exports carry none): pass "
                "--tokenizer HF_DIR (load(path, tokenizer=HF_DIR)) naming the model's checkpoint "
                "directory, or give token ids"
            )
        self._tokenizer = Tokenizer.from_str(manifest.tokenizer)
        self.chat_template = manifest.chat_template
        self.bos_token_id = manifest.bos_token_id
        self.eos_token_ids = manifest.eos_token_ids

    def encode(self, text: str) -> list[int]:
        """Token ids as HF's tokenizer gives them (special tokens the template adds included)."""
        return self._tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat, through the manifest's chat template."""
        if not self.chat_template:
            raise TokenizerMissing("this model has no chat template; send a plain completion prompt")
        import jinja2  # only chat needs it

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        special = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        }
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **special)

    def _token_text(self, token_id: Optional[int]) -> str:
        if token_id is None:
            return ""
        return self._tokenizer.id_to_token(token_id) or ""


@dataclass
class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces, holding back split characters."""

    codec: TextCodec
    ids: list[int] = field(default_factory=list)
    emitted: str = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.codec.decode(self.ids)
        # A multi-byte character split across tokens decodes as U+FFFD until complete.
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        piece = text[len(self.emitted) :]
        self.emitted = text
        return piece

    def flush(self) -> str:
        text = self.codec.decode(self.ids)
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
