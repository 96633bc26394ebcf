"""Tensor-parallel sharding of a program for rank ``r`` of ``N`` (Megatron-style, as mlx-lm's
``shard_linear``): the plan of which constants each rank keeps, and the rewritten graph.

- **Column-parallel** linears (q/k/v, gate/up, and their fused forms) keep rank ``r``'s
  ``1/N`` of their output features: rows of the weight (of every packed part of a quantized
  weight) and of the bias. A fused projection read by one ``split`` is cut part by part, so
  each rank keeps its share of every part, and the split's sizes are divided by ``N``.
- **Row-parallel** linears (o_proj, down_proj) keep rank ``r``'s ``1/N`` of their input
  features (columns; a quantized weight keeps whole groups) and are followed by an
  ``all_sum`` (a catalog op); their bias is added by rank 0 only.
- Everything else (embedding, norms, rotary tables, the LM head) is replicated, and each
  rank's cache holds its ``1/N`` of every layer's KV heads.
- The token ids every rank embeds are rank 0's (one ``all_sum`` of int32 ids), so ranks
  that follow rank 0's steps (``serving.parallel.step_channel``) pass zeros.

Which linears are which comes from the manifest's ``extra["tp_plan"]`` (the HF config's
``base_model_tp_plan``, recorded at export); a file without one (older, or upstream)
falls back to the module names HF models use. The values between a column-parallel
linear and its row-parallel partner are rank-local; their types are cleared (as an
imported program's temps are) since their head counts are now ``1/N`` of the recorded
ones. The graph reshapes heads with ``-1`` for the head count, so one file serves any
``N`` dividing the KV heads; KV heads are not replicated for an ``N`` that does not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from .catalog import validate_graph
from .graph import UNTYPED_TENSOR, Graph, Instruction, Slot, SlotKind, TensorType
from .quantization import QUANTIZED_OPS

COLUMN, ROW = "colwise", "rowwise"
# HF module names of the linears, for files whose manifest records no plan.
_DEFAULT_PLAN = {
    "q_proj": COLUMN, "k_proj": COLUMN, "v_proj": COLUMN, "qkv_proj": COLUMN,
    "gate_proj": COLUMN, "up_proj": COLUMN, "gate_up_proj": COLUMN,
    "o_proj": ROW, "down_proj": ROW,
}  # fmt: skip
_FUSED = ("qkv_proj", "gate_up_proj")
_LINEARS = ("linear", "quantized_linear")
# Ops that move a rank-local value between the two linears without mixing heads.
_HEAD_RESHAPES = ("view", "view_permute", "permute_view")


class ShardingError(ValueError):
    """The program cannot be split over this many ranks; the message says why and what to do."""


@dataclass(frozen=True)
class ConstantSlice:
    """What one rank keeps of a constant: along ``axis``, its ``1/N`` of each of ``parts``
    (consecutive sizes along that axis; one part unless the linear is fused)."""

    axis: int
    parts: tuple[int, ...]

    def ranges(self, rank: int, size: int) -> list[tuple[int, int]]:
        """The [start, stop) ranges along ``axis`` rank ``rank`` keeps, in order."""
        out, start = [], 0
        for part in self.parts:
            share = part // size
            out.append((start + rank * share, start + (rank + 1) * share))
            start += part
        return out


@dataclass(frozen=True)
class ShardPlan:
    """A program rewritten for one rank: its graph, the slice of each sharded constant
    (the others are kept whole), and the manifest with this rank's cache geometry."""

    rank: int
    size: int
    graph: Graph
    slices: dict[int, ConstantSlice]
    manifest: dict[str, Any]


def _glob(pattern: str) -> re.Pattern[str]:
    """A plan key (``layers.*.self_attn.q_proj``: ``*`` a layer index) as a regex matching
    the module names that end with it."""
    body = r"\.".join(r"\d+" if p == "*" else re.escape(p) for p in pattern.split("."))
    return re.compile(rf"(?:^|.*\.){body}$")


def linear_roles(graph: Graph, manifest: Mapping[str, Any]) -> dict[int, str]:
    """Instruction index -> ``colwise`` / ``rowwise`` for every linear the plan names.

    Raises:
        ShardingError: the plan names a style other than colwise, rowwise or replicated.
    """
    plan = (manifest.get("extra") or {}).get("tp_plan") or _DEFAULT_PLAN
    # HF's plans name the separate projections; mlx-pte's export may fuse them.
    plan = {**plan, **{k: v for k, v in _DEFAULT_PLAN.items() if k in _FUSED}}
    rules = [(_glob(pattern), pattern, str(style)) for pattern, style in plan.items()]
    roles = {}
    for index, instr in enumerate(graph.instructions):
        if instr.op not in _LINEARS:
            continue
        name = graph.slots[instr.inputs[1]].name.removesuffix(".weight")
        for regex, pattern, style in rules:
            if not regex.match(name):
                continue
            if style not in (COLUMN, ROW) and not style.startswith("replicated"):
                # Other styles (an embedding's, a norm's) leave those modules replicated; a
                # linear split some other way would need a rewrite mlx-pte does not have.
                raise ShardingError(
                    f"the file's tensor-parallel plan splits {pattern!r} as {style!r}; mlx-pte splits linears "
                    "only colwise or rowwise (run it on one process)"
                )
            if style in (COLUMN, ROW):
                roles[index] = style
            break
    return roles


def plan_shards(graph: Graph, manifest: Mapping[str, Any], rank: int, size: int, group: int = 0) -> ShardPlan:
    """The graph and constant slices of rank ``rank`` of ``size`` (``group``: the id the
    inserted ``all_sum`` ops name).

    Raises:
        ShardingError: ``size`` does not divide the KV heads, a sharded linear's features
            or a quantized weight's groups; or the graph mixes a rank-local value in a way
            the split cannot follow (say which instruction).
    """
    if not 0 <= rank < size:
        raise ShardingError(f"rank {rank} is not one of {size} ranks")
    for i, layer in enumerate(manifest["cache"]):
        if layer["n_kv_heads"] % size:
            raise ShardingError(
                f"{size} ranks do not divide the {layer['n_kv_heads']} KV heads of cache layer {i}; "
                f"run with a rank count that divides {layer['n_kv_heads']} (mlx-pte does not replicate KV heads)"
            )
    roles = linear_roles(graph, manifest)
    if not any(style == ROW for style in roles.values()):
        raise ShardingError(
            "no linear of this program is row-parallel by its tensor-parallel plan or by HF module names "
            "(o_proj, down_proj); it cannot be split, run it on one process"
        )
    return _Rewrite(graph, rank, size, group).run(roles, manifest)


def _reading(instr: Instruction, renames: Mapping[int, int]) -> Instruction:
    """``instr`` with its operands renamed."""
    if not any(s in renames for s in instr.inputs):
        return instr
    return replace(instr, inputs=tuple(renames.get(s, s) if s is not None else None for s in instr.inputs))


def _bias_at(instr: Instruction) -> int:
    return 2 if instr.op == "linear" else 4


class _Rewrite:
    def __init__(self, graph: Graph, rank: int, size: int, group: int) -> None:
        self.graph = graph
        self.rank, self.size, self.group = rank, size, group
        self.slots: list[Slot] = list(graph.slots)
        self.slices: dict[int, ConstantSlice] = {}
        self.local: set[int] = set()  # slots holding rank-local values
        readers: dict[int, list[int]] = {}
        for index, instr in enumerate(graph.instructions):
            for s in instr.inputs:
                if s is not None:
                    readers.setdefault(s, []).append(index)
        self.readers = readers

    def run(self, roles: dict[int, str], manifest: Mapping[str, Any]) -> ShardPlan:
        out, tokens = self._rank0_tokens()
        for index, instr in enumerate(self.graph.instructions):
            instr = _reading(instr, tokens)
            role = roles.get(index)
            if role == COLUMN:
                out.append(self._column(index, instr))
            elif role == ROW:
                out.extend(self._row(index, instr))
            elif any(s in self.local for s in instr.inputs if s is not None):
                out.append(self._follow(index, instr))
            else:
                out.append(instr)
        leaked = [self.slots[s].name for s in self.graph.outputs if s in self.local]
        if leaked:
            raise ShardingError(f"outputs {leaked} would hold one rank's share only; this program cannot be split")
        graph = Graph(self.slots, out, list(self.graph.inputs), list(self.graph.outputs))
        validate_graph(graph)
        cache = [dict(layer, n_kv_heads=layer["n_kv_heads"] // self.size) for layer in manifest["cache"]]
        extra = dict(manifest.get("extra") or {}, tensor_parallel={"rank": self.rank, "size": self.size})
        return ShardPlan(self.rank, self.size, graph, self.slices, dict(manifest, cache=cache, extra=extra))

    def _rank0_tokens(self) -> tuple[list[Instruction], dict[int, int]]:
        """Instructions that give every rank rank 0's token ids (an ``all_sum`` of rank 0's ids
        and zeros from the others), and the renaming of the tokens input to their result:
        a rank following rank 0's steps need not know the ids, which may still be on the
        device when rank 0 builds the step."""
        tokens = self.graph.inputs[0]
        t = self.slots[tokens].type
        assert isinstance(t, TensorType)
        ids = self._new_slot(Slot("tokens.int32", SlotKind.TEMP, TensorType("int32", t.shape)))
        out = [Instruction("cast", (tokens,), (ids,), (("dtype", "int32"),))]
        if self.rank != 0:
            zeros = self._new_slot(Slot("tokens.zeros", SlotKind.TEMP, TensorType("int32", t.shape)))
            out.append(Instruction("sub", (ids, ids), (zeros,)))
            ids = zeros
        summed = self._new_slot(Slot("tokens.rank0", SlotKind.TEMP, TensorType("int32", t.shape)))
        shared = self._new_slot(Slot("tokens.shared", SlotKind.TEMP, t))
        out += [Instruction("all_sum", (ids,), (summed,), (("group", self.group),)),
                Instruction("cast", (summed,), (shared,), (("dtype", t.dtype),))]
        return out, {tokens: shared}

    # -- the three kinds of instruction ---------------------------------------------------
    def _column(self, index: int, instr: Instruction) -> Instruction:
        (out,) = instr.outputs
        features = self._features(instr)
        readers = self.readers.get(out, [])
        split = self.graph.instructions[readers[0]] if len(readers) == 1 else None
        parts = _fused_parts(split, features) if split is not None else (features,)
        where = self._where(index, instr)
        if any(p % self.size for p in parts):
            raise ShardingError(f"{where}: {self.size} ranks do not divide its output features {list(parts)}")
        for s in self._weight_operands(instr):
            self._slice(s, ConstantSlice(0, parts), where)
        bias = instr.inputs[_bias_at(instr)]
        if bias is not None:
            self._slice(bias, ConstantSlice(0, parts), where)
        self._make_local(out)
        return instr

    def _row(self, index: int, instr: Instruction) -> list[Instruction]:
        where = self._where(index, instr)
        if instr.inputs[0] not in self.local:
            raise ShardingError(
                f"{where} is row-parallel by the plan, but its input is not the output of column-parallel "
                "linears; this program's plan does not fit its graph, run it on one process"
            )
        k = self._in_features(instr)
        group = instr.attr("group_size") if instr.op == "quantized_linear" else None
        if k % self.size or (group is not None and (k // self.size) % group):
            unit = f"groups of {group}" if group is not None else "features"
            raise ShardingError(f"{where}: {self.size} ranks do not divide its {k} input features into whole {unit}")
        for s in self._weight_operands(instr):
            t = self.slots[s].type
            assert isinstance(t, TensorType) and t.shape is not None
            self._slice(s, ConstantSlice(1, (t.shape[1],)), where)  # type: ignore[arg-type]
        inputs = list(instr.inputs)
        if self.rank != 0:
            inputs[_bias_at(instr)] = None  # the bias is added once, before the sum
        (out,) = instr.outputs
        partial = self._new_slot(Slot(self.slots[out].name + ".partial", SlotKind.TEMP, self.slots[out].type))
        return [
            replace(instr, inputs=tuple(inputs), outputs=(partial,)),
            Instruction("all_sum", (partial,), (out,), (("group", self.group),)),
        ]

    def _follow(self, index: int, instr: Instruction) -> Instruction:
        """An instruction reading a rank-local value: its results are rank-local too."""
        where = self._where(index, instr)
        if instr.op == "split":
            sizes = instr.attr("sizes")
            assert isinstance(sizes, tuple)
            if not all(isinstance(s, int) and s % self.size == 0 for s in sizes):
                raise ShardingError(f"{where} splits a rank-local value into sizes {list(sizes)} that {self.size} ranks do not divide")
            instr = replace(instr, attrs=tuple((k, tuple(s // self.size for s in sizes) if k == "sizes" else v)  # type: ignore[operator]
                                               for k, v in instr.attrs))
        elif instr.op == "split_heads":
            heads = instr.attr("heads")
            assert isinstance(heads, tuple)
            if any(h % self.size for h in heads):
                raise ShardingError(f"{where} splits a rank-local value into head groups {list(heads)} that "
                                    f"{self.size} ranks do not divide")
            instr = replace(instr, attrs=tuple((k, tuple(h // self.size for h in heads) if k == "heads" else v)  # type: ignore[operator]
                                               for k, v in instr.attrs))
        elif instr.op == "glu" and instr.attr("width") is not None:
            instr = replace(instr, attrs=tuple((k, v // self.size if k == "width" else v)  # type: ignore[operator]
                                               for k, v in instr.attrs))
        elif instr.op in _HEAD_RESHAPES and -1 not in (instr.attr("shape") or ()):  # type: ignore[operator]
            raise ShardingError(
                f"{where} reshapes a rank-local value to a fixed head count; export the model again with this "
                "mlx-pte (its graph writes head counts as -1)"
            )
        elif any(self.slots[s].kind is SlotKind.CONSTANT and s not in self.slices
                 for s in instr.inputs if s is not None and len(getattr(self.slots[s].type, "shape", ()) or ()) > 1):
            raise ShardingError(f"{where} combines a rank-local value with a whole weight; this program cannot be split")
        for s in instr.outputs:
            self._make_local(s)
        return instr

    # -- helpers --------------------------------------------------------------------------
    def _where(self, index: int, instr: Instruction) -> str:
        return f"instruction {index} ({instr.op!r} of {self.slots[instr.inputs[1]].name!r})" if instr.op in _LINEARS \
            else f"instruction {index} ({instr.op!r})"

    def _weight_operands(self, instr: Instruction) -> list[int]:
        if instr.op == "linear":
            return [instr.inputs[1]]  # type: ignore[list-item]
        at = QUANTIZED_OPS[instr.op]
        return [s for s in instr.inputs[at : at + 3] if s is not None]

    def _features(self, instr: Instruction) -> int:
        t = self.slots[instr.inputs[1]].type  # type: ignore[index]
        assert isinstance(t, TensorType) and t.shape is not None
        return int(t.shape[0])  # type: ignore[arg-type]

    def _in_features(self, instr: Instruction) -> int:
        t = self.slots[instr.inputs[1]].type  # type: ignore[index]
        assert isinstance(t, TensorType) and t.shape is not None
        cols = int(t.shape[1])  # type: ignore[arg-type]
        return cols if instr.op == "linear" else cols * 32 // int(instr.attr("bits"))  # type: ignore[arg-type]

    def _slice(self, slot: int, sl: ConstantSlice, where: str) -> None:
        s = self.slots[slot]
        if s.kind is not SlotKind.CONSTANT or slot in self.slices:
            raise ShardingError(f"{where}: its weight {s.name!r} is not a constant of its own; this program cannot be split")
        t = s.type
        assert isinstance(t, TensorType) and t.shape is not None
        if sum(sl.parts) != t.shape[sl.axis] or any(p % self.size for p in sl.parts):
            raise ShardingError(f"{where}: {self.size} ranks do not divide {s.name!r} of shape {list(t.shape)}")
        shape = list(t.shape)
        shape[sl.axis] = sum(p // self.size for p in sl.parts)
        self.slots[slot] = replace(s, type=TensorType(t.dtype, tuple(shape)))
        self.slices[slot] = sl

    def _make_local(self, slot: int) -> None:
        self.local.add(slot)
        if self.slots[slot].kind is SlotKind.TEMP:
            self.slots[slot] = replace(self.slots[slot], type=UNTYPED_TENSOR)

    def _new_slot(self, slot: Slot) -> int:
        self.slots.append(slot)
        return len(self.slots) - 1


def _fused_parts(reader: Instruction, features: int) -> tuple[int, ...]:
    """The parts of a linear's ``features`` outputs its one reader cuts apart (a fused
    projection's), each of which every rank keeps a share of; one part when it cuts none."""
    if reader.op == "split" and all(isinstance(s, int) for s in reader.attr("sizes")):  # type: ignore[union-attr]
        return tuple(reader.attr("sizes"))  # type: ignore[arg-type]
    if reader.op == "split_heads":
        dim = reader.attr("head_dim")
        return tuple(h * dim for h in reader.attr("heads"))  # type: ignore[union-attr, operator]
    width = reader.attr("width") if reader.op == "glu" else None
    if isinstance(width, int):
        return tuple(p for p in (width, features - 2 * width, width) if p)
    return (features,)
