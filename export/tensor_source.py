"""Lazy weights: a constant's name, shape and dtype now, its bytes only when written.

The streaming export never holds the model's weights: each constant of the lowered graph is
a ``TensorSource`` whose ``read()`` produces its C-order bytes on demand (from the
memory-mapped checkpoint, ``export.safetensors_file``), and the payload writer
(``export.weight_writer``) reads one source at a time, writes it and drops it. A derived
constant (a dtype cast, a concatenation of projections, a quantized part) is a source over
other sources, so deriving it costs nothing until it is written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import numpy as np
import torch

from mlx_pte.ir.payload import ITEMSIZE

TORCH_OF: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {t: n for n, t in TORCH_OF.items()}


class TensorSource(Protocol):
    """A constant whose bytes are produced on demand."""

    shape: tuple[int, ...]
    dtype: str  # an IR dtype name

    def tensor(self) -> torch.Tensor:
        """The value as a (CPU, contiguous) torch tensor; reads the checkpoint."""
        ...

    def data(self) -> np.ndarray:
        """The bytes the payload stores (uint8, C order); the writer calls ``done`` (when
        the source has one) once they are written."""
        ...


def row_reader(source: TensorSource) -> Callable[[int, int], torch.Tensor]:
    """A function from ``(start, stop)`` to those rows (first axis) of ``source``'s value,
    as a new CPU tensor: the source's own ``rows(start, stop)`` when it has one (a
    checkpoint tensor reads nothing but the block), else slices of its value, read once."""
    rows = getattr(source, "rows", None)
    if rows is not None:
        return rows
    whole = source.tensor()
    return lambda start, stop: whole[start:stop]


class _FromTensor:
    """``data`` as the bytes of ``tensor``."""

    def data(self) -> np.ndarray:
        return to_bytes(self.tensor())  # type: ignore[attr-defined]


def nbytes(source: TensorSource) -> int:
    """The bytes ``source`` stores (a fused constant knows them; others from shape and dtype)."""
    known = getattr(source, "nbytes", None)
    return known if isinstance(known, int) else ITEMSIZE[source.dtype] * math.prod(source.shape)


def to_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's C-order bytes as uint8 (bfloat16 included), without a copy when contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


@dataclass(frozen=True)
class ArraySource(_FromTensor):
    """A tensor already in memory (buffers, lifted constants, weights given as tensors)."""

    value: torch.Tensor
    shape: tuple[int, ...] = field(init=False)
    dtype: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.value.shape))
        object.__setattr__(self, "dtype", DTYPE_NAMES[self.value.dtype])

    def tensor(self) -> torch.Tensor:
        return self.value.detach().contiguous()

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.value.detach()[start:stop].contiguous()


@dataclass(frozen=True)
class CastSource(_FromTensor):
    """``source`` converted to ``dtype`` (torch rounds as MLX's astype does)."""

    source: TensorSource
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    def tensor(self) -> torch.Tensor:
        return self.source.tensor().to(TORCH_OF[self.dtype])


@dataclass(frozen=True)
class ConcatSource(_FromTensor):
    """``parts`` concatenated along ``axis`` (a fused projection's weight)."""

    parts: tuple[TensorSource, ...]
    axis: int = 0

    @property
    def dtype(self) -> str:
        return self.parts[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        first = list(self.parts[0].shape)
        first[self.axis] = sum(p.shape[self.axis] for p in self.parts)
        return tuple(first)

    def tensor(self) -> torch.Tensor:
        return torch.cat([p.tensor() for p in self.parts], dim=self.axis)


@dataclass(frozen=True)
class ComputedSource(_FromTensor):
    """``fn`` applied to its sources' values (a constant expression the graph folds,
    such as Gemma's ``1 + w``); ``shape`` and ``dtype`` are the result's."""

    fn: Callable[..., torch.Tensor]
    sources: tuple[TensorSource, ...]
    shape: tuple[int, ...]
    dtype: str

    def tensor(self) -> torch.Tensor:
        return self.fn(*(s.tensor() for s in self.sources)).contiguous()


class SharedResult:
    """One computation with several outputs (a quantized weight's packed parts), run the
    first time any part is read and released once every part has been read."""

    def __init__(self, compute: Callable[[], Sequence[np.ndarray]], n_parts: int) -> None:
        self._compute = compute
        self._pending = n_parts
        self._result: Optional[Sequence[np.ndarray]] = None

    def take(self, index: int) -> np.ndarray:
        if self._result is None:
            self._result = self._compute()
        part = self._result[index]
        self._pending -= 1
        if self._pending == 0:
            self._result = None
        return part


@dataclass(frozen=True)
class PartSource:
    """Output ``index`` of a ``SharedResult`` (bytes already in storage order)."""

    result: SharedResult
    index: int
    shape: tuple[int, ...]
    dtype: str

    def tensor(self) -> torch.Tensor:
        raise TypeError("a packed quantized part has bytes (data()), not a tensor value")

    def data(self) -> np.ndarray:
        return np.ascontiguousarray(self.result.take(self.index)).reshape(-1).view(np.uint8)


@dataclass(frozen=True)
class RowsSource:
    """Row blocks (``ir.fuse_projections.RowBlock``: a constant's data, or zero rows) one
    after another: a fused projection's weight, read part by part when written."""

    blocks: tuple  # of RowBlock

    @property
    def nbytes(self) -> int:
        return sum(b.rows * b.row_bytes for b in self.blocks)

    def tensor(self) -> torch.Tensor:
        raise TypeError("a fused constant has bytes (data()), not a tensor value")

    def data(self) -> np.ndarray:
        pieces = []
        for b in self.blocks:
            if b.data is None:
                pieces.append(np.zeros(b.rows * b.row_bytes, np.uint8))
            elif isinstance(b.data, np.ndarray):
                pieces.append(b.data.reshape(-1).view(np.uint8))
            else:
                pieces.append(np.array(b.data.data(), copy=True))  # outlives the part's release
                done = getattr(b.data, "done", None)
                if done is not None:
                    done()
        return np.concatenate(pieces)


def concat_sources(blocks: Sequence) -> RowsSource:
    """``ir.fuse_projections``' concat for lazy constants."""
    return RowsSource(tuple(blocks))
