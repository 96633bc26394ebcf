"""Sampling parameters, and the host reference sampler: greedy, temperature, top-k, top-p.

Generation samples on the device (``device_sampling``); ``Sampler`` states the same
distribution in numpy, one row at a time, and is what the device sampler is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


# Temperatures below this are greedy: dividing by them only amplifies rounding noise.
GREEDY_TEMPERATURE = 1e-5


class SamplingError(ValueError):
    """Sampling parameters that cannot be used."""


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 (or below ``GREEDY_TEMPERATURE``) is greedy; ``top_k`` 0 and ``top_p`` 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class Sampler:
    """Draws tokens for one sequence; its own generator keeps the draws reproducible."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """Pick a token from one row of logits (any float dtype, shape [V])."""
        row = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.params.greedy:
            return int(np.argmax(row))
        return int(self._rng.choice(len(row), p=self.probabilities(row)))

    def probabilities(self, row: np.ndarray) -> np.ndarray:
        """The distribution sampled from: softmax(row / T) restricted by top-k then top-p."""
        p = self.params
        scaled = row / p.temperature
        keep = np.ones(len(row), dtype=bool)
        if p.top_k and p.top_k < len(row):
            kth = np.partition(scaled, -p.top_k)[-p.top_k]
            keep &= scaled >= kth
        scaled = np.where(keep, scaled, -np.inf)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            cut = int(np.searchsorted(cumulative, p.top_p)) + 1
            nucleus = np.zeros(len(row), dtype=bool)
            nucleus[order[:cut]] = True
            probs = np.where(nucleus, probs, 0.0)
            probs /= probs.sum()
        return probs
