"""Import an upstream ExecuTorch MLX program (``export_llm_hf --use-offgraph-cache``) into
mlx-pte's IR, with the same signature and manifest fields as mlx-pte's own programs, so
everything after loading (sessions, every cache kind, generation, the server) is shared.

Upstream's forward is ``(input_ids int64[1, T], cache_position int64[T]) -> logits[1, T, V]``
in the model dtype; the imported graph is mlx-pte's
``(tokens int64[1, T], positions int64[T], rows int64[R]) -> float32[R, V]``: the logits
of the selected rows, cast. The cache geometry comes from the constant methods; the
weights are views of the named data (no copy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from ..errors import FormatError
from ..fuse_projections import fuse_projections
from ..graph import Graph, SlotKind, SymDim, TensorType
from ..manifest import CacheLayerSpec, Manifest
from ..passes import compact
from ..payload import ITEMSIZE, check_graph
from .builder import ImportBuilder
from .init_chain import FOLDABLE, fold_init_chain
from .nodes import translation
from .reader import MAGIC, decode_graph, node_type_names

UPSTREAM_MAGIC = MAGIC
SOURCE = "executorch-mlx"  # the manifest's extra["source"] of an imported program
_TENSOR_SLOT = 0  # SlotType.TensorSlot
GEOMETRY_METHODS = (
    "get_n_caches", "get_kv_heads", "get_head_dims", "get_windows", "get_prefill_chunk_size", "get_max_ctx_len",
)  # fmt: skip


class UnsupportedNodeError(FormatError):
    """The program uses node types mlx-pte has no translation for (all listed)."""

    def __init__(self, node_types: Mapping[str, int]) -> None:
        self.node_types = dict(node_types)
        listed = ", ".join(f"{name} ({count})" for name, count in sorted(node_types.items()))
        super().__init__(f"the upstream MLX program uses node types mlx-pte does not run: {listed}")


class MutableBuffersError(FormatError):
    """The program keeps state (e.g. a KV cache) in graph buffers, which mlx-pte does not run."""


@dataclass(frozen=True)
class ImportedPayload:
    """An imported program: the IR graph, its manifest, and each constant's bytes."""

    graph: Graph
    manifest: dict
    weights: Mapping[int, memoryview]

    def constant_bytes(self, slot: int) -> memoryview:
        return self.weights[slot]


@dataclass(frozen=True)
class _Geometry:
    caches: tuple[CacheLayerSpec, ...]
    max_step: int
    max_context: int


def import_program(
    payload: memoryview, named_data: Mapping[str, memoryview], constant_methods: Mapping[str, Union[int, tuple]]
) -> ImportedPayload:
    """Import the payload of an upstream MLX delegate exported from an LLM.

    Raises:
        UnsupportedNodeError: node types without a translation (every one listed).
        FormatError: a malformed payload, missing geometry methods or weights, or a
            signature other than an LLM forward's.
    """
    geometry = _geometry(constant_methods)
    graph = Graph()
    T = SymDim("T", 1, geometry.max_step)
    R = SymDim("R", 1, geometry.max_step)
    tokens = _add_input(graph, "tokens", (1, T))
    positions = _add_input(graph, "positions", (T,))
    rows = _add_input(graph, "rows", (R,))
    fb, builder, weights = _start(graph, payload, named_data, len(geometry.caches))
    meta = list(fb.tensorMeta or ())
    _bind_llm_inputs(builder, fb, meta, tokens, positions)
    _translate(builder, fb)
    vocab, dtype = _add_logits_output(graph, builder, fb, meta, rows)
    _finish(graph)
    graph, weights = _fused(graph, weights)
    manifest = Manifest(
        config={},
        dtype=dtype,
        vocab_size=vocab,
        cache=geometry.caches,
        max_step=geometry.max_step,
        max_context=geometry.max_context,
        extra={"source": SOURCE, "upstream_version": _text(fb.version)},
    )
    return ImportedPayload(graph, manifest.to_dict(), weights)


def import_function(payload: memoryview, named_data: Mapping[str, memoryview]) -> ImportedPayload:
    """Import any upstream MLX delegate with the delegate's own signature: its inputs and
    outputs in the order its graph lists them (the delegate call's argument order, which
    need not be the method's), dynamic dims with their recorded maxima, and an empty
    manifest. Its ``update_and_attend`` calls run on whatever cache the caller passes to ``run``.

    Raises:
        UnsupportedNodeError, FormatError: as ``import_program``.
    """
    graph = Graph()
    fb, builder, weights = _start(graph, payload, named_data, None)
    meta = list(fb.tensorMeta or ())
    for tid in _tensor_ids(fb.inputMap, "inputs"):
        t = _tensor_type(meta, tid, "an input", dynamic=True)
        builder.bind(tid, _add_input(graph, f"input{len(graph.inputs)}", t.shape, t.dtype))
    _translate(builder, fb)
    graph.outputs.extend(builder.slot_of(tid) for tid in _tensor_ids(fb.outputMap, "outputs"))
    _finish(graph)
    return ImportedPayload(graph, {}, weights)


def _start(
    graph: Graph, payload: memoryview, named_data: Mapping[str, memoryview], n_caches: Optional[int]
) -> tuple[Any, ImportBuilder, dict[int, memoryview]]:
    """Decode the payload; a builder over ``graph`` with every constant bound."""
    fb = decode_graph(payload)
    if fb.numMutableBufferTensors:
        raise MutableBuffersError(
            "the upstream program keeps its KV cache in graph buffers; mlx-pte runs off-graph-cache "
            "exports only (export_llm_hf --use-offgraph-cache)"
        )
    _check_node_types(fb)  # first: untranslated node types are the news, whatever else is foreign
    counts = (fb.numConstantTensors, fb.numInputTensors, fb.numOutputTensors, fb.numTempTensors)
    meta = list(fb.tensorMeta or ())
    writable_from = fb.numConstantTensors + fb.numInputTensors
    builder = ImportBuilder(graph, sum(counts), fb.numValues, n_caches, writable_from, meta)
    weights = _bind_constants(graph, builder, fb, meta, named_data)
    names = node_type_names()
    inputs = range(fb.numConstantTensors, fb.numConstantTensors + fb.numInputTensors)
    fold_init_chain(builder, [(_node_name(i, names), i.op) for i in _chains(fb)[0]], weights, inputs)
    return fb, builder, weights


def _finish(graph: Graph) -> None:
    _drop_dead_code(graph)
    check_graph(graph)


def _fused(graph: Graph, weights: Mapping[int, memoryview]) -> tuple[Graph, dict[int, memoryview]]:
    """``graph`` with its projections fused and the weights it no longer reads dropped."""
    fused, constants = compact(*fuse_projections(graph, weights))
    return fused, {slot: memoryview(data) for slot, data in constants.items()}


def _text(raw: Any) -> Optional[str]:
    return ImportBuilder.text(raw) if raw is not None else None


def _geometry(methods: Mapping[str, Union[int, tuple]]) -> _Geometry:
    missing = [m for m in GEOMETRY_METHODS if m not in methods]
    if missing:
        raise FormatError(
            f"the upstream program does not publish {', '.join(missing)}: export it with "
            "export_llm_hf --use-offgraph-cache, which writes the cache geometry as constant methods"
        )
    n = methods["get_n_caches"]
    lists = {m: methods[m] for m in ("get_kv_heads", "get_head_dims", "get_windows")}
    for name, value in lists.items():
        if not isinstance(value, tuple) or len(value) != n:
            raise FormatError(f"{name} must list one int per cache ({n} caches), it returns {value!r}")
    scalars = {m: methods[m] for m in ("get_n_caches", "get_prefill_chunk_size", "get_max_ctx_len")}
    for name, value in scalars.items():
        if not isinstance(value, int) or value < 1:
            raise FormatError(f"{name} must return a positive int, it returns {value!r}")
    if any(h < 1 for h in lists["get_kv_heads"]) or any(d < 1 for d in lists["get_head_dims"]) or any(
        w < 0 for w in lists["get_windows"]
    ):
        raise FormatError("the published cache geometry has a non-positive head count or head dim, or a negative window")
    caches = tuple(
        CacheLayerSpec(window=w, n_kv_heads=h, head_dim=d, v_head_dim=d)
        for h, d, w in zip(lists["get_kv_heads"], lists["get_head_dims"], lists["get_windows"])
    )
    return _Geometry(caches, scalars["get_prefill_chunk_size"], scalars["get_max_ctx_len"])


def _add_input(graph: Graph, name: str, shape: tuple, dtype: str = "int64") -> int:
    slot = graph.add_slot(name, SlotKind.INPUT, TensorType(dtype, shape))
    graph.inputs.append(slot)
    return slot


def _tensor_type(meta: list, tid: int, what: str, dynamic: bool = False) -> TensorType:
    """The recorded type of ``tid``: a dynamic dim is -1, or with ``dynamic`` a SymDim up to
    its recorded maximum (one symbol per tensor axis: the payload does not say which agree).
    The recorded minimum is not kept: torch.export reports 2 for a dim declared from 1 (it
    specializes sizes 0 and 1), and the dim runs at 1."""
    if not 0 <= tid < len(meta) or meta[tid] is None:
        raise FormatError(f"{what} (tensor {tid}) has no recorded type")
    m = meta[tid]
    dims = tuple(
        SymDim(f"t{tid}_{axis}", 0, None if d.maxValue < 0 else d.maxValue)
        if dynamic and d.value < 0 else d.value
        for axis, d in enumerate(m.shape or ())
    )  # fmt: skip
    return TensorType(ImportBuilder.dtype(m.scalarType), dims)


def _bind_constants(graph: Graph, builder: ImportBuilder, fb: Any, meta: list, named_data: Mapping) -> dict:
    weights: dict[int, memoryview] = {}
    for named in fb.namedSlots or ():
        slot_ref = named.slot
        if slot_ref is None or slot_ref.slotType != _TENSOR_SLOT or slot_ref.idx >= fb.numConstantTensors:
            continue
        name = _text(named.name) or ""
        t = _tensor_type(meta, slot_ref.idx, f"constant {name!r}")
        if any(d < 0 for d in t.shape):
            raise FormatError(f"constant {name!r} has a dynamic shape {list(t.shape)}")
        data = named_data.get(name)
        if data is None:
            raise FormatError(
                f"constant {name!r} is not in the file's named data (was it exported to a separate .ptd file? "
                "mlx-pte reads weights stored inside the .pte)"
            )
        need = ITEMSIZE[t.dtype] * math.prod(t.shape)
        if len(data) != need:
            raise FormatError(f"constant {name!r} holds {len(data)} bytes, {t.dtype}{list(t.shape)} needs {need}")
        slot = graph.add_slot(name, SlotKind.CONSTANT, t)
        weights[slot] = data
        builder.bind(slot_ref.idx, slot)
    return weights


def _tensor_ids(slots: Any, what: str) -> list[int]:
    ids = []
    for s in slots or ():
        if s.slotType != _TENSOR_SLOT:
            raise FormatError(f"the upstream program's {what} include a non-tensor value; mlx-pte runs LLM forwards")
        ids.append(s.idx)
    return ids


def _bind_llm_inputs(builder: ImportBuilder, fb: Any, meta: list, tokens: int, positions: int) -> None:
    """input_ids ([1, T] ints) -> tokens, cache_position ([T] ints) -> positions."""
    ids = _tensor_ids(fb.inputMap, "inputs")
    ranks = {tid: len(_tensor_type(meta, tid, "an input").shape) for tid in ids}
    by_rank = {rank: tid for tid, rank in ranks.items()}
    if len(ids) != 2 or set(by_rank) != {1, 2}:
        raise FormatError(
            f"the upstream program's forward takes {len(ids)} inputs of ranks {sorted(ranks.values())}; "
            "mlx-pte runs LLM forwards (input_ids [1, T], cache_position [T])"
        )
    for rank, slot in ((2, tokens), (1, positions)):
        tid = by_rank[rank]
        dtype = _tensor_type(meta, tid, "an input").dtype
        if dtype == "int64":
            builder.bind(tid, slot)
        else:
            cast = builder.temp(f"t{tid}")
            builder.emit("cast", (slot,), (cast,), dtype=dtype)
            builder.bind(tid, cast)


def _chains(fb: Any) -> tuple[list[Any], list[Any]]:
    """The init chain's instructions (none if the graph has none) and the main chain's."""
    chains = fb.instructionChains
    order = [fb.initChainIdx, fb.mainChainIdx]
    if not -1 <= fb.initChainIdx < len(chains) or not 0 <= fb.mainChainIdx < len(chains):
        raise FormatError(f"the upstream graph runs chains {order}, it has {len(chains)} chains")
    init, main = (list(chains[c].instructions or ()) if c >= 0 else [] for c in order)
    return init, main


def _node_name(instruction: Any, names: Mapping[int, str]) -> str:
    if instruction.op is None:
        code = instruction.opType
        return names.get(code, f"node type code {code} (unknown to this executorch schema)")
    return type(instruction.op).__name__[:-1]  # flatc's object classes end in "T"


def _check_node_types(fb: Any) -> None:
    """UnsupportedNodeError listing every node type without a translation (in the init chain:
    without a fold)."""
    names = node_type_names()
    unsupported: dict[str, int] = {}
    init, main = _chains(fb)
    for chain, known in ((init, lambda name: name in FOLDABLE), (main, lambda name: translation(name) is not None)):
        for instruction in chain:
            name = _node_name(instruction, names)
            if instruction.op is None or not known(name):
                unsupported[name] = unsupported.get(name, 0) + 1
    if unsupported:
        raise UnsupportedNodeError(unsupported)


def _translate(builder: ImportBuilder, fb: Any) -> None:
    names = node_type_names()
    for instruction in _chains(fb)[1]:
        translation(_node_name(instruction, names))(builder, instruction.op)


def _add_logits_output(graph: Graph, builder: ImportBuilder, fb: Any, meta: list, rows: int) -> tuple[int, str]:
    """The selected rows' logits, float32 [R, V]; returns (V, model dtype)."""
    ids = _tensor_ids(fb.outputMap, "outputs")
    if len(ids) != 1:
        raise FormatError(f"the upstream program returns {len(ids)} tensors; mlx-pte runs forwards returning logits only")
    t = _tensor_type(meta, ids[0], "the logits")
    if len(t.shape) != 3 or t.shape[0] != 1 or t.shape[2] < 1:
        raise FormatError(f"the upstream program's output has shape {list(t.shape)}, not logits [1, T, V]")
    vocab = t.shape[2]
    flat, picked = builder.temp("logits_2d"), builder.temp("logits_rows")
    builder.emit("view", (builder.slot_of(ids[0]),), (flat,), shape=(-1, vocab))
    builder.emit("index_select", (flat, rows), (picked,), dim=0)
    (row_count,) = graph.slots[rows].type.shape
    out = graph.add_slot("logits", SlotKind.TEMP, TensorType("float32", (row_count, vocab)))
    builder.emit("cast", (picked,), (out,), dtype="float32")
    graph.outputs.append(out)
    return vocab, t.dtype


def _drop_dead_code(graph: Graph) -> None:
    """Remove instructions whose results nothing reads (e.g. a weight transpose folded into
    ``linear``); ``update_and_attend`` always stays (it writes the cache)."""
    live = set(graph.outputs)
    kept = []
    for instr in reversed(graph.instructions):
        if instr.op != "update_and_attend" and not live.intersection(instr.outputs):
            continue
        kept.append(instr)
        live.update(s for s in instr.inputs if s is not None)
        for _, value in instr.attrs:
            items = value if isinstance(value, tuple) else (value,)
            live.update(v.slot for v in items if hasattr(v, "slot"))
    graph.instructions[:] = reversed(kept)
