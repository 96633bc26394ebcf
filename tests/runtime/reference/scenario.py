"""Helpers that drive byte-layer caches and the history oracle through the same steps.

A backend is a pair of converters (numpy -> its tensors, its tensors -> numpy), so one
driver serves the reference layer, the MLX layer and any kind of either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from mlx_pte.runtime.cache import CacheGeometry, LayerGeometry, LayerPolicy, Step

from .oracle import HistoryOracle


@dataclass(frozen=True)
class Backend:
    name: str
    to_tensor: Callable[[np.ndarray], Any]
    to_numpy: Callable[[Any], np.ndarray]


TORCH = Backend("reference", torch.from_numpy, lambda t: t.float().numpy())


@dataclass(frozen=True)
class StepData:
    """One step's inputs per layer: q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv] (float32)."""

    q: tuple[np.ndarray, ...]
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]


def geometry(
    windows: Sequence[int], n_kv: int, head_dim: int, v_head_dim: int | None = None
) -> CacheGeometry:
    """One layer per window (0 = flat), all with the same heads and dims."""
    policies = [LayerPolicy.from_window(w) for w in windows]
    return CacheGeometry(tuple(LayerGeometry(p, n_kv, head_dim, v_head_dim) for p in policies))


def random_step(rng: np.random.Generator, geo: CacheGeometry, n_q: int, tokens: int) -> StepData:
    qs, ks, vs = [], [], []
    for layer in geo.layers:
        qs.append(rng.standard_normal((1, n_q, tokens, layer.head_dim), np.float32))
        ks.append(rng.standard_normal((1, layer.n_kv_heads, tokens, layer.head_dim), np.float32))
        vs.append(rng.standard_normal((1, layer.n_kv_heads, tokens, layer.v_head_dim), np.float32))
    return StepData(tuple(qs), tuple(ks), tuple(vs))


def stored(data: StepData, kv_dtype: str) -> StepData:
    """``data`` with K/V as storage in ``kv_dtype`` keeps them (rounded once, to nearest)."""

    def keep(x: np.ndarray) -> np.ndarray:
        return torch.from_numpy(x).to(getattr(torch, kv_dtype)).float().numpy()

    return StepData(data.q, tuple(map(keep, data.k)), tuple(map(keep, data.v)))


def attend_all(
    cache: Any, backend: Backend, data: StepData, scale: float, softcap: float,
    sinks: Optional[np.ndarray] = None,
) -> list[np.ndarray]:
    """Every layer's output of the declared step, as numpy (``sinks``: every layer's)."""
    to = backend.to_tensor
    extra = () if sinks is None else (to(sinks),)
    return [
        backend.to_numpy(cache.attend(layer, to(q), to(k), to(v), scale, softcap, *extra))
        for layer, (q, k, v) in enumerate(zip(data.q, data.k, data.v))
    ]


def expected_all(
    oracle: HistoryOracle, step: Step, data: StepData, scale: float, softcap: float,
    sinks: Optional[np.ndarray] = None,
) -> list[np.ndarray]:
    return [
        oracle.attend(layer, step.seq_ids, step.positions, q, k, v, scale, softcap, sinks)
        for layer, (q, k, v) in enumerate(zip(data.q, data.k, data.v))
    ]


def run_and_check(
    cache: Any,
    oracle: HistoryOracle,
    step: Step,
    data: StepData,
    scale: float = 0.5,
    softcap: float = 0.0,
    atol: float = 1e-5,
    backend: Backend = TORCH,
) -> list[np.ndarray]:
    """Declare, attend every layer, check against the oracle, finish; commit the oracle."""
    cache.declare_step(step)
    got = attend_all(cache, backend, data, scale, softcap)
    cache.finish_step()
    for layer, (out, want) in enumerate(zip(got, expected_all(oracle, step, data, scale, softcap))):
        np.testing.assert_allclose(out, want, atol=atol, rtol=0, err_msg=f"layer {layer}")
    oracle.commit(step.seq_ids, step.positions, data.k, data.v)
    return got
