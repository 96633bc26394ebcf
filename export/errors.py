"""Errors raised while exporting a module to a .pte program."""
from __future__ import annotations

from collections import Counter
from typing import Mapping


class ExportError(Exception):
    """An export that cannot produce a program; the message says what to change."""


class UnsupportedOpsError(ExportError):
    """The graph holds ops the MLX backend does not lower: nothing is delegated partially.

    ``unsupported`` maps each op (with the reason when it is a dtype or shape limit) to
    how many nodes use it.
    """

    def __init__(self, unsupported: Mapping[str, int]) -> None:
        self.unsupported = dict(Counter(unsupported).most_common())
        listing = "\n".join(f"  {op}: {count}" for op, count in self.unsupported.items())
        super().__init__(
            f"{sum(self.unsupported.values())} node(s) use ops the MLX backend cannot lower; "
            f"rewrite the module to avoid them (or add a lowering to export/op_lowerings.py):\n{listing}"
        )


class OutputPathError(ExportError, ValueError):
    """The output path cannot be written: a missing directory, or a directory where a file goes."""
