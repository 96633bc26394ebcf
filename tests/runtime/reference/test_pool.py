"""K/V pools: lazy doubling growth clamped to the cap, storage casts, copies."""
from __future__ import annotations

import pytest
import torch

from mlx_pte.runtime.cache import Run
from mlx_pte.runtime.reference.pool import Pool


@pytest.mark.parametrize(
    "first, cap, written, rows",
    [(2, 32, 5, 8), (16, 20, 17, 20), (512, 4, 1, 4), (4, 64, 40, 64), (0, 8, 3, 4)],
)
def test_growth_doubles_from_the_first_size_and_clamps(first, cap, written, rows) -> None:
    pool = Pool(2, 3, torch.float32, cap, first)
    assert pool.rows == 0
    pool.write_runs((Run(0, written),), torch.ones(1, 2, written, 3))
    assert pool.rows == rows


def test_growth_keeps_rows_and_bytes() -> None:
    pool = Pool(1, 2, torch.float32, 64, 2)
    first = torch.arange(4.0).reshape(1, 1, 2, 2)
    pool.write_runs((Run(0, 2),), first)
    pool.scatter(torch.tensor([9, 5]), torch.full((1, 1, 2, 2), 7.0))
    assert pool.rows == 16
    assert torch.equal(pool.data[:, :, :2], first)
    assert torch.equal(pool.data[0, 0, [5, 9]], torch.full((2, 2), 7.0))


def test_write_casts_to_storage_and_reads_runs_in_order() -> None:
    pool = Pool(1, 1, torch.bfloat16, 4, 4)
    update = torch.tensor([1.0 + 2**-10, 2.0, 3.0]).reshape(1, 1, 3, 1)
    pool.write_runs((Run(3, 1), Run(0, 2)), update)
    assert pool.data.dtype == torch.bfloat16
    # 1 + 2**-10 is not a bfloat16: it rounds to 1.
    assert pool.read_runs((Run(3, 1), Run(0, 2))).flatten().tolist() == [1.0, 2.0, 3.0]
    assert pool.read_runs((Run(0, 2),)).flatten().tolist() == [2.0, 3.0]


def test_copy_prefix_is_independent() -> None:
    pool = Pool(1, 1, torch.float32, 8, 8)
    pool.write_runs((Run(0, 4),), torch.arange(4.0).reshape(1, 1, 4, 1))
    copy = pool.copy_prefix(2)
    pool.write_runs((Run(0, 1),), torch.full((1, 1, 1, 1), 9.0))
    assert copy.data.flatten().tolist() == [0.0, 1.0]
    copy.write_runs((Run(2, 3),), torch.full((1, 1, 3, 1), 5.0))
    assert copy.rows == 8 and pool.data.flatten()[:4].tolist() == [9.0, 1.0, 2.0, 3.0]
