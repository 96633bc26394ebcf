"""The partitioner delegates the whole graph or fails listing every unsupported op; the
export writes its file atomically and keeps the program's signature and manifest."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
from torch import nn

from mlx_pte.export.errors import ExportError, UnsupportedOpsError
from mlx_pte.export.partitioner import MLXPtePartitioner
from mlx_pte.export.program import export_module
from mlx_pte.interpreter.program import load

from .roundtrip import to_numpy


class Unsupported(nn.Module):
    def forward(self, x):
        return x.cumsum(0) + x.cumsum(1), torch.sort(x)[0], x.double() * 2, x // 2, x + 1


def test_every_unsupported_op_is_listed_with_its_count(tmp_path):
    out = tmp_path / "u.pte"
    with pytest.raises(UnsupportedOpsError) as err:
        export_module(Unsupported(), (torch.randn(3, 4),), out)
    assert err.value.unsupported == {
        "aten.cumsum.default": 2,
        "aten.sort.default": 1,
        "aten._to_copy.default (torch.float64)": 2,  # the cast to float64 and back for the scalar
        "aten.mul.Tensor (torch.float64)": 1,
        "aten.div.Tensor_mode": 1,
    }
    assert "aten.cumsum.default: 2" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temp file


def test_a_failed_export_keeps_the_previous_file(tmp_path):
    out = tmp_path / "m.pte"
    out.write_bytes(b"previous")
    with pytest.raises(UnsupportedOpsError):
        export_module(Unsupported(), (torch.randn(3, 4),), out)
    assert out.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["m.pte"]


class Mutating(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count.add_(1)
        return x * self.count


def test_buffer_mutation_is_refused(tmp_path):
    with pytest.raises(ExportError, match="mutates"):
        export_module(Mutating(), (torch.randn(3),), tmp_path / "m.pte")


class Reordered(nn.Module):
    """Reads its inputs in the reverse of their order, and ignores nothing."""

    def forward(self, a, b, c):
        return c * 2, b.sum() + c.sum(), a[: b.shape[0]]


def test_inputs_and_outputs_keep_forward_order(tmp_path):
    module = Reordered()
    inputs = (torch.randn(5), torch.randn(3), torch.randn(2))
    program = load(export_module(module, inputs, tmp_path / "r.pte"))
    assert [program.graph.slots[s].name for s in program.graph.inputs] == ["a", "b", "c"]
    for out, ref in zip(program.run([x.numpy() for x in inputs]), module(*inputs)):
        np.testing.assert_allclose(to_numpy(out), ref.numpy(), rtol=1e-6)


class Unused(nn.Module):
    def forward(self, x, unused):
        return x + 1


def test_an_unread_input_is_refused(tmp_path):
    with pytest.raises(ExportError, match="never reads its inputs \\['unused'\\]"):
        export_module(Unused(), (torch.randn(3), torch.randn(3)), tmp_path / "u.pte")


def test_manifest_round_trips_and_is_stored_once(tmp_path):
    manifest = {"format_version": 1, "tokenizer": "x" * 200_000, "nested": {"ids": [1, 2, 3]}}
    path = export_module(nn.Linear(4, 2), (torch.randn(1, 4),), tmp_path / "m.pte", manifest=manifest)
    assert load(path).manifest == manifest
    assert path.stat().st_size < 250_000  # the compile spec's copy was dropped


def test_bfloat16_weights_load_bit_exact(tmp_path):
    torch.manual_seed(0)
    module = nn.Linear(8, 3).to(torch.bfloat16)
    program = load(export_module(module, (torch.randn(2, 8, dtype=torch.bfloat16),), tmp_path / "b.pte"))
    for name, param in module.named_parameters():
        weight = program.weight(name)
        assert str(weight.dtype) == "mlx.core.bfloat16"
        np.testing.assert_array_equal(to_numpy(weight), param.detach().float().numpy())


class Copies(nn.Module):
    def forward(self, x):
        return x.to(torch.float16), x.clone() * 2, x.to(torch.int32)


def test_dim_order_copies_lower_like_plain_copies(tmp_path):
    """Without _skip_dim_order, edge emits _to_dim_order_copy/_clone_dim_order instead."""
    module = Copies()
    x = torch.randn(3, 4) * 4
    ep = torch.export.export(module, (x,), strict=False)
    edge = to_edge_transform_and_lower(
        ep, partitioner=[MLXPtePartitioner()], compile_config=EdgeCompileConfig(_check_ir_validity=False)
    )
    targets = {str(n.target) for n in edge.exported_program().graph.nodes}
    assert not any("dim_order" in t for t in targets)  # all inside the delegate
    path = tmp_path / "c.pte"
    path.write_bytes(edge.to_executorch().buffer)
    outs = load(path).run([x.numpy()])
    for out, ref in zip(outs, module(x)):
        assert str(out.dtype) == f"mlx.core.{str(ref.dtype).removeprefix('torch.')}"
        np.testing.assert_array_equal(to_numpy(out), ref.numpy())
