"""A local Hugging Face checkpoint directory: validated, then loaded without any download.

A checkpoint is a directory holding ``config.json``, one or more ``*.safetensors`` files
(sharded is fine), ``tokenizer.json`` (embedded in the exported file so one file runs),
and optionally ``tokenizer_config.json`` (special tokens, chat template) and
``generation_config.json`` (extra eos ids).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .hf_errors import CheckpointError, ExportOptionError
from .hf_experts import route_experts

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class HFCheckpoint:
    """What the exporter needs from a checkpoint directory, read once.

    Attributes:
        path: the directory.
        config: the parsed model config.
        config_json: ``config.json`` exactly as stored (goes into the manifest).
        tokenizer_json: ``tokenizer.json`` text.
        tokenizer: the tokenizer, for its special tokens and chat template.
        generation_eos: eos ids that ``generation_config.json`` adds (empty without one).
    """

    path: Path
    config: PretrainedConfig
    config_json: dict[str, Any]
    tokenizer_json: str
    tokenizer: PreTrainedTokenizerBase
    generation_eos: tuple[int, ...]


def _one_line(exc: BaseException) -> str:
    """transformers' messages span lines; the CLI prints errors as one."""
    return " ".join(str(exc).split())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path} is not readable JSON ({_one_line(exc)}); fix or replace the file"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def as_ids(value: Any) -> tuple[int, ...]:
    """A token-id field as HF spells it (None, an int or a list) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _check_layout(root: Path) -> None:
    if not root.is_dir():
        raise CheckpointError(
            f"{root} is not a directory; pass a local Hugging Face checkpoint directory"
        )
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root} has no config.json; is it a Hugging Face checkpoint directory?")
    if not any(root.glob("*.safetensors")):
        raise CheckpointError(
            f"{root} has no *.safetensors weights; save the model with "
            "save_pretrained(safe_serialization=True)"
        )
    if not (root / "tokenizer.json").is_file():
        raise CheckpointError(
            f"{root} has no tokenizer.json; save a fast tokenizer there (tokenizer.save_pretrained)"
        )


def _check_architecture(config: PretrainedConfig) -> None:
    text = config.get_text_config()
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        raise CheckpointError(
            f"'{config.model_type}' is an encoder-decoder model; only decoder-only causal LMs export"
        )
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CheckpointError(
            f"'{config.model_type}' does not load with AutoModelForCausalLM; only decoder-only "
            "causal LMs export"
        )


def load_checkpoint(model_dir: Path | str) -> HFCheckpoint:
    """Validate ``model_dir`` and read its config and tokenizer (never downloads).

    Raises:
        CheckpointError: a missing file, unreadable JSON or an unsupported architecture.
    """
    root = Path(model_dir)
    _check_layout(root)
    config_json = _read_json(root / "config.json")
    try:
        config = AutoConfig.from_pretrained(root, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(
            f"{root}/config.json does not load with transformers: {_one_line(exc)}"
        ) from None
    _check_architecture(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"the tokenizer in {root} does not load: {_one_line(exc)}") from None
    generation = root / "generation_config.json"
    generation_eos = as_ids(_read_json(generation).get("eos_token_id")) if generation.is_file() else ()
    return HFCheckpoint(
        path=root,
        config=config,
        config_json=config_json,
        tokenizer_json=(root / "tokenizer.json").read_text(encoding="utf-8"),
        tokenizer=tokenizer,
        generation_eos=generation_eos,
    )


def load_model(checkpoint: HFCheckpoint, dtype: str, attn_implementation: str) -> torch.nn.Module:
    """The checkpoint's causal LM in eval mode, in ``dtype``, with the given attention.

    Raises:
        ExportOptionError: an unknown dtype.
        CheckpointError: weights that do not load.
    """
    if dtype not in TORCH_DTYPES:
        raise ExportOptionError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint.path,
            dtype=TORCH_DTYPES[dtype],
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
    # torch asserts its own preconditions, such as a config pad_token_id inside the embedding.
    except (ValueError, KeyError, OSError, RuntimeError, SafetensorError, AssertionError) as exc:
        raise CheckpointError(
            f"the weights in {checkpoint.path} do not load: {_one_line(exc)}"
        ) from None
    route_experts(model)
    return model.eval()
