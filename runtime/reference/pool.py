"""One layer's K or V storage: ``[1, H, rows, D]`` in the storage dtype.

Rows are physical slots (ring modulo already applied by the planner). A pool holds no
rows until its first write; it then grows by doubling, starting from ``first_rows``,
never past ``max_rows``. Growth appends zero rows, so a row keeps its index and bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlx_pte.runtime.cache import Run


@dataclass
class Pool:
    heads: int
    dim: int
    dtype: torch.dtype
    max_rows: int
    first_rows: int  # rows of the first allocation (clamped to max_rows)
    data: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.first_rows = min(self.first_rows, self.max_rows)
        self.data = torch.zeros(1, self.heads, 0, self.dim, dtype=self.dtype)

    @property
    def rows(self) -> int:
        return self.data.shape[2]

    def reserve(self, needed: int) -> None:
        """Grow to hold rows ``[0, needed)`` (the planner keeps ``needed <= max_rows``)."""
        if needed <= self.rows:
            return
        size = max(self.rows or self.first_rows, 1)
        while size < needed:
            size *= 2
        added = min(size, self.max_rows) - self.rows
        pad = torch.zeros(1, self.heads, added, self.dim, dtype=self.dtype)
        self.data = torch.cat([self.data, pad], dim=2)

    def write_runs(self, runs: tuple[Run, ...], update: torch.Tensor) -> None:
        """Write ``update``'s tokens, in order, into ``runs`` (explicit cast to storage)."""
        at = 0
        for run in runs:
            self.reserve(run.start + run.length)
            rows = slice(run.start, run.start + run.length)
            self.data[:, :, rows] = update[:, :, at : at + run.length].to(self.dtype)
            at += run.length

    def read_runs(self, runs: tuple[Run, ...]) -> torch.Tensor:
        """The rows of ``runs`` concatenated in order (oldest first); all were written."""
        return torch.cat([self.data[:, :, r.start : r.start + r.length] for r in runs], dim=2)

    def scatter(self, rows: torch.Tensor, update: torch.Tensor) -> None:
        """Write token i of ``update`` at row ``rows[i]`` (distinct rows, any order)."""
        self.reserve(int(rows.max()) + 1)
        self.data[:, :, rows] = update.to(self.dtype)

    def copy_prefix(self, rows: int) -> "Pool":
        """An independent pool holding a copy of this pool's first ``rows`` rows."""
        copy = Pool(self.heads, self.dim, self.dtype, self.max_rows, self.first_rows)
        copy.data = self.data[:, :, :rows].clone()
        return copy
