"""Weight variants shared by the decode benches: full precision, q8 and q4 (affine, MLX's
packing), named by label, for mlx-pte (an export with ``--quantize``) and for mlx-lm
(``mlx_lm.utils.quantize_model``, what ``mlx_lm.convert -q`` applies, on the same weights).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

FULL_PRECISION = ("fp32", "bf16", "fp16")
QUANTIZED = {"q8": 8, "q4": 4}


def bits_of(label: str) -> Optional[int]:
    """None for a full-precision label, else the bits of a quantized one."""
    if label in FULL_PRECISION:
        return None
    if label not in QUANTIZED:
        raise SystemExit(f"unknown variant {label!r}: use one of {', '.join(FULL_PRECISION + tuple(QUANTIZED))}")
    return QUANTIZED[label]


def parse_pte(arg: str, default_label: str) -> tuple[str, Path]:
    """``LABEL=PATH`` or a bare ``PATH`` (labelled ``default_label``)."""
    label, sep, path = arg.partition("=")
    if not sep:
        return default_label, Path(arg)
    bits_of(label)
    return label, Path(path)


def load_mlx_lm(model_dir: Path, dtype: str, bits: Optional[int] = None, group_size: int = 64):
    """mlx-lm's model of ``model_dir``, cast to ``dtype``, then quantized by mlx-lm itself
    (``bits`` None: left at full precision)."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load as mlx_lm_load

    model, _ = mlx_lm_load(str(model_dir))
    model.update(tree_map(lambda p: p.astype(getattr(mx, dtype)), model.parameters()))
    if bits is None:
        return model
    from mlx_lm.utils import quantize_model

    config = json.loads((Path(model_dir) / "config.json").read_text())
    model, _ = quantize_model(model, config, group_size=group_size, bits=bits)
    return model
