"""``export_hf``: a local HF checkpoint directory to a ``.pte`` file, in three stages."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from mlx_pte.ir.quantization import QuantSpec

from .hf_attention import ATTN_IMPLEMENTATION
from .hf_checkpoint import load_checkpoint, load_model
from .hf_errors import ExportOptionError
from .hf_geometry import cache_layout
from .hf_wrapper import HFWrapper, check_max_step, trace
from .manifest import build_manifest
from .program import export_program, output_path
from .quantize import check_quantizable


def export_hf(
    model_dir: Path | str,
    out: Path | str,
    dtype: str = "float32",
    max_step: int = 256,
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
        max_step: the most tokens one forward takes (prefill chunk size).
        progress: show a progress bar on stderr.
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
    with tqdm(total=3, desc="export", unit="stage", file=sys.stderr, disable=not progress) as bar:
        bar.set_postfix_str("load")
        check_max_step(max_step)
        if quantize is not None:
            check_quantizable(quantize)
        checkpoint = load_checkpoint(model_dir)
        layout = cache_layout(checkpoint.config)
        manifest = build_manifest(checkpoint, layout, dtype, max_step, quantize)
        if max_step > manifest.max_context:
            raise ExportOptionError(
                f"max_step={max_step} exceeds the model's context of {manifest.max_context} tokens"
            )
        model = load_model(checkpoint, dtype, ATTN_IMPLEMENTATION)
        bar.update()
        bar.set_postfix_str("trace")
        program = trace(HFWrapper(model, layout), max_step)
        bar.update()
        bar.set_postfix_str("lower + write" if quantize is None else "lower + quantize + write")
        path = export_program(program, out, manifest=manifest.to_dict(), fused_projections=fused_projections)
        bar.update()
    return Path(path)
