"""Fused projections: the linears that read one input become one linear and a split.

A decoder layer multiplies its normed hidden state by q, k and v (and later by gate and
up) separately; each matmul is a launch and a pass over the input. Concatenating the
weights along their output rows gives one matmul whose result a ``split`` cuts into the
same values (MLX's split returns views, so the cut copies nothing). Rows are independent
in a matmul and in MLX's packing (a quantized row's groups run along its input features),
so the fused weight is the parts' rows one after another: for a quantized weight, each
packed part (weight, scales, biases) concatenates the same way, and the bias too.

The pass works on the IR (``Graph`` + constants), so the exporter and the upstream
importer share it. Linears are grouped by input slot and weight kind: plain ``linear`` on
a constant weight of one dtype and input width, or ``quantized_linear`` of one type, each
group all with a constant bias or all without. A group of two or more fuses; the fused
instruction takes the first member's place (every member reads the same input and
constants, so they are all ready there) and the split writes the members' own result
slots, so nothing downstream changes.

**Alignment.** Each part of the split starts at a multiple of ``ALIGN`` (128) output
features, so the views MLX reads afterwards keep aligned, vectorizable starts. A part
whose size is not a multiple of 128 (e.g. 9 query heads of 64, SmolLM2-135M) is followed
by zero rows up to the next multiple; the split's extra pieces are never read. The last
part needs no padding.

The fused constants are made by ``concat``, a function of row blocks (a part's data, or
zero rows), so a writer that produces constants lazily can pass its own.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from .catalog import lookup
from .graph import UNTYPED_TENSOR, Graph, Instruction, Slot, SlotKind, TensorType
from .payload import ITEMSIZE

ALIGN = 128
_BIAS_AT = {"linear": 2, "quantized_linear": 4}


@dataclass(frozen=True)
class RowBlock:
    """``rows`` rows of ``row_bytes`` bytes each: a constant's data, or zeros when None."""

    data: Optional[Any]
    rows: int
    row_bytes: int


Concat = Callable[[Sequence[RowBlock]], Any]


def concat_bytes(blocks: Sequence[RowBlock]) -> np.ndarray:
    """The blocks' bytes one after another (uint8): constants held as bytes or buffers."""
    return np.concatenate([
        np.zeros(b.rows * b.row_bytes, np.uint8) if b.data is None else np.frombuffer(b.data, np.uint8)
        for b in blocks
    ])  # fmt: skip


def fuse_projections(
    graph: Graph, constants: Mapping[int, Any], concat: Concat = concat_bytes
) -> tuple[Graph, dict[int, Any]]:
    """``graph`` with every group of linears sharing an input fused (see the module doc).

    Args:
        graph: a lowered or imported graph (not changed).
        constants: constant slot -> its data (C-order bytes, or whatever ``concat`` takes).
        concat: builds a fused constant's data from row blocks.

    Returns:
        The new graph and constants. The members' old weights stay as slots; nothing reads
        them any more, so a compaction (``ir.passes.simplify``) drops them.
    """
    slots = list(graph.slots)
    out_constants = dict(constants)
    groups: dict[tuple, list[int]] = {}
    for index, instr in enumerate(graph.instructions):
        key = _group_key(instr, slots)
        if key is not None:
            groups.setdefault(key, []).append(index)
    replaced: dict[int, list[Instruction]] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        fuser = _Fuser(slots, out_constants, concat)
        replaced[members[0]] = fuser.fuse([graph.instructions[i] for i in members])
        replaced.update({i: [] for i in members[1:]})
    instructions = [new for i, instr in enumerate(graph.instructions) for new in replaced.get(i, [instr])]
    fused = Graph(slots, instructions, list(graph.inputs), list(graph.outputs))
    for instrs in replaced.values():
        for instr in instrs:
            lookup(instr.op).validate(instr, fused)
    return fused, out_constants


def linear_count(instructions: Sequence[Instruction]) -> int:
    """How many of ``instructions`` are matmuls on weights (``linear``, ``quantized_linear``)."""
    return sum(instr.op in _BIAS_AT for instr in instructions)


def _static(slots: list[Slot], slot: Optional[int]) -> Optional[TensorType]:
    """The type of a constant slot with a static shape (None for anything else)."""
    if slot is None or slots[slot].kind is not SlotKind.CONSTANT:
        return None
    t = slots[slot].type
    if not isinstance(t, TensorType) or t.shape is None or not all(isinstance(d, int) for d in t.shape):
        return None
    return t


def _group_key(instr: Instruction, slots: list[Slot]) -> Optional[tuple]:
    """What linears must share to fuse: input, op, weight dtypes and widths, type, bias."""
    if instr.op not in _BIAS_AT or len(instr.outputs) != 1:
        return None
    bias_at = _BIAS_AT[instr.op]
    weights = instr.inputs[1:bias_at]
    present = [s for s in weights if s is not None]
    types = [_static(slots, s) for s in present]
    if any(t is None or len(t.shape) != 2 for t in types):  # type: ignore[union-attr]
        return None
    bias = instr.inputs[bias_at] if len(instr.inputs) > bias_at else None
    if bias is not None:
        b = _static(slots, bias)
        if b is None or len(b.shape) != 1:
            return None
        layout_bias: Optional[str] = b.dtype
    else:
        layout_bias = None
    layout = tuple((t.dtype, t.shape[1]) for t in types)  # type: ignore[union-attr]
    where = tuple(s is not None for s in weights)
    return (instr.inputs[0], instr.op, layout, where, layout_bias, instr.attrs)


def _padding(rows: Sequence[int]) -> list[int]:
    """Zero rows after each part so the next part starts at a multiple of ``ALIGN``."""
    return [(-n) % ALIGN for n in rows[:-1]] + [0]


def fused_name(names: Sequence[str]) -> str:
    """The fused constant's name: the members' common module path and their joined leaf
    names, the common tail kept (``...self_attn.q_proj.weight``, ``k_proj``, ``v_proj`` ->
    ``...self_attn.qkv_proj.weight``; gate and up -> ``gate_up_proj``; other leaves joined
    with ``+``: ``w1+w3``); names that differ elsewhere are joined whole with ``+``."""
    split = [n.split(".") for n in names]
    p = 0
    while all(len(s) > p for s in split) and len({s[p] for s in split}) == 1:
        p += 1
    tails = {tuple(s[p + 1 :]) for s in split}
    if any(len(s) <= p for s in split) or len(tails) != 1:
        return "+".join(names)
    leaves = [s[p] for s in split]
    if all(leaf.endswith("_proj") for leaf in leaves):
        stems = [leaf.removesuffix("_proj") for leaf in leaves]
        leaf = ("" if all(len(s) == 1 for s in stems) else "_").join(stems) + "_proj"
    else:
        leaf = "+".join(leaves)
    return ".".join([*split[0][:p], leaf, *tails.pop()])


class _Fuser:
    """Builds one fused group's constants and instructions, adding slots to ``slots``."""

    def __init__(self, slots: list[Slot], constants: dict[int, Any], concat: Concat) -> None:
        self.slots, self.constants, self.concat = slots, constants, concat

    def fuse(self, members: list[Instruction]) -> list[Instruction]:
        first = members[0]
        bias_at = _BIAS_AT[first.op]
        rows = [self._type(m.inputs[1]).shape[0] for m in members]
        pads = _padding(rows)  # type: ignore[arg-type]
        inputs: list[Optional[int]] = [first.inputs[0]]
        for at in range(1, bias_at + 1):
            if at >= len(first.inputs) or first.inputs[at] is None:
                inputs.append(None)
                continue
            inputs.append(self._concat([m.inputs[at] for m in members], pads))  # type: ignore[misc]
        total = sum(rows) + sum(pads)
        x = self.slots[first.inputs[0]]  # type: ignore[index]
        fused_out = self._add(Slot(self._name(members, 0, ".out"), SlotKind.TEMP, _with_width(x.type, total)))
        sizes: list[int] = []
        outs: list[int] = []
        for member, n, pad in zip(members, rows, pads):
            sizes.append(n)
            outs.append(member.outputs[0])
            if pad:
                sizes.append(pad)
                outs.append(self._add(Slot(self.slots[member.outputs[0]].name + ".pad", SlotKind.TEMP,
                                           _with_width(x.type, pad))))  # fmt: skip
        rank = len(x.type.shape) if isinstance(x.type, TensorType) and x.type.shape is not None else None
        dim = rank - 1 if rank else -1
        linear = replace(first, inputs=tuple(inputs), outputs=(fused_out,))
        split = Instruction("split", (fused_out,), tuple(outs), (("sizes", tuple(sizes)), ("dim", dim)))
        return [linear, split]

    def _type(self, slot: Optional[int]) -> TensorType:
        t = self.slots[slot].type  # type: ignore[index]
        assert isinstance(t, TensorType) and t.shape is not None
        return t

    def _name(self, members: list[Instruction], at: int, suffix: str = "") -> str:
        return fused_name([self.slots[m.inputs[at]].name for m in members]) + suffix  # type: ignore[index]

    def _concat(self, parts: list[int], pads: list[int]) -> int:
        """A constant of the parts' rows, each followed by its zero rows."""
        t = self._type(parts[0])
        row_bytes = ITEMSIZE[t.dtype] * int(np.prod(t.shape[1:], dtype=np.int64))  # type: ignore[index]
        blocks: list[RowBlock] = []
        for part, pad in zip(parts, pads):
            n = self._type(part).shape[0]
            blocks.append(RowBlock(self.constants[part], n, row_bytes))  # type: ignore[arg-type]
            if pad:
                blocks.append(RowBlock(None, pad, row_bytes))
        rows = sum(b.rows for b in blocks)
        names = [self.slots[p].name for p in parts]
        slot = self._add(Slot(fused_name(names), SlotKind.CONSTANT, TensorType(t.dtype, (rows, *t.shape[1:]))))
        self.constants[slot] = self.concat(blocks)
        return slot

    def _add(self, slot: Slot) -> int:
        self.slots.append(slot)
        return len(self.slots) - 1


def _with_width(t: Any, width: int) -> Any:
    """``t`` with its last dim ``width`` (an untyped temp stays untyped)."""
    if not isinstance(t, TensorType) or t.shape is None or t.dtype is None:
        return UNTYPED_TENSOR
    return TensorType(t.dtype, (*t.shape[:-1], width))
