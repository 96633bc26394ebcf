"""The manifest: everything a runner needs to know about an exported model, in one JSON
object inside the payload (config, dtype, special tokens, chat template, tokenizer,
cache geometry per ``cache_id``, step and context limits).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from .errors import FormatError
from .quantization import QuantSpec

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class CacheLayerSpec:
    """One cache layer (``cache_id``): window 0 = flat history, > 0 = sliding window."""

    window: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Manifest:
    config: dict
    dtype: str
    vocab_size: int
    cache: tuple[CacheLayerSpec, ...]
    max_step: int
    max_context: int
    tokenizer: Optional[str] = None  # tokenizer.json text
    chat_template: Optional[str] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: Optional[int] = None
    format_version: int = MANIFEST_VERSION
    extra: dict = field(default_factory=dict)
    quantization: Optional[QuantSpec] = None  # the type of the quantized linear/embedding weights

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cache"] = [asdict(c) for c in self.cache]
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.quantization is None:
            del d["quantization"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Manifest":
        """Parse and validate; FormatError naming the first bad field."""
        if not isinstance(d, Mapping):
            raise FormatError("the manifest must be a JSON object")
        version = d.get("format_version")
        if not isinstance(version, int) or version > MANIFEST_VERSION:
            raise FormatError(
                f"manifest version {version!r} is not supported (this mlx-pte reads up to "
                f"{MANIFEST_VERSION}); upgrade mlx-pte"
            )
        try:
            cache = tuple(CacheLayerSpec(**{k: int(layer[k]) for k in CacheLayerSpec.__dataclass_fields__})
                          for layer in d["cache"])
            manifest = cls(
                config=dict(d["config"]),
                dtype=str(d["dtype"]),
                vocab_size=int(d["vocab_size"]),
                cache=cache,
                max_step=int(d["max_step"]),
                max_context=int(d["max_context"]),
                tokenizer=d.get("tokenizer"),
                chat_template=d.get("chat_template"),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(int(i) for i in d.get("eos_token_ids") or ()),
                pad_token_id=d.get("pad_token_id"),
                format_version=version,
                extra=dict(d.get("extra") or {}),
                quantization=None if d.get("quantization") is None else QuantSpec.from_dict(d["quantization"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"the manifest is malformed ({type(exc).__name__}: {exc})") from None
        if not manifest.cache:
            raise FormatError("the manifest declares no cache layers; was this exported from an LLM?")
        if manifest.max_step < 1 or manifest.max_context < 1:
            raise FormatError("the manifest's max_step and max_context must be positive")
        return manifest
