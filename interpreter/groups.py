"""The process groups a sharded program's ``all_sum`` instructions name, and its handler.

A group is registered once and named by a small int in the graph, since an attribute
cannot hold a live ``mx.distributed.Group``; one process may hold programs sharded over
different groups.
"""
from __future__ import annotations

from typing import Any, Optional

from mlx_pte.runtime.mlx.bootstrap import mx

_GROUPS: list[Any] = []


def register_group(group: Any) -> int:
    """The id ``all_sum`` instructions use for ``group`` (the same id for the same group)."""
    for i, known in enumerate(_GROUPS):
        if known is group:
            return i
    _GROUPS.append(group)
    return len(_GROUPS) - 1


def all_sum(args: list[Optional[mx.array]], attrs: dict[str, Any], ctx: Any) -> mx.array:
    """The ``all_sum`` handler: the sum of ``x`` over every rank of the named group."""
    return mx.distributed.all_sum(args[0], group=_GROUPS[attrs["group"]])
