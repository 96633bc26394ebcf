"""The interpreter's Program: input checks against the graph's signature, the cache
requirement, load errors, and the on-device import boundary (no torch)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.export import Dim

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

import mlx_pte.export.custom_ops  # noqa: F401  (torch.ops.llm.update_and_attend)
from mlx_pte.export.program import export_module
from mlx_pte.interpreter.handlers import MissingCacheError
from mlx_pte.interpreter.program import InputError, load
from mlx_pte.ir.errors import FormatError


class TwoInputs(nn.Module):
    def forward(self, x, ids):
        return x * 2 + ids.unsqueeze(-1)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    t = Dim("T", min=1, max=8)
    path = tmp_path_factory.mktemp("program") / "two.pte"
    return load(export_module(TwoInputs(), (torch.randn(3, 4), torch.arange(3)), path, ({0: t}, {0: t})))


@pytest.mark.parametrize("capture", [False, True], ids=["walked", "captured"])
def test_runs_at_every_size_of_the_range(program, capture):
    # Twice per size: the second walk runs the steps specialised to that shape; capture
    # pads 3 and 5 rows up to their buckets (4, 8) and slices the output back.
    for t in (1, 3, 5, 8, 5, 3, 1, 8):
        x, ids = np.random.rand(t, 4).astype(np.float32), np.arange(t)
        (out,) = program.run([x, ids], capture=capture)
        assert out.shape == (t, 4)
        np.testing.assert_allclose(np.array(out), x * 2 + ids[:, None], rtol=1e-6)


def test_inputs_of_the_same_kind_are_cast(program):
    # float64 lists and int32 ids are accepted and cast to the graph's float32/int64.
    (out,) = program.run([[[1.0, 2.0, 3.0, 4.0]], np.array([3], dtype=np.int32)])
    assert out.dtype == mx.float32
    np.testing.assert_array_equal(np.array(out), [[5.0, 7.0, 9.0, 11.0]])


@pytest.mark.parametrize(
    "inputs, message",
    [
        ([np.zeros((3, 4), np.float32)], "takes 2 inputs \\['x', 'ids'\\], got 1"),
        ([np.zeros((3, 4), np.float32), np.zeros(3, np.float32)], "input 'ids' must be int64, got mlx.core.float32"),
        ([np.zeros((3, 5), np.float32), np.arange(3)], "input 'x' must have shape \\[s\\w+ in \\[1, 8\\], 4\\]"),
        ([np.zeros((3,), np.float32), np.arange(3)], "input 'x' must have shape"),
        ([np.zeros((9, 4), np.float32), np.arange(9)], "input 'x' axis 0 is 9; it must be s\\w+ in \\[1, 8\\]"),
        ([np.zeros((0, 4), np.float32), np.arange(0)], "axis 0 is 0"),
        ([np.zeros((3, 4), np.float32), np.arange(4)], "input 'ids' axis 0 is 4, but s\\w+ is 3 in input 'x'"),
    ],
    ids=["count", "dtype-kind", "static-dim", "rank", "above-range", "below-range", "inconsistent"],
)
def test_bad_inputs_are_refused_with_the_reason(program, inputs, message):
    with pytest.raises(InputError, match=message):
        program.run(inputs)


class OneAttention(nn.Module):
    def forward(self, q, positions):
        return torch.ops.llm.update_and_attend(q, q, q, positions, 0, 0.5)


def test_attention_without_a_cache_is_refused(tmp_path):
    program = load(export_module(OneAttention(), (torch.randn(1, 2, 3, 4), torch.arange(3)), tmp_path / "a.pte"))
    with pytest.raises(MissingCacheError, match="pass the KV cache"):
        program.run([np.zeros((1, 2, 3, 4), np.float32), np.arange(3)])


def test_load_refuses_files_that_are_not_programs(tmp_path, program):
    junk = tmp_path / "junk.pte"
    junk.write_bytes(b"not a program at all" * 10)
    with pytest.raises(FormatError, match=str(junk)):
        load(junk)


def test_load_refuses_a_truncated_program(tmp_path):
    path = export_module(TwoInputs(), (torch.randn(3, 4), torch.arange(3)), tmp_path / "t.pte")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError):
        load(path)


def _import_all(packages: str, check: str) -> None:
    """In a fresh interpreter, import every module of ``packages`` and of their subpackages,
    then assert ``check``."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"packages = [importlib.import_module(p) for p in {packages.split()!r}]\n"
        "for pkg in packages:\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if not m.name.endswith('._generated'):\n"
        "            importlib.import_module(m.name)\n"
        f"{check}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_on_device_side_never_imports_torch():
    _import_all(
        "mlx_pte.serving mlx_pte.interpreter mlx_pte.ir mlx_pte.ir.upstream mlx_pte.runtime.cache mlx_pte.runtime.mlx",
        "heavy = [m for m in ('torch', 'executorch', 'transformers') if m in sys.modules]; assert not heavy, heavy",
    )


def test_layers_import_only_downwards():
    """serving -> interpreter -> runtime, ir: the interpreter never reaches up into serving
    or the face's command line."""
    _import_all(
        "mlx_pte.interpreter mlx_pte.ir mlx_pte.runtime.cache mlx_pte.runtime.mlx",
        "up = [m for m in sys.modules if m.startswith(('mlx_pte.serving', 'mlx_pte.cli', 'mlx_pte.arguments'))]; "
        "assert not up, up",
    )


def test_the_command_line_loads_no_tokenizer_template_engine_or_mlx():
    """``import mlx_pte.cli`` (every ``mlx-pte`` run, ``--help`` included) stays light: the
    tokenizer, Jinja and MLX load only in the handlers that need them."""
    code = (
        "import sys, mlx_pte.cli\n"
        "heavy = [m for m in ('tokenizers', 'jinja2', 'mlx.core', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
