"""The op catalog: every op a graph may contain, shared by the lowering (which emits
instructions) and the interpreter (which runs them).

An entry states the op's operands (in order; optional ones may be omitted as None), its
attributes with their kinds and rules (``RULES``: e.g. an axis of the operand, a
permutation, sizes that match the declared result), how many results it produces, and
its output rule (the result's dtype and shape in terms of the operands), so a payload
can be validated structurally before anything runs.

Conventions every entry follows (the lowering guarantees them, so handlers need not
promote): operands of elementwise ops already share the result's dtype (the lowering
inserts ``cast``); dims are non-negative; shapes may hold ``SlotRef``s to int scalar
slots (dynamic sizes) and ``-1`` where the op allows it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .errors import FormatError, UnknownOpError
from .catalog_rules import RULES, Shapes, is_int
from .graph import DTYPES, Graph, Instruction, ScalarType, SlotRef, TensorType

# Attribute kinds and the Python values they accept.
ATTR_KINDS = ("int", "float", "bool", "str", "dtype", "ints", "floats", "int_or_ref", "ints_or_refs")


@dataclass(frozen=True)
class AttrSpec:
    """An attribute: its kind, and optionally a ``rule`` (a name in ``RULES``) its value obeys
    given the instruction's operands and results (e.g. "axis": an axis of the first operand)."""

    name: str
    kind: str
    required: bool = True
    rule: Optional[str] = None
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpSpec:
    """One op's signature.

    ``operands``: a trailing ``?`` marks an optional operand (optional operands at the end may
    be left out of an instruction altogether, so adding one keeps older files valid and their
    bytes unchanged); a single operand named with a
    trailing ``*`` takes one or more slots (``cat``). ``n_outputs`` None means one or more
    results (``split``: one per size). ``scalar_result``: the results are int scalar slots
    (sizes computed on the host), not tensors. ``check``: further rules of the op, run
    after the structural ones (raises FormatError).
    """

    name: str
    operands: tuple[str, ...]
    attrs: tuple[AttrSpec, ...] = ()
    n_outputs: Optional[int] = 1
    output_rule: str = "same dtype and shape as the first operand"
    scalar_result: bool = False
    check: Optional[Callable[[Instruction, Graph], None]] = None

    @property
    def variadic(self) -> bool:
        return len(self.operands) == 1 and self.operands[0].endswith("*")

    def validate(self, instr: Instruction, graph: Graph, index: Optional[int] = None) -> None:
        """Raise FormatError if ``instr`` (``index`` in the graph, when given) does not fit this
        op's signature and attribute rules."""
        where = f"instruction {self.name!r}" if index is None else f"instruction {index} ({self.name!r})"
        if self.variadic:
            names = (self.operands[0],) * len(instr.inputs)
            if not instr.inputs:
                raise FormatError(f"{where} takes one or more operands, the payload gives none")
        else:
            names = self.operands
            required = len(self.operands)
            while required and self.operands[required - 1].endswith("?"):
                required -= 1
            if not required <= len(instr.inputs) <= len(self.operands):
                takes = f"{required} to {len(self.operands)}" if required < len(self.operands) else f"{required}"
                raise FormatError(f"{where} takes {takes} operands, the payload gives {len(instr.inputs)}")
        for name, slot in zip(names, instr.inputs):
            if slot is None:
                if not name.endswith("?"):
                    raise FormatError(f"{where}: required operand {name!r} is missing")
                continue
            if not 0 <= slot < len(graph.slots):
                raise FormatError(f"{where}: operand {name!r} refers to slot {slot}, which does not exist")
            if not isinstance(graph.slots[slot].type, TensorType):
                raise FormatError(f"{where}: operand {name!r} (slot {slot}) must be a tensor")
        if self.n_outputs is None and not instr.outputs:
            raise FormatError(f"{where} produces one or more results, the payload gives none")
        if self.n_outputs is not None and len(instr.outputs) != self.n_outputs:
            raise FormatError(f"{where} produces {self.n_outputs} results, the payload gives {len(instr.outputs)}")
        result_type = ScalarType if self.scalar_result else TensorType
        for slot in instr.outputs:
            if not 0 <= slot < len(graph.slots):
                raise FormatError(f"{where}: result slot {slot} does not exist")
            if not isinstance(graph.slots[slot].type, result_type):
                raise FormatError(f"{where}: result slot {slot} must be a {result_type.__name__}")
        known = {a.name: a for a in self.attrs}
        given = dict(instr.attrs)
        shapes = Shapes(instr, graph)
        for name in given:
            if name not in known:
                raise FormatError(f"{where}: unknown attribute {name!r}")
        for spec in self.attrs:
            if spec.name not in given or given[spec.name] is None:
                if spec.required:
                    raise FormatError(f"{where}: attribute {spec.name!r} is missing")
                continue
            _check_attr(where, spec, given[spec.name], graph)
            if shapes.typed:
                _check_rule(where, spec, given[spec.name], shapes)
        if self.check is not None:
            try:
                self.check(instr, graph)
            except FormatError as exc:
                # The op's own checks name the op; the graph's index is only known here.
                message, unnamed = str(exc), f"instruction {self.name!r}"
                if index is None or not message.startswith(unnamed):
                    raise
                raise FormatError(where + message[len(unnamed):]) from None


def _check_attr(where: str, spec: AttrSpec, value: object, graph: Graph) -> None:
    def ref_ok(v: object) -> bool:
        return (
            isinstance(v, SlotRef)
            and 0 <= v.slot < len(graph.slots)
            and graph.slots[v.slot].type == ScalarType("int")
        )

    ok = {
        "int": is_int,
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "dtype": lambda v: v in DTYPES,
        "ints": lambda v: isinstance(v, tuple) and all(is_int(x) for x in v),
        "floats": lambda v: isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v),
        "int_or_ref": lambda v: is_int(v) or ref_ok(v),
        "ints_or_refs": lambda v: isinstance(v, tuple) and all(is_int(x) or ref_ok(x) for x in v),
    }[spec.kind]
    if not ok(value):
        expected = f"one of {', '.join(DTYPES)}" if spec.kind == "dtype" else spec.kind
        raise FormatError(f"{where}: attribute {spec.name!r} must be {expected}, got {value!r}")
    if spec.choices and value not in spec.choices:
        choices = ", ".join(spec.choices)
        raise FormatError(f"{where}: attribute {spec.name!r} must be one of {choices}, got {value!r}")


def _check_rule(where: str, spec: AttrSpec, value: object, shapes: Shapes) -> None:
    if spec.rule is None:
        return
    problem = RULES[spec.rule](value, shapes)
    if problem:
        raise FormatError(f"{where}: attribute {spec.name!r} = {value!r} {problem}")


CATALOG: dict[str, OpSpec] = {}


def define(spec: OpSpec) -> OpSpec:
    for attr in spec.attrs:
        if attr.kind not in ATTR_KINDS:
            raise ValueError(f"op {spec.name}: unknown attribute kind {attr.kind!r}")
        if attr.rule is not None and attr.rule not in RULES:
            raise ValueError(f"op {spec.name}: unknown attribute rule {attr.rule!r}")
    if spec.name in CATALOG:
        raise ValueError(f"op {spec.name} is defined twice")
    CATALOG[spec.name] = spec
    return spec


def lookup(name: str) -> OpSpec:
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownOpError(
            f"unknown op {name!r}: this file needs a newer mlx-pte (or was not written by it)"
        ) from None


def validate_graph(graph: Graph) -> None:
    """Structural check of every instruction against the catalog.

    (Dataflow order and slot types are checked with the payload: ``ir.payload.check_graph``.)
    """
    for index, instr in enumerate(graph.instructions):
        lookup(instr.op).validate(instr, graph, index)


# -- the ops -------------------------------------------------------------------------
def _attrs(*specs: tuple) -> tuple[AttrSpec, ...]:
    return tuple(AttrSpec(*s) for s in specs)


# The op families, each in a module of its own, define themselves on import; they build on
# ``define`` above. UPSTREAM_ONLY: the ops only imported upstream programs use.
from . import catalog_core, catalog_moe  # noqa: E402,F401
from .catalog_upstream import UPSTREAM_ONLY  # noqa: E402,F401
