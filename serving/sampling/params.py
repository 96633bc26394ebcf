"""Sampling parameters, and the host reference sampler: greedy, temperature, top-k, top-p.

Generation samples on the device (``device_sampling``); ``Sampler`` states the same
distribution in numpy, one row at a time, and is what the device sampler is tested against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


class SamplingError(ValueError):
    """Sampling parameters that cannot be used."""


# Below this temperature softmax(row / T) is one-hot for any logits a model produces
# (a gap of 1e-3 between the two best logits already gives exp(-100)), so sampling is
# greedy; it also keeps row / T far from float64's overflow.
GREEDY_TEMPERATURE = 1e-5
# numpy's generators take any non-negative seed; one that fits a signed 64-bit integer
# is what other OpenAI-compatible servers accept, and keeps seed + sample index small.
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    ``temperature`` is finite and >= 0; below ``GREEDY_TEMPERATURE`` (0 included) the
    choice is greedy. ``top_k`` >= 0 keeps the k most likely tokens (0: all); ``top_p``
    in (0, 1] keeps the smallest nucleus of that mass (1.0: all). ``seed`` is None or
    an integer in [0, MAX_SEED].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not _real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise SamplingError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE



def _real(value: object) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


class Sampler:
    """Draws tokens for one sequence; its own generator keeps the draws reproducible."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """Pick a token from one row of logits (any float dtype, shape [V])."""
        row = np.asarray(logits, dtype=np.float64).reshape(-1)
        if not np.isfinite(row).all():
            raise SamplingError("the model produced logits that are inf or NaN; no token can be chosen")
        if self.params.greedy:
            return int(np.argmax(row))
        return int(self._rng.choice(len(row), p=self.probabilities(row)))

    def probabilities(self, row: np.ndarray) -> np.ndarray:
        """The distribution sampled from: softmax(row / T) restricted by top-k then top-p.

        ``row`` is finite float64. Shifting by the maximum before dividing keeps every
        scaled logit in [-(spread / T), 0]: exp never overflows and the best token has
        weight 1, so the sum is at least 1 (no 0/0).
        """
        p = self.params
        with np.errstate(over="ignore"):  # a spread past float64's range gives -inf: weight 0
            scaled = (row - row.max()) / max(p.temperature, GREEDY_TEMPERATURE)
        keep = np.ones(len(row), dtype=bool)
        if p.top_k and p.top_k < len(row):
            kth = np.partition(row, -p.top_k)[-p.top_k]
            keep &= row >= kth
        probs = np.where(keep, np.exp(scaled), 0.0)
        probs /= probs.sum()
        if p.top_p < 1.0:
            # Ranked by logit: a huge temperature can make distinct logits equally likely,
            # and the nucleus must still keep the best of them.
            order = np.argsort(-row, kind="stable")
            cumulative = np.cumsum(probs[order])
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            cut = int(np.searchsorted(cumulative, p.top_p)) + 1
            nucleus = np.zeros(len(row), dtype=bool)
            nucleus[order[:cut]] = True
            probs = np.where(nucleus, probs, 0.0)
            probs /= probs.sum()
        return probs
