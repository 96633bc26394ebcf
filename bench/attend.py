"""Decode-step attention time of the MLX cache kinds, in one process run.

A Llama-1B-like geometry (16 flat layers, 8 KV heads, head_dim 64, 32 query heads,
float32) holds B sequences of HISTORY positions each; a decode step gives every
sequence one token. Time per step = ``declare_step`` + ``attend`` on every layer +
``mx.eval`` of the outputs + ``finish_step``, median over the timed steps (at least
64 / B of them). Kinds are interleaved per step so machine load hits them alike.

    .venv/bin/python bench/attend.py [--history 512 --batches 1,2,4,8,16,32 --steps 8]

Target: batched-sequence never more than 5% slower than batched-cell, and at least
1.3x faster at B=32.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core: fast BLAS)
import mlx.core as mx

import mlx_pte.runtime.mlx  # noqa: F401  (registers backend "mlx")
from mlx_pte.runtime.cache import CACHE_FACTORY, CacheConfig, CacheGeometry, LayerPolicy, Step

LAYERS, KV_HEADS, HEAD_DIM, Q_HEADS = 16, 8, 64, 32
SCALE = HEAD_DIM**-0.5
GEOMETRY = CacheGeometry.uniform([LayerPolicy.flat()] * LAYERS, KV_HEADS, HEAD_DIM)


class Subject:
    """One cache of one kind holding ``batch`` sequences of ``history`` positions."""

    def __init__(self, kind: str, batch: int, history: int, steps: int) -> None:
        self.kind = kind
        capacity = batch * (history + steps)
        self.cache = CACHE_FACTORY.build("mlx", kind, GEOMETRY, CacheConfig(capacity=capacity))
        self.seqs = [self.cache.seq_new() for _ in range(batch)] if kind != "single" else [0]
        rng = np.random.default_rng(0)
        self.q = mx.array(rng.standard_normal((1, Q_HEADS, batch, HEAD_DIM), np.float32))
        self.kv = mx.array(rng.standard_normal((1, KV_HEADS, batch, HEAD_DIM), np.float32))
        self._fill(history, rng)

    def _fill(self, history: int, rng: np.random.Generator) -> None:
        """Write each sequence's history. Prefill outputs are never evaluated, so MLX
        computes only the pool writes (a lazy graph runs what is asked for)."""
        kv = mx.array(rng.standard_normal((1, KV_HEADS, history, HEAD_DIM), np.float32))
        q = kv  # any [1, 8, T, 64] works as a query: 8 query heads is valid GQA
        for seq in self.seqs:
            self.cache.declare_step(Step((seq,) * history, tuple(range(history))))
            for layer in range(LAYERS):
                self.cache.attend(layer, q, kv, kv, SCALE)
            self.cache.finish_step()
            mx.eval([p.k.data for p in self.cache._pools] + [p.v.data for p in self.cache._pools])

    def step(self) -> float:
        """One timed decode step, in seconds."""
        start = time.perf_counter()
        positions = self._positions()
        self.cache.declare_step(Step(tuple(self.seqs), positions))
        outs = [self.cache.attend(layer, self.q, self.kv, self.kv, SCALE) for layer in range(LAYERS)]
        mx.eval(outs)
        self.cache.finish_step()
        return time.perf_counter() - start

    def _positions(self) -> tuple[int, ...]:
        if self.kind == "single":
            return (self.cache.pos(),)
        return tuple(self.cache.pos(s) for s in self.seqs)


def bench(batch: int, history: int, steps: int, warmup: int) -> dict[str, float]:
    """Median decode-step ms per kind at one batch size."""
    kinds = ["batched-cell", "batched-sequence"] + (["single"] if batch == 1 else [])
    subjects = [Subject(kind, batch, history, steps + warmup) for kind in kinds]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i in range(steps + warmup):
        # Rotate who goes first, so no kind always runs right after another's eval.
        for subject in subjects[i % len(subjects) :] + subjects[: i % len(subjects)]:
            t = subject.step()
            if i >= warmup:
                times[subject.kind].append(t)
    return {kind: statistics.median(ts) * 1e3 for kind, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=512, help="positions each sequence holds")
    parser.add_argument("--batches", default="1,2,4,8,16,32", help="comma-separated sequence counts")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per kind (at least 64 / B)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps first")
    args = parser.parse_args()

    print(f"decode step, {LAYERS} layers, Hq {Q_HEADS}, Hkv {KV_HEADS}, D {HEAD_DIM}, float32, "
          f"history {args.history}, device {mx.default_device()}, BLAS {mlx_pte.runtime.mlx.blas.loaded_path()}")
    print(f"{'B':>3} {'cell ms':>9} {'sequence ms':>12} {'single ms':>10} {'cell / sequence':>16}")
    for batch in (int(b) for b in args.batches.split(",")):
        # Small batches are quick and noisier: give them more steps.
        ms = bench(batch, args.history, max(args.steps, 64 // batch), args.warmup)
        single = f"{ms['single']:>10.2f}" if "single" in ms else f"{'':>10}"
        ratio = ms["batched-cell"] / ms["batched-sequence"]
        print(f"{batch:>3} {ms['batched-cell']:>9.2f} {ms['batched-sequence']:>12.2f} {single} {ratio:>16.2f}",
              flush=True)
    print("(cell / sequence > 1: batched-sequence is faster)")


if __name__ == "__main__":
    main()
