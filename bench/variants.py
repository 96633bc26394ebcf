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


def quantize_mlx_lm(model, config: dict, bits: Optional[int], group_size: int):
    """mlx-lm's own quantization of a loaded model (a no-op for full precision)."""
    if bits is None:
        return model
    from mlx_lm.utils import quantize_model

    model, _ = quantize_model(model, config, group_size=group_size, bits=bits)
    return model


def print_table(title: str, rows: dict[tuple[str, str], tuple[float, float]]) -> None:
    """Rows (engine, variant) -> (prefill, decode tok/s), then the ratios the quantization
    targets name: mlx-pte q4 against mlx-lm q4 and against mlx-pte at full precision."""
    print(f"\n{title}")
    print(f"{'engine':<10} {'weights':<8} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for (engine, label), (p, d) in rows.items():
        print(f"{engine:<10} {label:<8} {p:>14.1f} {d:>13.2f}")
    full = next((label for engine, label in rows if engine == "mlx-pte" and label in FULL_PRECISION), None)
    for label in QUANTIZED:
        ours = rows.get(("mlx-pte", label))
        if ours is None:
            continue
        for other in (("mlx-lm", label), ("mlx-pte", full)):
            if other in rows:
                p, d = rows[other]
                print(f"mlx-pte {label} / {other[0]} {other[1]}: prefill {ours[0] / p:.2f}x, decode {ours[1] / d:.2f}x")
