"""Module-level ``__getattr__`` for packages that re-export names from their submodules.

A package resolves each name on first use, so importing a light submodule (the server's
request parsing, the command line) does not load MLX or torch.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package`` resolving ``name`` from module ``exports[name]``
    (relative to ``package`` when it starts with a dot)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(exports[name], package), name)

    return __getattr__
