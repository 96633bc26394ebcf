"""Test helpers: export a module through the real pipeline, load it, compare with eager torch."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

from mlx_pte.export.program import export_module
from mlx_pte.interpreter.program import Program, load


def export_and_load(
    module: torch.nn.Module, example: Sequence[Any], path: Path, dynamic_shapes: Optional[Any] = None
) -> Program:
    """export_module → .pte file → load."""
    return load(export_module(module.eval(), example, path, dynamic_shapes=dynamic_shapes))


def to_numpy(array: mx.array) -> np.ndarray:
    """An MLX array as numpy; bfloat16 (which numpy lacks) widened to float32."""
    return np.array(array.astype(mx.float32) if array.dtype == mx.bfloat16 else array)


def torch_dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def max_rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max(|ref|, 1): the figure the tolerances below bound."""
    if out.size == 0:
        return 0.0
    return float(np.max(np.abs(out.astype(np.float64) - ref) / np.maximum(np.abs(ref), 1.0)))


def assert_matches(outputs: Sequence[mx.array], expected: Sequence[torch.Tensor], tol: float) -> float:
    """Each output has the eager result's dtype and shape and matches it within ``tol``
    (relative to max(|ref|, 1)); integer and bool results match exactly.

    Returns:
        The largest relative error seen (floating outputs).
    """
    assert len(outputs) == len(expected)
    worst = 0.0
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        ref = ref.detach()
        assert str(out.dtype).removeprefix("mlx.core.") == torch_dtype_name(ref), f"output {i} dtype"
        assert tuple(out.shape) == tuple(ref.shape), f"output {i} shape {tuple(out.shape)} vs {tuple(ref.shape)}"
        got = to_numpy(out)
        if ref.dtype.is_floating_point:
            want = ref.to(torch.float64).numpy()
            err = max_rel_error(got, want)
            assert err <= tol, f"output {i}: relative error {err:.3g} > {tol:g}"
            worst = max(worst, err)
        else:
            np.testing.assert_array_equal(got, ref.numpy(), err_msg=f"output {i}")
    return worst
