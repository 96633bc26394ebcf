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
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Mxfp4Config,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .hf_errors import CheckpointError, ExportOptionError
from .experts_layout import Conversion, convert_in_place
from .hf_experts import route_experts
from .safetensors_file import CheckpointTensor, SafetensorsFiles
from .tensor_source import DTYPE_NAMES, ComputedSource

# The dtypes a model exports in.
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


class StoredLayoutDiffers(CheckpointError):
    """The checkpoint's tensors are not the model's parameters one to one (transformers
    renames or merges them on load, as it merges per-expert MoE weights): the skeleton
    cannot name a tensor for each placeholder, and the model is loaded whole instead."""


# The attribute of a skeleton's placeholder tensor naming where its value comes from.
_SOURCE_ATTR = "_mlx_pte_source"


def load_skeleton(checkpoint: HFCheckpoint, dtype: str, attn_implementation: str) -> torch.nn.Module:
    """The checkpoint's causal LM as ``load_model`` gives it, without its weights.

    Tracing needs each weight's shape and dtype, never its value, so every parameter (and
    every persistent buffer) is a placeholder holding no memory: one element broadcast to
    its shape, on the CPU like the real one, so the traced graph is exactly the one the
    real model gives. Each placeholder names its checkpoint tensor (``weight_sources``),
    read only when the exporter writes it. Non-persistent buffers (rotary frequencies,
    embedding scales) are not in the checkpoint; they are computed as ``from_pretrained``
    computes them.

    Raises:
        ExportOptionError: an unknown dtype.
        StoredLayoutDiffers: the checkpoint stores the weights under other names.
        CheckpointError: a weight the model needs is missing from the checkpoint or has
            another shape there.
    """
    if dtype not in TORCH_DTYPES:
        raise ExportOptionError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                checkpoint.config, dtype=TORCH_DTYPES[dtype], attn_implementation=attn_implementation
            )
    # torch asserts its own preconditions, such as a config pad_token_id inside the embedding.
    except (ValueError, KeyError, RuntimeError, AssertionError) as exc:
        raise CheckpointError(f"the model in {checkpoint.path} does not build: {_one_line(exc)}") from None
    _compute_non_persistent_buffers(model)
    route_experts(model)
    files = SafetensorsFiles(checkpoint.path)
    placeholders: dict[int, torch.Tensor] = {}
    persistent = [n for n, _ in model.named_buffers() if n not in dict(model.named_non_persistent_buffers())]
    for name in [n for n, _ in model.named_parameters(remove_duplicate=False)] + persistent:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        table = owner._parameters if attr in owner._parameters else owner._buffers
        meta = table[attr]
        if id(meta) not in placeholders:
            placeholders[id(meta)] = _placeholder(meta, _checkpoint_tensor(model, files, meta, name))
        table[attr] = placeholders[id(meta)]
    convert_in_place(model, _converted_placeholder)
    return model.eval()


def _converted_placeholder(old: torch.nn.Parameter, conversion: Conversion) -> torch.Tensor:
    """A placeholder of ``conversion``'s shape whose value is ``conversion`` of ``old``'s source."""
    source = getattr(old, _SOURCE_ATTR)
    like = torch.nn.Parameter(torch.empty(conversion.shape, dtype=old.dtype, device="meta"), requires_grad=False)
    return _placeholder(like, ComputedSource(conversion.fn, (source,), conversion.shape, source.dtype))


def _converted_parameter(old: torch.nn.Parameter, conversion: Conversion) -> torch.nn.Parameter:
    with torch.no_grad():
        return torch.nn.Parameter(conversion.fn(old.detach()), requires_grad=False)


def _compute_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Give the meta model's non-persistent buffers their values, as ``from_pretrained``
    does: real storage, then the model's own initialisation of them."""
    for name, buffer in list(model.named_non_persistent_buffers()):
        parent, _, attr = name.rpartition(".")
        model.get_submodule(parent)._buffers[attr] = torch.empty_like(buffer, device="cpu")
    for param in model.parameters():
        param._is_hf_initialized = True  # meta placeholders: nothing to initialise
    for module in model.modules():
        module._is_hf_initialized = False
    model.initialize_weights()


def _checkpoint_tensor(model: torch.nn.Module, files: SafetensorsFiles, meta: torch.Tensor, name: str) -> CheckpointTensor:
    """Where the value of ``name`` (or of any name tied to it) is stored."""
    aliases = [n for n, p in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()] if p is meta]
    key = next((n for n in aliases if n in files), None)
    if key is None and set(files.names()) - {n for n, _ in model.state_dict(keep_vars=True).items()}:
        raise StoredLayoutDiffers(
            f"the checkpoint stores {name!r} under other names (transformers converts them on load)"
        )
    if key is None:
        raise CheckpointError(
            f"the checkpoint has no tensor {name!r} (nor {', '.join(repr(a) for a in aliases if a != name) or 'an alias'}); "
            "it was saved from another architecture or is incomplete"
        )
    stored = files.names()[key]
    if stored != tuple(meta.shape):
        raise CheckpointError(
            f"the checkpoint's {key!r} has shape {list(stored)}, the config needs {list(meta.shape)}; "
            "config.json and the weights disagree"
        )
    return CheckpointTensor(files, key, tuple(meta.shape), DTYPE_NAMES[meta.dtype])


class _PlaceholderParameter(torch.nn.Parameter):
    """A parameter holding no memory. ``nn.Parameter`` deep-copies through a dense clone,
    which would allocate the whole weight each time ExecuTorch copies the program; a
    placeholder copies as another placeholder."""

    def __deepcopy__(self, memo: dict) -> "_PlaceholderParameter":
        if id(self) not in memo:
            memo[id(self)] = _placeholder(self, getattr(self, _SOURCE_ATTR, None))
        return memo[id(self)]


def _placeholder(like: torch.Tensor, source: Optional[CheckpointTensor]) -> torch.Tensor:
    """One element broadcast to ``like``'s shape, naming ``source``."""
    value = torch.empty((), dtype=like.dtype).expand(like.shape)
    tensor = _PlaceholderParameter(value, requires_grad=False) if isinstance(like, torch.nn.Parameter) else value
    if source is not None:
        setattr(tensor, _SOURCE_ATTR, source)
    return tensor


def weight_sources(module: torch.nn.Module) -> dict[str, CheckpointTensor]:
    """The checkpoint tensor behind each placeholder of a skeleton (``load_skeleton``) under
    ``module``, by its state-dict name in ``module`` (tied names each listed)."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {name: getattr(t, _SOURCE_ATTR) for name, t in named if hasattr(t, _SOURCE_ATTR)}


def _dequantizing(config: PretrainedConfig) -> dict[str, Any]:
    """``from_pretrained`` options that dequantize an MXFP4 checkpoint on load (gpt-oss ships
    its experts so): transformers does so by itself only where it has no MXFP4 kernel, and
    elsewhere keeps packed experts modules that do not export."""
    quantization = getattr(config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    return {"quantization_config": Mxfp4Config(dequantize=True)} if str(getattr(method, "value", method)) == "mxfp4" else {}


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
            **_dequantizing(checkpoint.config),
        )
    # torch asserts its own preconditions, such as a config pad_token_id inside the embedding.
    except (ValueError, KeyError, OSError, RuntimeError, SafetensorError, AssertionError) as exc:
        raise CheckpointError(
            f"the weights in {checkpoint.path} do not load: {_one_line(exc)}"
        ) from None
    route_experts(model)
    convert_in_place(model, _converted_parameter)
    return model.eval()
