"""Decode upstream ExecuTorch's MLX delegate payload (magic ``MLX0``) into flatc's objects.

Layout (upstream's ``serialization/mlx_graph_serialize.py``)::

    0   4 bytes of zero padding
    4   magic b"MLX0"
    8   u64 data segment offset, u64 data segment size (0: the weights are in
        ExecuTorch's named data map, as every current upstream export does)
    24  the FlatBuffer, root ``MLXGraph`` (``serialization/schema.fbs``)

The FlatBuffer is read with the Python reader ``flatc`` generates from the installed
executorch's ``schema.fbs`` (``scripts/prepare_upstream_mlx.py`` writes it). That reader
trusts every offset, so each failure it can raise on damaged bytes becomes one
``FormatError``; the importer then checks every index the graph holds.
"""
from __future__ import annotations

import struct
from typing import Any

from ..errors import FormatError

MAGIC = b"MLX0"
HEADER = struct.Struct("<4s4sQQ")  # padding, magic, data segment offset, data segment size

try:
    from ._generated import schema_generated as fbs
except ImportError:  # not generated in this checkout yet
    fbs = None

# What flatc's generated Python raises on bytes that are not a valid buffer.
_DECODE_ERRORS = (IndexError, struct.error, ValueError, TypeError, OverflowError, UnicodeDecodeError, RecursionError)


def schema() -> Any:
    """The generated reader module; FormatError naming the setup step when it is missing."""
    if fbs is None:
        raise FormatError(
            "this is an upstream ExecuTorch MLX program, and this mlx-pte checkout has no reader for it yet: "
            "run `python scripts/prepare_upstream_mlx.py` (make test does) with executorch installed"
        )
    return fbs


def node_type_names() -> dict[int, str]:
    """OpNode union codes -> node type names."""
    union = schema().OpNode
    return {code: name for name, code in vars(union).items() if isinstance(code, int) and name != "NONE"}


def decode_graph(payload: memoryview) -> Any:
    """The payload's ``MLXGraphT`` object tree.

    Raises:
        FormatError: a short or foreign header, in-payload constant data (which no current
            upstream export writes), or a FlatBuffer that cannot be decoded.
    """
    if len(payload) < HEADER.size:
        raise FormatError(f"the upstream MLX payload is {len(payload)} bytes, shorter than its {HEADER.size}-byte header")
    padding, magic, data_offset, data_size = HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise FormatError(f"not an upstream MLX payload: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if data_size:
        raise FormatError(
            f"the upstream MLX payload carries {data_size} bytes of in-payload constants; "
            "mlx-pte reads upstream weights from ExecuTorch's named data map only"
        )
    module = schema()
    buf = bytes(payload[HEADER.size :])
    try:
        graph = module.MLXGraphT.InitFromPackedBuf(buf, 0)
    except _DECODE_ERRORS as exc:
        raise FormatError(f"the upstream MLX graph is malformed ({type(exc).__name__}: {exc})") from None
    if graph.instructionChains is None:
        raise FormatError("the upstream MLX graph has no instruction chains")
    return graph
