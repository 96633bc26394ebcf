"""A checkpoint's ``*.safetensors`` files, memory-mapped, read one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
``data_offsets`` relative to the end of the header) and the raw tensors. A tensor is read
as a view of the mapping; once the writer has consumed it, its pages are dropped from this
process (``MADV_DONTNEED``; the kernel's page cache keeps them), so reading every weight
never makes the whole checkpoint resident in the exporter.
"""
from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import torch

from .hf_errors import CheckpointError
from .tensor_source import TORCH_OF, to_bytes

# safetensors dtype codes -> torch dtypes (bfloat16 is read through its uint16 bits).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_NUMPY: dict[torch.dtype, type] = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_,
}  # fmt: skip
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class _Entry:
    file: "_MappedFile"
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class _MappedFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def release(self, start: int, end: int) -> None:
        """Drop the pages of ``[start, end)`` from this process (they stay cached)."""
        begin = start - start % _PAGE
        if hasattr(self.map, "madvise") and end > begin:
            self.map.madvise(mmap.MADV_DONTNEED, begin, end - begin)


class SafetensorsFiles:
    """Every tensor of the ``*.safetensors`` files in a directory, by name.

    Raises:
        CheckpointError: a file that is not safetensors, or a name stored twice.
    """

    def __init__(self, root: Path) -> None:
        self._entries: dict[str, _Entry] = {}
        for path in sorted(root.glob("*.safetensors")):
            self._index(_MappedFile(path))

    def _index(self, file: _MappedFile) -> None:
        size = len(file.map)
        try:
            (length,) = struct.unpack_from("<Q", file.map, 0)
            header = json.loads(bytes(file.map[8 : 8 + length]))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{file.path} is not a safetensors file ({exc}); save it again") from None
        base = 8 + length
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _DTYPES[info["dtype"]]
                begin, end = (base + int(o) for o in info["data_offsets"])
                shape = tuple(int(d) for d in info["shape"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{file.path}: tensor {name!r} has an unsupported dtype or a malformed header entry"
                ) from None
            if end > size or end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
                raise CheckpointError(f"{file.path}: tensor {name!r} lies outside the file; the file is truncated")
            if name in self._entries:
                raise CheckpointError(f"tensor {name!r} is stored in both {self._entries[name].file.path} and {file.path}")
            self._entries[name] = _Entry(file, dtype, shape, begin, end)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> Mapping[str, tuple[int, ...]]:
        return {name: e.shape for name, e in self._entries.items()}

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a read-only view of the mapping (no copy); call ``release``
        once its bytes have been consumed."""
        e = self._entries[name]
        array = np.frombuffer(e.file.map, dtype=_NUMPY[e.dtype], count=(e.end - e.start) // e.dtype.itemsize, offset=e.start)
        with _quiet_readonly():
            t = torch.from_numpy(array)
        return (t.view(torch.bfloat16) if e.dtype == torch.bfloat16 else t).reshape(e.shape)

    def release(self, name: str, start: int = 0, stop: Optional[int] = None) -> None:
        """Drop the pages of rows ``[start, stop)`` (first axis; default all) of ``name``."""
        e = self._entries[name]
        if stop is None or not e.shape:
            e.file.release(e.start, e.end)
            return
        row_bytes = (e.end - e.start) // max(1, e.shape[0])
        e.file.release(e.start + start * row_bytes, e.start + stop * row_bytes)


class _quiet_readonly:
    """torch warns that a tensor over a read-only buffer must not be written; these
    views are only ever read (every consumer copies or converts)."""

    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


def _owned(view: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    """A view of the mapping as a tensor of ``target`` that outlives the pages' release
    (one copy; a cast makes it)."""
    return view.to(target) if view.dtype != target else view.clone()


@dataclass(frozen=True)
class CheckpointTensor:
    """A weight read from the checkpoint and converted to ``dtype`` (as ``from_pretrained``
    converts it)."""

    files: SafetensorsFiles
    key: str
    shape: tuple[int, ...]
    dtype: str

    def tensor(self) -> torch.Tensor:
        value = _owned(self.files.read(self.key), TORCH_OF[self.dtype])
        self.files.release(self.key)
        return value

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)``, converted; only their pages are touched, and dropped
        after (a quantized embedding is read a block at a time, never whole)."""
        value = _owned(self.files.read(self.key)[start:stop], TORCH_OF[self.dtype])
        self.files.release(self.key, start, stop)
        return value

    def data(self) -> np.ndarray:
        """The stored bytes: a view of the mapping when no conversion is needed (the writer
        calls ``done`` once written), else the converted copy."""
        view = self.files.read(self.key)
        if view.dtype != TORCH_OF[self.dtype]:
            return to_bytes(self.tensor())
        return view.reshape(-1).view(torch.uint8).numpy()

    def done(self) -> None:
        self.files.release(self.key)
