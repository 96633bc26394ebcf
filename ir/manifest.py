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
# The dtypes a model is exported in (weights, activations, and the KV cache by default).
MODEL_DTYPES = ("float32", "bfloat16", "float16")


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
        """Parse and validate every field's type and range; FormatError naming the first bad field."""
        if not isinstance(d, Mapping):
            raise FormatError("the manifest must be a JSON object")
        version = d.get("format_version")
        if not _is_int(version) or version > MANIFEST_VERSION:
            raise FormatError(
                f"manifest version {version!r} is not supported (this mlx-pte reads up to "
                f"{MANIFEST_VERSION}); upgrade mlx-pte"
            )
        cache = _field(d, "cache", list)
        if not cache:
            raise FormatError("the manifest declares no cache layers; was this exported from an LLM?")
        layers = []
        for i, layer in enumerate(cache):
            if not isinstance(layer, Mapping):
                raise FormatError(f"the manifest's cache[{i}] must be an object, got {layer!r}")
            layers.append(CacheLayerSpec(**{
                name: _count(layer, name, 0 if name == "window" else 1, f"cache[{i}].{name}")
                for name in CacheLayerSpec.__dataclass_fields__
            }))  # fmt: skip
        vocab_size = _count(d, "vocab_size", 1)
        eos = d.get("eos_token_ids") or []
        if not isinstance(eos, list):
            raise FormatError(f"the manifest's eos_token_ids must be a list of token ids, got {eos!r}")
        # bos is embedded and eos sampled, so both lie inside the embedding. A pad id is never
        # embedded (padding never reaches the model), so, as in HF, it may lie past the
        # vocabulary: a tokenizer that adds its pad token after the model's rows is valid.
        embedded = [("bos_token_id", d.get("bos_token_id")), *((f"eos_token_ids[{i}]", v) for i, v in enumerate(eos))]
        for name, value in embedded:
            if value is not None and not (_is_int(value) and 0 <= value < vocab_size):
                raise FormatError(f"the manifest's {name} must be a token id below {vocab_size}, got {value!r}")
        pad = d.get("pad_token_id")
        if pad is not None and not (_is_int(pad) and pad >= 0):
            raise FormatError(f"the manifest's pad_token_id must be a token id (an integer >= 0), got {pad!r}")
        dtype = _field(d, "dtype", str)
        if dtype not in MODEL_DTYPES:
            raise FormatError(f"the manifest's dtype must be one of {', '.join(MODEL_DTYPES)}, got {dtype!r}")
        return cls(
            config=dict(_field(d, "config", dict)),
            dtype=dtype,
            vocab_size=vocab_size,
            cache=tuple(layers),
            max_step=_count(d, "max_step", 1),
            max_context=_count(d, "max_context", 1),
            tokenizer=_field(d, "tokenizer", str, optional=True),
            chat_template=_field(d, "chat_template", str, optional=True),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos),
            pad_token_id=pad,
            format_version=version,
            extra=dict(_field(d, "extra", dict, optional=True) or {}),
            quantization=None if d.get("quantization") is None else QuantSpec.from_dict(d["quantization"]),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_JSON_NAMES = {dict: "an object", list: "a list", str: "a string"}


def _field(d: Mapping[str, Any], name: str, kind: type, optional: bool = False) -> Any:
    value = d.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, kind):
        what = "missing" if name not in d else f"{type(value).__name__} {value!r}"[:80]
        raise FormatError(f"the manifest's {name} must be {_JSON_NAMES[kind]}, got {what}")
    return value


def _count(d: Mapping[str, Any], name: str, minimum: int, label: Optional[str] = None) -> int:
    value = d.get(name)
    if not _is_int(value) or value < minimum:
        raise FormatError(f"the manifest's {label or name} must be an integer >= {minimum}, got {value!r}")
    return value
