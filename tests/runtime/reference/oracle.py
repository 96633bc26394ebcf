"""A cacheless attention oracle: per-sequence K/V histories in float64, full recompute.

Independent of every cache: no slots, runs, cells or masks. Each query attends the
positions its sequence holds that are not newer than its own and, on a layer of window
w, newer than ``position - w``. A step is staged, not written: ``attend`` sees the
history plus the step's tokens, and only ``commit`` makes the step history.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

# seq_id -> per layer: position -> (k [Hkv, D], v [Hkv, Dv])
History = dict[int, list[dict[int, tuple[np.ndarray, np.ndarray]]]]


@dataclass
class HistoryOracle:
    windows: tuple[int, ...]  # per layer, 0 = flat
    seqs: History = field(default_factory=dict)

    def new(self, seq_id: int) -> None:
        self.seqs[seq_id] = [{} for _ in self.windows]

    def remove(self, seq_id: int) -> None:
        del self.seqs[seq_id]

    def clone(self, src: int, dst: int, upto: int) -> None:
        self.seqs[dst] = [
            {p: kv for p, kv in layer.items() if p < upto} for layer in self.seqs[src]
        ]

    def rewind(self, seq_id: int, position: int) -> None:
        self.seqs[seq_id] = [
            {p: kv for p, kv in layer.items() if p < position} for layer in self.seqs[seq_id]
        ]

    def positions(self, seq_id: int) -> list[int]:
        return sorted(self.seqs[seq_id][0])

    def _staged(self, layer: int, seq_ids, positions, k, v) -> dict[int, dict[int, tuple]]:
        staged = {s: dict(self.seqs[s][layer]) for s in set(seq_ids)}
        for i, (s, p) in enumerate(zip(seq_ids, positions)):
            staged[s][p] = (np.asarray(k[0, :, i], np.float64), np.asarray(v[0, :, i], np.float64))
        return staged

    def attend(
        self,
        layer: int,
        seq_ids: tuple[int, ...],
        positions: tuple[int, ...],
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        scale: float,
        softcap: float = 0.0,
        sinks: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """[1, Hq, T, Dv] float64: each token over its sequence's visible positions; a
        head's sink logit, when given, adds ``exp(sink)`` to its softmax's denominator."""
        staged = self._staged(layer, seq_ids, positions, k, v)
        window = self.windows[layer]
        n_q, n_kv = q.shape[1], k.shape[1]
        out = np.zeros((1, n_q, len(seq_ids), v.shape[3]))
        for i, (s, p) in enumerate(zip(seq_ids, positions)):
            seen = [j for j in sorted(staged[s]) if j <= p and (window == 0 or j > p - window)]
            keys = np.stack([staged[s][j][0] for j in seen], axis=1)  # [Hkv, S, D]
            values = np.stack([staged[s][j][1] for j in seen], axis=1)
            for h in range(n_q):
                g = h // (n_q // n_kv)
                scores = keys[g] @ np.asarray(q[0, h, i], np.float64) * scale
                if softcap > 0:
                    scores = softcap * np.tanh(scores / softcap)
                sink = None if sinks is None else float(sinks[h])
                top = scores.max() if sink is None else max(scores.max(), sink)
                weights = np.exp(scores - top)
                denominator = weights.sum() + (0.0 if sink is None else np.exp(sink - top))
                out[0, h, i] = weights @ values[g] / denominator
        return out

    def commit(self, seq_ids, positions, ks: list[np.ndarray], vs: list[np.ndarray]) -> None:
        """Make a finished step history; ``ks[l]``/``vs[l]`` are the step's layer-l K/V."""
        for layer, (k, v) in enumerate(zip(ks, vs)):
            for s, rows in self._staged(layer, seq_ids, positions, k, v).items():
                self.seqs[s][layer] = rows
