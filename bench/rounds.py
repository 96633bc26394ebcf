"""Engines interleaved round by round: each round runs every engine once, in turn, so a
drift in the machine's speed (±30% within minutes on a shared GPU) hits all engines of
a round alike. Rates are summarized by their medians, and ratios by the median of the
per-round ratios, which is the figure that survives such drift.
"""
from __future__ import annotations

import statistics
from typing import Callable, Optional, TypeVar

from decode_table import Key, Rates

R = TypeVar("R")


def run_rounds(runners: dict[Key, Callable[[], Rates]], rounds: int) -> dict[Key, list[Rates]]:
    """Every runner's rates, one per round, the runners called in turn within a round."""
    out: dict[Key, list[Rates]] = {key: [] for key in runners}
    for number in range(rounds):
        for key, run in runners.items():
            rates = run()
            out[key].append(rates)
            print(f"round {number + 1}/{rounds} {key[0]} {key[1]}: prefill {rates.prefill_tps:.1f} tok/s, "
                  f"decode {rates.decode_tps:.2f} tok/s", flush=True)
    return out


def _median(values: list[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def median_rates(per_round: list[Rates]) -> Rates:
    return Rates(statistics.median(r.prefill_tps for r in per_round),
                 statistics.median(r.decode_tps for r in per_round),
                 _median([r.host_ms for r in per_round]), _median([r.device_ms for r in per_round]))


def round_ratios(rounds: dict[Key, list[Rates]]) -> dict[tuple[Key, Key], tuple[float, float]]:
    """(mlx-pte row, other row) -> median over rounds of (prefill, decode) mlx-pte / other,
    for every other engine of the same weights label (every mlx-pte-* row is an mlx-pte row)."""
    out = {}
    for ours in [key for key in rounds if key[0].startswith("mlx-pte")]:
        for other in rounds:
            if other[1] != ours[1] or other == ours:
                continue
            out[ours, other] = (median_ratio(rounds[ours], rounds[other], lambda r: r.prefill_tps),
                                median_ratio(rounds[ours], rounds[other], lambda r: r.decode_tps))
    return out


def median_ratio(ours: list[R], other: list[R], rate: Callable[[R], float]) -> float:
    """Median over rounds of ``rate(ours) / rate(other)``, the lists paired round by round."""
    return statistics.median(rate(a) / rate(b) for a, b in zip(ours, other, strict=True))


def print_round_ratios(rounds: dict[Key, list[Rates]]) -> None:
    ratios = round_ratios(rounds)
    if not ratios:
        return
    count = len(next(iter(rounds.values())))
    print(f"\nmedian of per-round ratios ({count} rounds):")
    for (ours, other), (prefill, decode) in ratios.items():
        print(f"  {ours[0]} {ours[1]} / {other[0]} {other[1]}: prefill {prefill:.2f}x, decode {decode:.2f}x")
