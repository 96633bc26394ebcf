"""Logits of a short prefill and decode, for comparing a program's load-time forms."""
from __future__ import annotations

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.interpreter.session import Session

PROMPT = [3, 17, 5, 9, 11, 2, 30, 8, 1, 4]


def logits_of(program, capture: bool) -> np.ndarray:
    """Logits of a prefill of PROMPT then three decode steps, stacked."""
    session = Session(program, capacity=32, capture=capture)
    out = [np.array(session.forward(PROMPT, rows=range(len(PROMPT))).astype(mx.float32))]
    for token in (7, 12, 6):
        out.append(np.array(session.forward([token]).astype(mx.float32)))
    return np.concatenate([o.reshape(-1, o.shape[-1]) for o in out])
