"""Logits of a short prefill and decode, and op names, for comparing a program's load-time
forms."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.interpreter import program as program_module
from mlx_pte.interpreter.session import Session

PROMPT = [3, 17, 5, 9, 11, 2, 30, 8, 1, 4]


def op_names(graph) -> list[str]:
    """The ops of ``graph``'s instructions, in order."""
    return [instr.op for instr in graph.instructions]


def logits_of(program, capture: bool) -> np.ndarray:
    """Logits of a prefill of PROMPT then three decode steps, stacked."""
    session = Session(program, capacity=32, capture=capture)
    out = [np.array(session.forward(PROMPT, rows=range(len(PROMPT))).astype(mx.float32))]
    for token in (7, 12, 6):
        out.append(np.array(session.forward([token]).astype(mx.float32)))
    return np.concatenate([o.reshape(-1, o.shape[-1]) for o in out])


def assert_rewrite_is_exact(path: Path, monkeypatch, rewrite: str, fused: set[str], capture: bool) -> None:
    """The file at ``path`` gives the same logits, bit for bit, loaded as usual and with the
    load-time rewrite ``rewrite`` (its name in ``interpreter.program``) skipped, which then
    leaves none of the ``fused`` ops in the program that runs."""
    rewritten = program_module.load(path)
    monkeypatch.setattr(program_module, rewrite, lambda graph: graph)
    plain = program_module.load(path)
    assert not fused & {instr.op for instr in plain.run_graph.instructions}
    np.testing.assert_array_equal(logits_of(rewritten, capture), logits_of(plain, capture))
