"""Fixtures of the MLX byte-layer tests."""
from __future__ import annotations

import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx


class SdpaLog(list):
    """The masks handed to MLX's fused SDPA, in call order; ``shapes`` holds q's shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []


@pytest.fixture
def sdpa_masks(monkeypatch) -> SdpaLog:
    log = SdpaLog()
    real = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask=None, **kwargs):
        log.append(mask)
        log.shapes.append(tuple(q.shape))
        return real(q, k, v, scale=scale, mask=mask, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    return log
