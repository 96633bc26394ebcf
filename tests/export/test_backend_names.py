"""Our backend and upstream ExecuTorch's MLX backend live side by side: importing both never
changes which ``preprocess`` a delegate runs (ExecuTorch resolves backends by class name)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from mlx_pte.export.program import export_module
from mlx_pte.ir.pte import BACKEND_ID, delegate_payload
from mlx_pte.interpreter.program import load


class Affine(torch.nn.Module):
    def forward(self, x):
        return x * 2.0 + 1.0


def upstream_mlx():
    try:
        return importlib.import_module("executorch.backends.mlx")
    except ImportError as exc:
        pytest.fail(f"upstream's MLX backend does not import ({exc}); run scripts/prepare_upstream_mlx.py")


@pytest.mark.parametrize("order", ["upstream first", "ours first"])
def test_both_backends_imported_ours_writes_our_payload(tmp_path, order):
    if order == "upstream first":
        upstream_mlx()
    out = export_module(Affine(), (torch.ones(2, 3),), tmp_path / "ours.pte")
    upstream = upstream_mlx()
    assert upstream.MLXBackend.__name__ != BACKEND_ID
    data = out.read_bytes()
    assert data.count(BACKEND_ID.encode()) == 1 and b"MLXBackend" not in data
    assert bytes(delegate_payload(data)[:4]) == b"MLXP"
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = load(out).run([x])
    np.testing.assert_array_equal(np.array(y), x * 2 + 1)


def test_upstream_partitioner_still_gets_upstream_payload():
    from executorch.exir import to_edge_transform_and_lower

    upstream = upstream_mlx()
    ep = torch.export.export(Affine(), (torch.ones(2, 3),))
    program = to_edge_transform_and_lower(ep, partitioner=[upstream.MLXPartitioner()]).to_executorch()
    payload = delegate_payload(program.buffer)
    assert bytes(payload[4:8]) == b"MLX0"  # upstream's magic, after 4 bytes of padding
