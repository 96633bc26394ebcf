"""The streaming half of ``preprocess``: constants written one at a time to a file that
ExecuTorch copies into the ``.pte`` as named data (payload version 2, ``ir.payload``).

``preprocess`` only receives the edge program and byte compile specs, so what it needs
from the exporter — the checkpoint tensors behind the traced placeholders, where to put
the temporary file, how to report progress — is the active ``WeightSink``
(``streaming(sink)`` around the lowering). Without one, constants are the program's own
tensors and the file goes in the system's temporary directory.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Union

import numpy as np
from executorch.exir._serialize._cord import FileBackedData

from mlx_pte.ir.graph import Graph
from mlx_pte.ir.payload import ALIGNMENT, place_constants

from .errors import ExportError
from .tensor_source import TensorSource, nbytes

ConstantData = Union[np.ndarray, TensorSource]
PARTIAL_SUFFIX = ".partial"  # of an export's temporary files (``program.write_atomically``)
# (constant name, its index, how many) after each constant is written
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class WeightSink:
    """Where and how one export writes its weights.

    Attributes:
        out: the output file; the temporary weights file is ``<out>.<pid>.weights.partial``
            beside it (no space needed elsewhere, and a killed export's leftover is
            visible and removed by the next export, as ``program.write_atomically``
            does). None: the system's temporary directory.
        sources: streamed weights by state-dict name (``hf_checkpoint.weight_sources``).
        progress: called after each constant is written.
    """

    out: Optional[Path] = None
    sources: Mapping[str, TensorSource] = field(default_factory=dict)
    progress: Optional[Progress] = None
    created: list[str] = field(default_factory=list)  # temporary files written so far

    def remove_files(self) -> None:
        """Delete the temporary weights files (once the .pte holds their bytes)."""
        while self.created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.created.pop())

    def _open(self) -> tuple[int, str]:
        if self.out is None:
            return tempfile.mkstemp(prefix="mlx_pte_weights.", suffix=".partial")
        path = self.out.with_name(f"{self.out.name}.{os.getpid()}.weights{PARTIAL_SUFFIX}")
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), str(path)


_SINK: ContextVar[WeightSink] = ContextVar("mlx_pte_weight_sink", default=WeightSink())


@contextlib.contextmanager
def streaming(sink: WeightSink) -> Iterator[WeightSink]:
    """Make ``sink`` the one ``preprocess`` writes through while the block runs."""
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def active_sink() -> WeightSink:
    return _SINK.get()


def _size(data: ConstantData) -> int:
    return data.nbytes if isinstance(data, np.ndarray) else nbytes(data)


def write_weights(
    graph: Graph, constants: Mapping[int, ConstantData], sink: WeightSink
) -> tuple[dict, int, FileBackedData]:
    """Place ``constants`` (``ir.payload.place_constants``) and write them, in slot order,
    to a temporary file holding the weight segment.

    Returns:
        (placement, segment size, the file as ExecuTorch named data; it is removed when
        ExecuTorch drops it).

    Raises:
        ExportError: a source produced bytes of another size than its type needs.
        FormatError: a malformed graph.
    """
    placed, size = place_constants(graph, {slot: _size(data) for slot, data in constants.items()})
    fd, path = sink._open()
    sink.created.append(path)
    try:
        with os.fdopen(fd, "wb") as f:
            for index, slot in enumerate(sorted(constants)):
                _write_one(f, graph.slots[slot].name, constants[slot], placed[slot].offset)
                if sink.progress is not None:
                    sink.progress(graph.slots[slot].name, index + 1, len(constants))
            f.write(bytes(size - f.tell()))
    except BaseException:
        sink.remove_files()
        raise
    return placed, size, FileBackedData(path, cleanup=True)


def _write_one(f, name: str, data: ConstantData, offset: int) -> None:
    f.write(bytes(offset - f.tell()))  # alignment padding
    raw = data if isinstance(data, np.ndarray) else data.data()
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.nbytes != _size(data):
        raise ExportError(f"constant {name!r} produced {raw.nbytes} bytes, its type needs {_size(data)}")
    f.write(memoryview(raw))
    done = getattr(data, "done", None)
    del raw
    if done is not None:
        done()
    assert f.tell() == offset + _size(data) and offset % ALIGNMENT == 0
