"""The decode benches' table: one row per (engine, weights), speeds, the mlx-pte step's
host / device split, and ratios mlx-pte / engine within each weight variant; then the
ratios the quantization targets name (q4 against mlx-lm q4 and against full precision).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from variants import FULL_PRECISION, QUANTIZED

# The mlx-pte rows a variant's ratios are taken against, best first: captured, else walked.
MLX_PTE_ROWS = ("mlx-pte", "mlx-pte-walk", "mlx-pte-thread", "mlx-pte-walk-thread")


@dataclass(frozen=True)
class Rates:
    """Prefill and decode tok/s; for mlx-pte also ms per decode step spent building the
    step's lazy graph (host) and in ``mx.eval`` of it with nothing else in flight (device:
    MLX's scheduling and the kernels)."""

    prefill_tps: float
    decode_tps: float
    host_ms: Optional[float] = None
    device_ms: Optional[float] = None


Key = tuple[str, str]  # (engine, weights label)


def reference(rows: dict[Key, Rates], label: str) -> Optional[Rates]:
    """The mlx-pte row of ``label`` that ratios are taken against."""
    return next((rows[e, label] for e in MLX_PTE_ROWS if (e, label) in rows), None)


def _ms(value: Optional[float]) -> str:
    return f"{value:>8.2f}" if value is not None else f"{'':>8}"


def print_table(title: str, rows: dict[Key, Rates]) -> None:
    full = next((label for _, label in rows if label in FULL_PRECISION), None)
    print(f"\n{title}")
    print(f"{'engine':<17} {'weights':<7} {'prefill tok/s':>13} {'decode tok/s':>12} {'host ms':>8} "
          f"{'dev ms':>8} {'prefill x':>9} {'decode x':>8}")
    for (engine, label), r in rows.items():
        # Full-precision peers (HF) are compared with mlx-pte at the full-precision label.
        base = reference(rows, label) or (reference(rows, full) if label in FULL_PRECISION else None)
        ratio = f"{base.prefill_tps / r.prefill_tps:>9.2f} {base.decode_tps / r.decode_tps:>8.2f}" if base else ""
        print(f"{engine:<17} {label:<7} {r.prefill_tps:>13.1f} {r.decode_tps:>12.2f} {_ms(r.host_ms)} "
              f"{_ms(r.device_ms)} {ratio}")
    print("(x = the variant's mlx-pte speed, captured where that row ran, / the row's speed; host ms = building "
          "one decode step's graph, dev ms = mx.eval of it alone, nothing else in flight)")
    for label in QUANTIZED:
        ours = reference(rows, label)
        if ours is None:
            continue
        for name, other in ((f"mlx-lm {label}", rows.get(("mlx-lm", label))), (f"mlx-pte {full}", reference(rows, full))):
            if other is not None:
                print(f"mlx-pte {label} / {name}: prefill {ours.prefill_tps / other.prefill_tps:.2f}x, "
                      f"decode {ours.decode_tps / other.decode_tps:.2f}x")
