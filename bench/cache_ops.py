"""Time the neutral cache layer's step protocol for every kind.

Each kind holds 64 sequences of ~1000 positions in a 65,536 capacity (``single`` holds
one sequence of 1000) with a flat + ring geometry, then times ``declare_step`` (which
validates and plans) and ``finish_step`` (which commits) for a decode step (one token per
sequence) and a 512-token prefill of a fresh sequence. The cell layout's mask inputs are
built by the byte layer once per step; they are timed separately.

Run: ``.venv/bin/python bench/cache_ops.py``. Target: declare + finish < 1 ms per decode.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from mlx_pte.runtime.cache import (
    BatchedSequenceCache,
    CacheConfig,
    CacheGeometry,
    CellCache,
    LayerPolicy,
    SingleCache,
    Step,
)

CAPACITY = 65_536
N_SEQS = 64
HELD = 1000
PREFILL = 512
WINDOW = 1024
N_LAYERS = 32
REPS = 200

GEOMETRY = CacheGeometry.uniform(
    [LayerPolicy.flat() if i % 2 else LayerPolicy.ring(WINDOW) for i in range(N_LAYERS)],
    n_kv_heads=8,
    head_dim=128,
)
CONFIG = CacheConfig(capacity=CAPACITY, max_write=PREFILL)


@dataclass
class Row:
    kind: str
    case: str
    declare_us: float
    finish_us: float
    extra_us: float | None = None


def median_us(fn: Callable[[], object], setup: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn`` in µs, with ``setup`` run untimed before each rep."""
    times = []
    for _ in range(reps):
        setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def fill(cache, seqs: int) -> list[int]:
    """``seqs`` sequences of ``HELD`` positions each, prefilled in max_write chunks."""
    ids = [cache.seq_new() for _ in range(seqs)]
    for seq_id in ids:
        pos = 0
        while pos < HELD:
            n = min(PREFILL, HELD - pos)
            step = Step((seq_id,) * n, tuple(range(pos, pos + n)))
            cache.declare_step(step)
            cache.finish_step()
            pos += n
    return ids


def time_step(cache, step: Step, undo: Callable[[], None]) -> tuple[float, float]:
    """(declare µs, finish µs); ``undo`` restores the state after each finish, untimed."""
    declare = median_us(lambda: cache.declare_step(step), lambda: None, REPS)
    finish = median_us(cache.finish_step, lambda: (undo(), cache.declare_step(step)), REPS)
    undo()
    return declare, finish


def cell_mask_us(cache: CellCache, step: Step) -> float:
    """Building a fresh plan's mask inputs for each distinct window (the byte layer's job)."""
    windows = sorted(set(cache.step_plan.layer_windows)) if cache.is_declared else [0]

    def build() -> None:
        plan = cache.step_plan
        for w in windows:
            plan.mask(w)

    return median_us(build, lambda: cache.declare_step(step), max(REPS // 4, 20))


def bench_kind(name: str, make: Callable[[], object]) -> list[Row]:
    cache = make()
    # One more sequence than the decode batch must fit for the prefill case to start fresh.
    batched = cache.max_seqs() is None or cache.max_seqs() > N_SEQS
    ids = fill(cache, N_SEQS if batched else 1)
    rows = []

    decode = Step(tuple(ids), tuple(cache.pos(s) for s in ids))
    d, f = time_step(cache, decode, lambda: [cache.rewind(s, HELD) for s in ids])
    extra = None
    if isinstance(cache, CellCache):
        cache.declare_step(decode)
        extra = cell_mask_us(cache, decode)
    rows.append(Row(name, f"decode {len(ids)}x1", d, f, extra))

    if not batched:
        cache.clear()
    fresh = cache.seq_new()
    prefill = Step.run(0, PREFILL, fresh)
    undo = lambda: cache.rewind(fresh, 0)  # noqa: E731
    d, f = time_step(cache, prefill, undo)
    extra = None
    if isinstance(cache, CellCache):
        cache.declare_step(prefill)
        extra = cell_mask_us(cache, prefill)
    rows.append(Row(name, f"prefill {PREFILL}", d, f, extra))
    return rows


def main() -> None:
    rows: list[Row] = []
    for name, cls in (
        ("single", SingleCache),
        ("batched-sequence", BatchedSequenceCache),
        ("batched-cell", CellCache),
    ):
        rows.extend(bench_kind(name, lambda cls=cls: cls(GEOMETRY, CONFIG)))
    print(
        f"neutral cache step protocol: capacity {CAPACITY}, {N_SEQS} sequences x {HELD} "
        f"positions, {N_LAYERS} layers (flat + ring({WINDOW})), max_write {PREFILL}; "
        f"median of {REPS} reps"
    )
    print(f"{'kind':<18} {'case':<13} {'declare µs':>11} {'finish µs':>10} {'total µs':>9}"
          f" {'cell masks µs':>14}")
    for r in rows:
        extra = f"{r.extra_us:14.1f}" if r.extra_us is not None else f"{'-':>14}"
        print(f"{r.kind:<18} {r.case:<13} {r.declare_us:11.1f} {r.finish_us:10.1f} "
              f"{r.declare_us + r.finish_us:9.1f} {extra}")
    slow = [r for r in rows if r.case.startswith("decode") and r.declare_us + r.finish_us > 1000]
    print("decode target (< 1000 µs declare + finish):", "met" if not slow else
          "MISSED by " + ", ".join(r.kind for r in slow))


if __name__ == "__main__":
    main()
