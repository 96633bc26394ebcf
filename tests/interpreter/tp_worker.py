"""One rank of the two-process parity test (tests/interpreter/test_tensor_parallel.py).

Loads each given .pte whole and as this rank's shard, runs the same greedy generation on
both for every cache kind, capture off and on, and exits non-zero unless the tokens are
equal and the logits within 1e-5. Run with MLX_RANK and MLX_HOSTFILE set.
"""
from __future__ import annotations

import sys

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (load an optimized BLAS before mlx.core)
import mlx.core as mx

from mlx_pte.interpreter.program import Program, load
from mlx_pte.runtime.cache import KINDS

PROMPT = [1, 5, 9, 33, 70, 2, 11, 400, 17, 3]  # longer than the tiny models' window of 4
NEW_TOKENS = 12
TOLERANCE = 1e-5


def greedy(program, kind: str, capture: bool) -> tuple[list[int], np.ndarray]:
    session = program.session(kind, capture=capture, capacity=64)
    seq = None if kind == "single" else session.cache.seq_new()
    tokens, logits = list(PROMPT), []
    step = list(PROMPT)
    for _ in range(NEW_TOKENS + 1):
        logits.append(np.array(session.forward(step, seq_ids=seq)[-1]))
        step = [int(np.argmax(logits[-1]))]
        tokens.extend(step)
    return tokens, np.stack(logits)


def main(paths: list[str]) -> int:
    group = mx.distributed.init(strict=True, backend="ring")
    failures = []
    for path in paths:
        failures += compare(path, load(path), load(path, group=group))
    print(f"rank {group.rank()}: {len(failures)} failures", *failures, sep="\n", flush=True)
    return 1 if failures else 0


def compare(path: str, whole: Program, shard: Program) -> list[str]:
    failures = []
    for kind in KINDS:
        for capture in (False, True):
            want, want_logits = greedy(whole, kind, capture)
            got, got_logits = greedy(shard, kind, capture)
            diff = float(np.abs(want_logits - got_logits).max())
            if got != want or diff > TOLERANCE:
                failures.append(f"{path} {kind} capture={capture}: tokens equal {got == want}, max diff {diff:.2e}")
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
