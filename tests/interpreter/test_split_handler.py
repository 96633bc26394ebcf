"""The split handler against torch.split, including upstream's uniform form (equal sizes,
the last piece clipped to what remains), and its refusal of sizes that do not fit."""
import numpy as np
import pytest
import torch

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.interpreter.handlers import HANDLERS, RunContext


@pytest.mark.parametrize(("length", "sizes", "torch_split"), [
    (10, [2, 5, 3], [2, 5, 3]),
    (10, [3, 3, 3, 3], 3),  # upstream's uniform torch.split(x, 3): pieces 3, 3, 3, 1
    (7, [4, 4], 4),
    (6, [0, 6], [0, 6]),
])  # fmt: skip
def test_split_matches_torch(length, sizes, torch_split):
    x = torch.arange(2 * length, dtype=torch.float32).reshape(2, length)
    want = torch.split(x, torch_split, dim=1)
    got = HANDLERS["split"]([mx.array(x.numpy())], {"sizes": sizes, "dim": 1}, RunContext())
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.array(g), w.numpy())


@pytest.mark.parametrize("sizes", [[3, 3], [8, 4, 1], [-1, 11], [2**31, 1]])
def test_split_sizes_that_do_not_cover_the_axis_are_refused(sizes):
    with pytest.raises(ValueError, match="must be >= 0 and cover the axis' 10"):
        HANDLERS["split"]([mx.zeros((2, 10))], {"sizes": sizes, "dim": 1}, RunContext())
