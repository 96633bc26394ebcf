"""The temporaries budget: the memory a file's graph declares its temps take, checked at load.

Every temp is written by an instruction at run time, so a crafted file could declare temps
of any size and have MLX allocate them (it refuses one buffer past 2**31 bytes, not many
smaller ones). A temp's declared shape, already checked against its instruction's shape
attribute by the catalog, gives the least a forward allocates for it: static sizes as
declared, a dynamic size at the smallest its range allows or the literal size a shape
attribute gives it. A real export's temps at their least are a forward of one token, far
below its weights; the sum must stay within the model's own size (its weights' bytes, at
least ``MIN_BUDGET``), or the budget given to ``load``.
"""
from __future__ import annotations

import math
from typing import Optional

from mlx_pte.ir.catalog import lookup
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Graph, Instruction, SymDim, TensorType
from mlx_pte.ir.payload import ITEMSIZE

MIN_BUDGET = 64 * 2**20
# Shape attributes that state their result's sizes (the catalog's rules match them to it).
_SHAPE_RULES = frozenset({"result_shape", "expand_shape", "view_shape"})


def default_budget(graph: Graph) -> int:
    """The model's own size: the bytes of its weights, at least ``MIN_BUDGET``."""
    weights = sum(_nbytes(graph.slots[s].type, graph.slots[s].type.shape) for s in graph.constants())
    return max(weights, MIN_BUDGET)


def check_temporaries(graph: Graph, budget: Optional[int] = None) -> None:
    """Refuse a graph whose temps, at their least, sum past ``budget`` bytes (default:
    ``default_budget``).

    Raises:
        FormatError: naming the instruction whose results cross the budget.
    """
    limit = default_budget(graph) if budget is None else budget
    total = 0
    for index, instr in enumerate(graph.instructions):
        for slot in instr.outputs:
            t = graph.slots[slot].type
            if not isinstance(t, TensorType) or t.shape is None:
                continue  # a scalar, or an imported temp whose file records no type
            size = _nbytes(t, _least_shape(instr, slot, t.shape))
            total += size
            if total > limit:
                raise FormatError(
                    f"instruction {index} ({instr.op!r}) declares a temporary of {_mib(size)} (slot {slot} "
                    f"{graph.slots[slot].name!r}), which takes the file's temporaries to {_mib(total)}, past "
                    f"the budget of {_mib(limit)} (the model's weights, at least {_mib(MIN_BUDGET)}); a model's "
                    "own export stays far below it (load(..., temporaries_budget=BYTES) sets another)"
                )


def _least_shape(instr: Instruction, slot: int, shape: tuple) -> list[int]:
    dims = [d.min if isinstance(d, SymDim) else d for d in shape]
    if instr.outputs and slot == instr.outputs[0]:
        for spec in lookup(instr.op).attrs:
            value = instr.attr(spec.name)
            if spec.rule in _SHAPE_RULES and isinstance(value, tuple) and len(value) == len(dims):
                dims = [max(d, v) if isinstance(v, int) else d for d, v in zip(dims, value)]
    return dims


def _nbytes(t: TensorType, dims) -> int:
    return ITEMSIZE[t.dtype] * math.prod(dims)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
