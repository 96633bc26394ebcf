"""An independent oracle for the MLX byte layer: full attention over logical histories.

It knows nothing of pools, slots, runs, cells or masks. Each sequence is a dict
``position -> (k, v)`` per layer; a query at position p sees the positions of its own
sequence that are ``<= p`` and, for a window w, ``> p - w``. Everything is float64
numpy; K/V are rounded to the storage dtype first, as the cache stores them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.cache import Step


def round_to(kv_dtype: str, x: np.ndarray) -> np.ndarray:
    """``x`` (float32) rounded to ``kv_dtype`` and back, computed without MLX."""
    x = np.asarray(x, np.float32)
    if kv_dtype == "float32":
        return x
    if kv_dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    # bfloat16: keep the top 16 bits of float32, rounding to nearest even.
    bits = x.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def full_attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, softcap: float,
    sinks: Optional[np.ndarray] = None,
) -> np.ndarray:
    """q [Hq, D] over keys [S, Hkv, D], values [S, Hkv, Dv] -> [Hq, Dv] (float64); sinks
    [Hq]: per-head logits that join the softmax's denominator and attend to nothing."""
    groups = q.shape[0] // keys.shape[1]
    k = np.repeat(keys.astype(np.float64), groups, axis=1)  # [S, Hq, D]
    v = np.repeat(values.astype(np.float64), groups, axis=1)
    scores = np.einsum("hd,shd->hs", q.astype(np.float64), k) * scale
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    if sinks is not None:
        scores = np.concatenate([scores, np.asarray(sinks, np.float64)[:, None]], axis=1)
    scores -= scores.max(axis=1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=1, keepdims=True)
    if sinks is not None:
        p = p[:, :-1]
    return np.einsum("hs,shd->hd", p, v)


@dataclass
class HistoryOracle:
    """Each live sequence's K/V by layer and position."""

    windows: Sequence[int]  # per layer; 0 = all history
    kv_dtype: str = "float32"
    seqs: dict[int, list[dict[int, tuple[np.ndarray, np.ndarray]]]] = field(default_factory=dict)

    def _layers(self, seq: int) -> list[dict[int, tuple[np.ndarray, np.ndarray]]]:
        if seq not in self.seqs:
            self.seqs[seq] = [dict() for _ in self.windows]
        return self.seqs[seq]

    def write(self, layer: int, seq: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self._layers(seq)[layer][pos] = (round_to(self.kv_dtype, k), round_to(self.kv_dtype, v))

    def attend(
        self, layer: int, seq: int, pos: int, q: np.ndarray, scale: float, softcap: float
    ) -> np.ndarray:
        window = self.windows[layer]
        history = self._layers(seq)[layer]
        seen = sorted(p for p in history if p <= pos and (not window or p > pos - window))
        keys = np.stack([history[p][0] for p in seen])
        values = np.stack([history[p][1] for p in seen])
        return full_attention(q, keys, values, scale, softcap)

    def fork(self, src: int, dst: int, upto: int) -> None:
        self.seqs[dst] = [
            {p: kv for p, kv in layer.items() if p < upto} for layer in self._layers(src)
        ]

    def rewind(self, seq: int, position: int) -> None:
        for layer in self._layers(seq):
            for p in [p for p in layer if p >= position]:
                del layer[p]

    def remove(self, seq: int) -> None:
        self.seqs.pop(seq, None)


@dataclass
class Driver:
    """Runs steps on a cache with random q/k/v and checks every output against the oracle.

    Args:
        cache: any MLX cache kind with a declared-step ``attend``.
        oracle: the oracle fed the same K/V.
        q_heads, kv_heads, head_dim, v_head_dim: the shapes to generate.
        rng: the source of q/k/v.
    """

    cache: object
    oracle: HistoryOracle
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    rng: np.random.Generator
    scale: float = 0.35
    softcap: float = 0.0
    q_dtype: mx.Dtype = mx.float32

    def step(
        self, seq_ids: Sequence[int], positions: Sequence[int], layers: Optional[Sequence[int]] = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Declare, attend every layer, finish; returns (got, expected) per layer."""
        step = Step(tuple(seq_ids), tuple(positions))
        self.cache.declare_step(step)
        tokens = len(step)
        results = []
        for layer in layers if layers is not None else range(len(self.oracle.windows)):
            q = self.rng.standard_normal((1, self.q_heads, tokens, self.head_dim), np.float32)
            k = self.rng.standard_normal((1, self.kv_heads, tokens, self.head_dim), np.float32)
            v = self.rng.standard_normal((1, self.kv_heads, tokens, self.v_head_dim), np.float32)
            if self.q_dtype != mx.float32:  # the oracle sees what the cache sees
                q, k, v = (np.array(mx.array(a).astype(self.q_dtype).astype(mx.float32)) for a in (q, k, v))
            out = self.cache.attend(
                layer,
                mx.array(q).astype(self.q_dtype),
                mx.array(k).astype(self.q_dtype),
                mx.array(v).astype(self.q_dtype),
                self.scale,
                self.softcap,
            )
            mx.eval(out)
            assert out.dtype == self.q_dtype
            assert tuple(out.shape) == (1, self.q_heads, tokens, self.v_head_dim)
            for t, (seq, pos) in enumerate(zip(step.seq_ids, step.positions)):
                self.oracle.write(layer, seq, pos, k[0, :, t], v[0, :, t])
            expected = np.stack(
                [
                    self.oracle.attend(layer, seq, pos, q[0, :, t], self.scale, self.softcap)
                    for t, (seq, pos) in enumerate(zip(step.seq_ids, step.positions))
                ],
                axis=1,
            )[None]
            results.append((np.array(out.astype(mx.float32)), expected))
        self.cache.finish_step()
        return results

    def check(
        self,
        seq_ids: Sequence[int],
        positions: Sequence[int],
        atol: float = 2e-5,
        layers: Optional[Sequence[int]] = None,
    ) -> None:
        """``step`` and assert every layer's output matches the oracle."""
        for i, (got, expected) in enumerate(self.step(seq_ids, positions, layers)):
            np.testing.assert_allclose(got, expected, atol=atol, rtol=1e-4, err_msg=f"layer #{i}")

    def prefill(self, seq: int, start: int, count: int, atol: float = 2e-5) -> None:
        self.check([seq] * count, range(start, start + count), atol)
