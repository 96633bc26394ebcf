"""A program's instructions prepared once at load, and specialised once per input shape.

``prepare`` turns every instruction into a ``PreparedStep``: its handler resolved, its
constant attributes bound in a closure, its operand and result slots as index tuples.
Attributes that read host ints (``SlotRef``s: dynamic sizes) are resolved per call.

Those host ints depend only on the input shapes (``sym_size`` reads shapes; the scalar
ops combine them), so after one run of a given set of input shapes every one of them is
known: ``specialise`` then binds them into the attributes and drops the instructions that
computed them, leaving a list of array steps with nothing to resolve. ``ShapeKey`` names
a set of input shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Graph, Instruction, ScalarType, SlotRef
from mlx_pte.runtime.cache import AttendError, CacheError

from .handlers import HANDLERS, Handler, RunContext

ShapeKey = tuple[tuple[int, ...], ...]


class GraphRunError(FormatError):
    """An instruction failed on inputs that fit the program's signature: the graph contradicts
    itself (a damaged or hand-made file); the message names the instruction."""


# What MLX and the handlers raise for operands and attributes that do not fit together.
_OP_FAILURES = (ValueError, IndexError, TypeError, OverflowError, ZeroDivisionError)


def call_handler(index: int, op: str, handler: Handler, args: list, attrs: dict[str, Any], ctx: RunContext) -> Any:
    """``handler(args, attrs, ctx)`` for instruction ``index`` (``op``); a failure the graph
    itself causes becomes a ``GraphRunError`` naming it. Cache refusals pass through as they
    are; an attention input that does not fit the declared step is the graph's fault here,
    since the session declared the step from the same tokens the graph reads."""
    try:
        return handler(args, attrs, ctx)
    except AttendError as exc:
        raise _graph_error(index, op, exc) from None
    except CacheError:
        raise
    except _OP_FAILURES as exc:
        raise _graph_error(index, op, exc) from None


def _graph_error(index: int, op: str, exc: Exception) -> GraphRunError:
    return GraphRunError(
        f"instruction {index} ({op!r}) failed: {exc} (the program's graph is inconsistent; export the model again)"
    )


def _holds_ref(value: Any) -> bool:
    return isinstance(value, SlotRef) or (isinstance(value, tuple) and any(isinstance(v, SlotRef) for v in value))


def _resolve(value: Any, values: Union[Sequence[Any], Mapping[int, Any]]) -> Any:
    if isinstance(value, SlotRef):
        return values[value.slot]
    return tuple(values[v.slot] if isinstance(v, SlotRef) else v for v in value)


def ref_slots(attrs: dict[str, Any]) -> tuple[int, ...]:
    """The host-int slots an instruction's attributes read."""
    slots: list[int] = []
    for value in attrs.values():
        items = value if isinstance(value, tuple) else (value,)
        slots.extend(v.slot for v in items if isinstance(v, SlotRef))
    return tuple(slots)


@dataclass(frozen=True)
class PreparedStep:
    """One instruction ready to run: ``run(values, ctx)`` reads its operands from the slot
    list and writes its results back."""

    index: int  # the instruction's position in the graph, for error messages
    op: str
    handler: Handler
    inputs: tuple[Optional[int], ...]
    outputs: tuple[int, ...]
    attrs: dict[str, Any]  # constant attributes; SlotRefs still unresolved
    reads_ints: tuple[int, ...]  # host-int slots its attributes read
    run: Callable[[list, RunContext], None]

    def attrs_for(self, values: Sequence[Any]) -> dict[str, Any]:
        """Its attributes with host ints read from ``values``."""
        if not self.reads_ints:
            return self.attrs
        return {k: (_resolve(v, values) if _holds_ref(v) else v) for k, v in self.attrs.items()}

    @property
    def reads(self) -> tuple[int, ...]:
        """Every slot it reads: operands and the host ints of its attributes."""
        return tuple(s for s in self.inputs if s is not None) + self.reads_ints


def _bind(index: int, op: str, handler: Handler, inputs: tuple[Optional[int], ...], outputs: tuple[int, ...],
          attrs: dict[str, Any], refs: tuple[tuple[str, Any], ...]) -> Callable[[list, RunContext], None]:
    """A closure running ``handler`` over the slot list, attributes bound; an operand/attribute
    mismatch surfaces as a ``GraphRunError`` naming the instruction."""
    single = outputs[0] if len(outputs) == 1 else None

    def run(values: list, ctx: RunContext) -> None:
        current = attrs
        if refs:  # a fresh dict: the bound one stays shared and unchanged
            current = dict(attrs)
            for key, value in refs:
                current[key] = _resolve(value, values)
        result = call_handler(index, op, handler, [None if s is None else values[s] for s in inputs], current, ctx)
        if single is not None:
            values[single] = result
        else:
            for slot, value in zip(outputs, result):
                values[slot] = value

    return run


def _prepared(index: int, op: str, handler: Handler, inputs: tuple[Optional[int], ...], outputs: tuple[int, ...],
              attrs: dict[str, Any]) -> PreparedStep:
    refs = tuple((k, v) for k, v in attrs.items() if _holds_ref(v))
    run = _bind(index, op, handler, inputs, outputs, attrs, refs)
    return PreparedStep(index, op, handler, inputs, outputs, attrs, ref_slots(attrs), run)


def prepare_instruction(index: int, instr: Instruction) -> PreparedStep:
    return _prepared(index, instr.op, HANDLERS[instr.op], instr.inputs, instr.outputs, dict(instr.attrs))


def with_attrs(step: PreparedStep, extra: Mapping[str, Any]) -> PreparedStep:
    """``step`` rebound with ``extra`` added to its constant attributes (values computed
    once at load, e.g. from a weight)."""
    return _prepared(step.index, step.op, step.handler, step.inputs, step.outputs, {**step.attrs, **extra})


def prepare(graph: Graph) -> list[PreparedStep]:
    """Every instruction of ``graph``, in order, prepared (handlers resolved once)."""
    return [prepare_instruction(i, instr) for i, instr in enumerate(graph.instructions)]


def int_slots(graph: Graph) -> frozenset[int]:
    """The slots holding host ints (dynamic sizes computed on the host)."""
    return frozenset(i for i, slot in enumerate(graph.slots) if isinstance(slot.type, ScalarType))


def specialise(steps: Sequence[PreparedStep], ints: dict[int, Any], host: frozenset[int]) -> list[PreparedStep]:
    """The array steps of ``steps`` with every host int of ``ints`` bound.

    Args:
        steps: prepared steps of one graph.
        ints: host-int slot -> its value for one input shape (complete: every host int).
        host: the graph's host-int slots; steps writing only those are dropped.
    """
    out = []
    for step in steps:
        if step.outputs and all(s in host for s in step.outputs):
            continue
        if not step.reads_ints:
            out.append(step)
            continue
        attrs = {k: (_resolve(v, ints) if _holds_ref(v) else v) for k, v in step.attrs.items()}
        out.append(_prepared(step.index, step.op, step.handler, step.inputs, step.outputs, attrs))
    return out
