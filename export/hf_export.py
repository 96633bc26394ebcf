"""``export_hf``: a local HF checkpoint directory to a ``.pte`` file.

The model is traced as a skeleton (``hf_checkpoint.load_skeleton``: no weights in
memory), then each weight is read from the memory-mapped checkpoint, converted,
quantized and written one at a time, so the export's memory is bounded by its largest
tensor, not by the model.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from mlx_pte.ir.quantization import QuantSpec

from .hf_attention import ATTN_IMPLEMENTATION
from .hf_checkpoint import StoredLayoutDiffers, load_checkpoint, load_model, load_skeleton, weight_sources
from .hf_errors import ExportOptionError
from .hf_geometry import cache_layout
from .hf_wrapper import MIN_MAX_STEP, HFWrapper, check_max_step, trace
from .manifest import build_manifest
from .program import export_program, output_path
from .quantize import check_quantizable

# The default bound of the traced token dimension: the model's context, up to this. The
# bound costs nothing in the program (the dimension is symbolic); the run-time prefill
# chunk (``Session(max_step=...)``) is chosen per device within it.
DEFAULT_MAX_STEP = 8192


def export_hf(
    model_dir: Path | str,
    out: Path | str,
    dtype: str = "float32",
    max_step: Optional[int] = None,
    progress: bool = True,
    quantize: Optional[QuantSpec] = None,
    fused_projections: bool = True,
) -> Path:
    """Export the causal LM in ``model_dir`` to ``out`` (never downloads).

    Args:
        model_dir: a local checkpoint directory (config.json, *.safetensors, tokenizer.json).
        out: the ``.pte`` path to write; an existing directory (or a path ending in "/")
            means ``<out>/<model_dir name>.pte``. Its directory must exist.
        dtype: weights and compute dtype: float32, bfloat16 or float16.
        max_step: the most tokens one forward of the program may take: the bound of the
            traced token dimension, within which ``Session(max_step=...)`` picks the prefill
            chunk at run time. Default: the model's context, at most DEFAULT_MAX_STEP.
        progress: show a progress bar on stderr (one step per tensor written).
        quantize: quantize linear and embedding weights (from the ``dtype`` weights) to
            this type; a weight whose shape does not divide into groups stays in ``dtype``
            (``ir.quantization.full_precision_weights`` lists them).
        fused_projections: q/k/v as one matmul and gate/up as one (``ir.fuse_projections``);
            False keeps a matmul per projection.

    Returns:
        The written path.

    Raises:
        OutputPathError: the output's directory does not exist (checked before any work).
        HFExportError: an unusable checkpoint or option; the message says what to fix.
    """
    out = output_path(out, f"{Path(model_dir).resolve().name}.pte")
    with tqdm(desc="export", unit="tensor", file=sys.stderr, disable=not progress) as bar:
        bar.set_postfix_str("load")
        if max_step is not None:
            check_max_step(max_step)
        if quantize is not None:
            check_quantizable(quantize)
        checkpoint = load_checkpoint(model_dir)
        layout = cache_layout(checkpoint.config)
        manifest = build_manifest(checkpoint, layout, dtype, max_step or DEFAULT_MAX_STEP, quantize)
        if max_step is None:  # the context is known once the manifest is built
            max_step = max(min(manifest.max_context, DEFAULT_MAX_STEP), MIN_MAX_STEP)
            manifest = replace(manifest, max_step=max_step)
        if max_step > manifest.max_context:
            raise ExportOptionError(
                f"max_step={max_step} exceeds the model's context of {manifest.max_context} tokens"
            )
        try:
            wrapper = HFWrapper(load_skeleton(checkpoint, dtype, ATTN_IMPLEMENTATION), layout)
        except StoredLayoutDiffers:
            # Weights transformers converts on load (per-expert MoE tensors) are loaded whole.
            wrapper = HFWrapper(load_model(checkpoint, dtype, ATTN_IMPLEMENTATION), layout)
        bar.set_postfix_str("trace")
        program = trace(wrapper, max_step)
        bar.set_postfix_str("lower")

        def written(name: str, index: int, count: int) -> None:
            bar.total = count
            bar.set_postfix_str(name)
            bar.update()

        path = export_program(program, out, manifest=manifest.to_dict(), sources=weight_sources(wrapper), progress=written,
                              fused_projections=fused_projections)
        bar.set_postfix_str("done")
    return Path(path)
