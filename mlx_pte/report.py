"""What ``mlx-pte inspect`` prints about a .pte file (and ``export`` after quantizing): the
graph's sizes, inputs and outputs, dynamic dims, quantized weights, op counts, cache
geometry and manifest, as lines of text."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter

from mlx_pte.ir.graph import ScalarType, SymDim, TensorType
from mlx_pte.ir.layers import layer_counts
from mlx_pte.ir.manifest import CacheLayerSpec
from mlx_pte.ir.payload import ITEMSIZE, Payload
from mlx_pte.ir.quantization import QuantSpec, full_precision_weights, quantized_constants
from mlx_pte.ir.upstream.importer import ImportedPayload


def describe(payload: Payload | ImportedPayload) -> list[str]:
    """The inspect report of a decoded (or imported upstream) payload, as lines."""
    graph = payload.graph
    kinds = Counter(slot.kind.value for slot in graph.slots)
    constants = graph.constants()
    weight_bytes = sum(payload.constant_bytes(s).nbytes for s in constants)
    lines = [
        f"graph: {len(graph.slots)} slots ({kinds['input']} inputs, {kinds['constant']} constants, "
        f"{kinds['temp']} temps), {len(graph.instructions)} instructions",
        layer_counts(graph).summary(),
        f"weights: {len(constants)} constants, {weight_bytes:,} bytes",
    ]
    for title, slots in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        lines.append(f"{title}:")
        lines += _table([(graph.slots[s].name, _type_name(graph.slots[s].type)) for s in slots])
    shapes = [slot.type.shape for slot in graph.slots if isinstance(slot.type, TensorType) and slot.type.shape]
    dims = sorted({d for shape in shapes for d in shape if isinstance(d, SymDim)}, key=lambda d: d.name)
    if dims:
        lines.append("dynamic dims:")
        lines += _table([(d.name, f"[{d.min}, {'unbounded)' if d.max is None else f'{d.max}]'}") for d in dims])
    lines += quantization_report(payload, per_tensor=True)
    ops = Counter(instr.op for instr in graph.instructions)
    lines.append("ops:")
    lines += _table([(op, str(n)) for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))])
    cache = payload.manifest.get("cache")
    if isinstance(cache, list) and all(isinstance(layer, dict) for layer in cache):
        names = [f.name for f in dataclasses.fields(CacheLayerSpec)]
        lines.append("cache geometry:")
        rows = [(str(i), *(str(layer.get(n)) for n in names)) for i, layer in enumerate(cache)]
        lines += _table([("cache_id", *names), *rows])
    shown = dict(payload.manifest)
    if isinstance(shown.get("tokenizer"), str):
        shown["tokenizer"] = f"<tokenizer.json: {len(shown['tokenizer']):,} characters>"
    lines.append("manifest:")
    lines += ["  " + line for line in json.dumps(shown, indent=2, ensure_ascii=False).splitlines()]
    return lines


def quantization_report(payload: Payload | ImportedPayload, per_tensor: bool) -> list[str]:
    """The quantized weights (bits, group size, mode, bytes; per tensor if asked), the
    weights kept at full precision with the reason, and the weight total against full
    precision. Empty for a file without quantized weights."""
    graph = payload.graph
    quantized = quantized_constants(graph)
    if not quantized:
        return []
    recorded = payload.manifest.get("quantization")
    spec = None if recorded is None else QuantSpec.from_dict(recorded)
    part_bytes = {slot: payload.constant_bytes(slot).nbytes for slot in graph.constants()}
    stored = sum(part_bytes.values())
    rows, saved = [], 0
    for qc in quantized.values():
        nbytes = sum(part_bytes.get(s, 0) for s in qc.slots)
        dtype = qc.dtype or payload.manifest["dtype"]  # unrecorded in an imported program: its model dtype
        full = qc.shape[0] * qc.shape[1] * ITEMSIZE[dtype]
        saved += full - nbytes
        rows.append((graph.slots[qc.weight].name, f"{dtype}[{qc.shape[0]}, {qc.shape[1]}]", qc.spec.mode,
                     f"{qc.spec.bits}", f"{qc.spec.group_size}", f"{nbytes:,}", f"{full:,}"))  # fmt: skip
    modes = sorted({qc.spec.describe() for qc in quantized.values()})
    lines = [
        f"quantized: {len(quantized)} weights ({'; '.join(modes)}); all weights {stored:,} bytes, "
        f"{stored + saved:,} at full precision ({stored / (stored + saved):.1%})"
    ]
    if per_tensor:
        lines.append("quantized weights:")
        lines += _table([("name", "logical", "mode", "bits", "group", "bytes", "full precision"), *rows])
    kept = full_precision_weights(graph, spec) if spec is not None else {}
    if kept:
        lines.append(f"kept at full precision ({len(kept)}):")
        lines += _table([(name, reason) for name, reason in kept.items()])
    return lines


def _type_name(t: TensorType | ScalarType) -> str:
    if not isinstance(t, TensorType):
        return t.kind
    return f"{t.dtype}[{', '.join(d.name if isinstance(d, SymDim) else str(d) for d in t.shape)}]"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as left-aligned columns, indented two spaces."""
    if not rows:
        return ["  (none)"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
