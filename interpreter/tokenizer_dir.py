"""A tokenizer for a program that carries none, read from a Hugging Face checkpoint directory.

Upstream ExecuTorch's MLX programs hold no tokenizer, so ``load(path, tokenizer=HF_DIR)``
takes it from the checkpoint the program was exported from, with the fields mlx-pte's own
export embeds: ``tokenizer.json``; the chat template (``tokenizer_config.json``'s
``chat_template`` or ``chat_template.jinja``); bos/eos/pad ids from the special tokens of
``tokenizer_config.json``, ``generation_config.json``'s eos ids and ``config.json``; and
``config.json`` itself. Only JSON and the ``tokenizers`` library are used (no transformers).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from tokenizers import Tokenizer


class TokenizerDirError(ValueError):
    """The directory given as a tokenizer cannot be used; the message says what is missing."""


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise TokenizerDirError(f"{path} is not valid JSON: {exc}") from None
    return value if isinstance(value, dict) else {}


def _token_id(tokenizer: Tokenizer, token: Any) -> Optional[int]:
    """The id of a special token given as text or as ``{"content": text}``."""
    text = token.get("content") if isinstance(token, dict) else token
    return tokenizer.token_to_id(text) if isinstance(text, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)] if isinstance(value, list) else []


def _first(*candidates: Any) -> Optional[int]:
    return next((c for group in candidates for c in _ids(group)), None)


def tokenizer_fields(hf_dir: Union[str, Path]) -> dict:
    """The manifest fields of the tokenizer in ``hf_dir`` (config included when present).

    Raises:
        TokenizerDirError: no directory, no ``tokenizer.json``, or a file that does not parse.
    """
    root = Path(hf_dir)
    if not root.is_dir():
        raise TokenizerDirError(f"--tokenizer {root}: not a directory (give the model's Hugging Face checkpoint directory)")
    path = root / "tokenizer.json"
    if not path.is_file():
        raise TokenizerDirError(f"--tokenizer {root}: the directory has no tokenizer.json")
    text = path.read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerDirError(f"{path} does not load: {exc}") from None
    settings = _json(root / "tokenizer_config.json")
    config = _json(root / "config.json")
    generation = _json(root / "generation_config.json")
    template = settings.get("chat_template")
    template_file = root / "chat_template.jinja"
    if not isinstance(template, str) and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    eos = [_token_id(tokenizer, settings.get("eos_token"))] + _ids(generation.get("eos_token_id"))
    fields = {
        "tokenizer": text,
        "chat_template": template if isinstance(template, str) and template else None,
        "bos_token_id": _first(_token_id(tokenizer, settings.get("bos_token")), config.get("bos_token_id")),
        "eos_token_ids": list(dict.fromkeys(i for i in eos if i is not None)),
        "pad_token_id": _first(_token_id(tokenizer, settings.get("pad_token")), config.get("pad_token_id")),
    }
    if config:
        fields["config"] = config
    return fields
