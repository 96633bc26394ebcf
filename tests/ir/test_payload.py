"""encode_payload / decode_payload: round trips, layout, and every refusal."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_pte.ir.catalog import CATALOG, AttrSpec, OpSpec
from mlx_pte.ir.errors import FormatError, UnknownOpError
from mlx_pte.ir.graph import (
    DTYPES,
    Constant,
    Graph,
    Instruction,
    ScalarType,
    SlotKind,
    SlotRef,
    SymDim,
    TensorType,
)
from mlx_pte.ir.payload import FORMAT_VERSION, INLINE_VERSION, decode_payload, encode_payload
from mlx_pte.schemas import mlx_graph_generated as fb

from . import layout
from .sample import sample

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "uint32": 4}  # fmt: skip

# An op with every attribute kind, two results and an optional operand, registered only
# while this module's tests run.
ALL_ATTRS = OpSpec(
    "test_all_attrs",
    ("x", "y?"),
    (
        AttrSpec("flag", "bool"),
        AttrSpec("count", "int"),
        AttrSpec("alpha", "float"),
        AttrSpec("mode", "str"),
        AttrSpec("dtype", "dtype"),
        AttrSpec("sizes", "ints"),
        AttrSpec("weights", "floats"),
        AttrSpec("n", "int_or_ref"),
        AttrSpec("shape", "ints_or_refs"),
        AttrSpec("extra", "int", required=False),
    ),
    n_outputs=2,
)


@pytest.fixture(scope="module", autouse=True)
def all_attrs_op():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CATALOG, ALL_ATTRS.name, ALL_ATTRS)
        yield


# -- strategies -----------------------------------------------------------------------

names = st.text(max_size=8)
int64s = st.integers(-(2**63), 2**63 - 1)
finite = st.floats(allow_nan=False)


@st.composite
def sym_dims(draw) -> SymDim:
    low = draw(st.integers(0, 2**40))
    return SymDim(draw(st.sampled_from("TRS")), low, draw(st.none() | st.integers(low, 2**62)))


tensor_types = st.builds(
    TensorType, st.sampled_from(DTYPES), st.lists(st.integers(0, 2**40) | sym_dims(), max_size=4).map(tuple)
)
scalar_types = st.builds(ScalarType, st.sampled_from(["int", "float", "bool"]))
static_types = st.builds(TensorType, st.sampled_from(DTYPES), st.lists(st.integers(0, 3), max_size=3).map(tuple))
json_values = st.recursive(
    st.none() | st.booleans() | int64s | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10,
)


def attr_value(draw, kind: str, int_scalars: list[int]):
    refs = st.sampled_from(int_scalars).map(SlotRef) if int_scalars else st.nothing()
    return draw(
        {
            "bool": st.booleans(),
            "int": int64s,
            "float": finite | int64s,
            "str": st.text(max_size=10),
            "dtype": st.sampled_from(DTYPES),
            "ints": st.lists(int64s, max_size=4).map(tuple),
            "floats": st.lists(finite | int64s, max_size=4).map(tuple),
            "int_or_ref": int64s | refs,
            "ints_or_refs": st.lists(int64s | refs, max_size=4).map(tuple),
        }[kind]
    )


@st.composite
def graphs(draw) -> tuple[Graph, dict[int, bytes]]:
    """Valid graphs: operands are tensors already written, SlotRefs name int scalars."""
    g = Graph()
    inputs = [
        g.add_slot(draw(names), SlotKind.INPUT, draw(tensor_types | scalar_types))
        for _ in range(draw(st.integers(0, 3)))
    ]
    constants = {}
    for _ in range(draw(st.integers(0, 3))):
        t = draw(static_types)
        slot = g.add_slot(draw(names), SlotKind.CONSTANT, t)
        size = ITEMSIZE[t.dtype] * math.prod(t.shape)
        constants[slot] = draw(st.binary(min_size=size, max_size=size))
    g.inputs = draw(st.permutations(inputs))
    tensors = [s for s in inputs + list(constants) if isinstance(g.slots[s].type, TensorType)]
    int_scalars = [s for s in inputs if g.slots[s].type == ScalarType("int")]
    for _ in range(draw(st.integers(0, 5)) if tensors else 0):
        spec = CATALOG[draw(st.sampled_from(["add", "mul", "linear", "update_and_attend", ALL_ATTRS.name]))]
        # An attention sink's shape follows q's (the catalog checks it), so random ones stay out.
        operands = tuple(
            None if name.endswith("?") and (name == "sinks?" or draw(st.booleans())) else draw(st.sampled_from(tensors))
            for name in spec.operands
        )
        attrs = []
        for a in spec.attrs:
            presence = draw(st.sampled_from(["value", "none", "omitted"])) if not a.required else "value"
            if presence != "omitted":
                attrs.append((a.name, attr_value(draw, a.kind, int_scalars) if presence == "value" else None))
        results = tuple(g.add_slot(draw(names), SlotKind.TEMP, draw(tensor_types)) for _ in range(spec.n_outputs))
        g.instructions.append(Instruction(spec.name, operands, results, tuple(draw(st.permutations(attrs)))))
        tensors += results
    for _ in range(draw(st.integers(0, 2))):  # temps nothing writes are allowed
        g.add_slot(draw(names), SlotKind.TEMP, draw(tensor_types | scalar_types))
    written = g.inputs + list(constants) + [s for instr in g.instructions for s in instr.outputs]
    g.outputs = draw(st.lists(st.sampled_from(written), max_size=3)) if written else []
    return g, constants


# -- oracles --------------------------------------------------------------------------


def typed(value):
    """A value with its type made visible to ==, so 1, 1.0 and True differ."""
    if isinstance(value, tuple):
        return tuple(typed(v) for v in value)
    return (type(value).__name__, value)


def typed_attrs(graph: Graph) -> list:
    return [[(k, typed(v)) for k, v in instr.attrs] for instr in graph.instructions]


def flatc_decode(buf: bytes) -> tuple[Graph, list[Constant]]:
    """The graph section read with flatc's generated (unchecked) reader."""
    r = fb.Graph.GetRootAs(buf, 0)
    dtypes = {getattr(fb.DType, n): n for n in DTYPES}
    scalar = {fb.ValueType.int: "int", fb.ValueType.float: "float", fb.ValueType.bool: "bool"}
    kinds = {fb.SlotKind.input: SlotKind.INPUT, fb.SlotKind.constant: SlotKind.CONSTANT,
             fb.SlotKind.temp: SlotKind.TEMP}  # fmt: skip
    g = Graph()
    for i in range(r.SlotsLength()):
        s = r.Slots(i)
        if s.Type() == fb.ValueType.tensor:
            dims = []
            for j in range(s.ShapeLength()):
                d = s.Shape(j)
                if d.Symbol() is None:
                    dims.append(d.Size())
                else:
                    dims.append(SymDim(d.Symbol().decode(), d.Min(), None if d.Max() == -1 else d.Max()))
            t = TensorType(dtypes[s.Dtype()], tuple(dims))
        else:
            t = ScalarType(scalar[s.Type()])
        g.add_slot(s.Name().decode(), kinds[s.Kind()], t)
    for i in range(r.InstructionsLength()):
        ins = r.Instructions(i)
        attrs = []
        for j in range(ins.AttrsLength()):
            a = ins.Attrs(j)
            k = a.Kind()
            if k == fb.AttrKind.list:
                ints = iter(a.Ints(n) for n in range(a.IntsLength()))
                floats = iter(a.Floats(n) for n in range(a.FloatsLength()))
                item_kinds = [a.ItemKinds(n) for n in range(a.ItemKindsLength())]
                read_item = {
                    fb.AttrKind.int: lambda: next(ints),
                    fb.AttrKind.ref: lambda: SlotRef(next(ints)),
                    fb.AttrKind.float: lambda: next(floats),
                }
                value = tuple(read_item[ik]() for ik in item_kinds)
            else:
                value = {
                    fb.AttrKind.none: lambda: None,
                    fb.AttrKind.bool: lambda: bool(a.IntValue()),
                    fb.AttrKind.int: a.IntValue,
                    fb.AttrKind.float: a.FloatValue,
                    fb.AttrKind.str: lambda: a.StrValue().decode(),
                    fb.AttrKind.ref: lambda: SlotRef(a.IntValue()),
                }[k]()
            attrs.append((a.Name().decode(), value))
        g.instructions.append(
            Instruction(
                ins.Op().decode(),
                tuple(None if ins.Inputs(j) == -1 else ins.Inputs(j) for j in range(ins.InputsLength())),
                tuple(ins.Outputs(j) for j in range(ins.OutputsLength())),
                tuple(attrs),
            )
        )
    g.inputs = [r.Inputs(i) for i in range(r.InputsLength())]
    g.outputs = [r.Outputs(i) for i in range(r.OutputsLength())]
    constants = [
        Constant(r.Constants(i).Slot(), r.Constants(i).Offset(), r.Constants(i).Nbytes())
        for i in range(r.ConstantsLength())
    ]
    return g, constants


def check_round_trip(graph: Graph, constants: dict, manifest: dict) -> None:
    blob = encode_payload(graph, constants, manifest)
    p = decode_payload(blob)
    assert p.graph == graph
    assert typed_attrs(p.graph) == typed_attrs(graph)
    assert p.manifest == manifest
    assert set(p.constants) == set(constants)
    for slot, raw in constants.items():
        assert bytes(p.constant_bytes(slot)) == bytes(raw)
        assert p.constants[slot].offset % 64 == 0
    # The weight segment is 64-aligned within the blob, and a view into it, not a copy.
    parts = layout.split(blob)
    assert parts.magic == b"MLXP" and parts.version == INLINE_VERSION
    if p.data.nbytes:
        data_at = np.frombuffer(p.data, np.uint8).ctypes.data - np.frombuffer(blob, np.uint8).ctypes.data
        assert data_at % 64 == 0 and blob[data_at : data_at + p.data.nbytes] == parts.data
    # flatc's own reader sees the same graph in the graph section.
    flatc_graph, flatc_constants = flatc_decode(parts.graph)
    assert flatc_graph == graph and typed_attrs(flatc_graph) == typed_attrs(graph)
    assert {c.slot: c for c in flatc_constants} == dict(p.constants)
    assert json.loads(parts.manifest) == manifest


# -- round trips ----------------------------------------------------------------------


def test_sample_round_trip():
    s = sample()
    check_round_trip(s.graph, s.constants, s.manifest)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(), st.dictionaries(st.text(max_size=6), json_values, max_size=4))
def test_random_graph_round_trip(graph_and_constants, manifest):
    graph, constants = graph_and_constants
    check_round_trip(graph, constants, manifest)


def test_constants_from_any_buffer():
    s = sample()
    w, b, scale = sorted(s.constants)
    constants = {w: memoryview(s.constants[w].T.copy().T.tobytes()), b: bytearray(s.constants[b].tobytes()),
                 scale: s.constants[scale]}  # fmt: skip
    p = decode_payload(encode_payload(s.graph, constants, s.manifest))
    for slot, expected in s.constants.items():
        assert np.array_equal(np.frombuffer(p.constant_bytes(slot), expected.dtype).reshape(expected.shape), expected)


# -- refusals on decode ---------------------------------------------------------------


def sample_blob() -> bytes:
    s = sample()
    return encode_payload(s.graph, s.constants, s.manifest)


def test_bad_magic():
    blob = bytearray(sample_blob())
    blob[:4] = b"ABCD"
    with pytest.raises(FormatError, match="not an mlx-pte payload"):
        decode_payload(bytes(blob))


@pytest.mark.parametrize(
    "version, message", [(FORMAT_VERSION + 1, "newer than this mlx-pte reads.*upgrade mlx-pte"), (0, "invalid")]
)
def test_wrong_version(version, message):
    parts = layout.split(sample_blob())
    parts.version = version
    with pytest.raises(FormatError, match=message):
        decode_payload(layout.join(parts))


def test_unknown_op():
    s = sample()
    x = s.graph.inputs[0]
    out = s.graph.add_slot("extra", SlotKind.TEMP, s.graph.slots[x].type)
    s.graph.instructions.append(Instruction("frobnicate", (x,), (out,)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CATALOG, "frobnicate", OpSpec("frobnicate", ("x",)))
        blob = encode_payload(s.graph, s.constants, s.manifest)
    with pytest.raises(UnknownOpError, match="unknown op 'frobnicate'.*newer mlx-pte"):
        decode_payload(blob)


def test_truncated():
    blob = sample_blob()
    for n in (0, 7, 63, len(blob) - 1):
        with pytest.raises(FormatError, match="too short|truncated"):
            decode_payload(blob[:n])


def test_damaged_graph_or_manifest_fails_the_checksum():
    blob = sample_blob()
    parts = layout.split(blob)
    for at in (70, 64 + len(parts.graph) + 3):  # one byte in the graph, one in the manifest
        damaged = bytearray(blob)
        damaged[at] ^= 0x20
        with pytest.raises(FormatError, match="checksum"):
            decode_payload(bytes(damaged))


@pytest.mark.parametrize(
    "manifest, message",
    [(b"[1, 2]", "not a JSON object"), (b"{\"a\": ", "not valid JSON"), (b"\xff{}", "not valid JSON"),
     (b"[" * 100_000, "not valid JSON")],  # fmt: skip
)
def test_bad_manifest(manifest, message):
    parts = layout.split(sample_blob())
    parts.manifest = manifest
    with pytest.raises(FormatError, match=message):
        decode_payload(layout.join(parts))


def test_constant_size_mismatch():
    parts = layout.split(sample_blob())
    parts.data = parts.data[:-1]  # the last constant loses a byte
    with pytest.raises(FormatError, match="not an aligned range"):
        decode_payload(layout.join(parts))


def test_malformed_graph_section_never_escapes_as_another_error():
    """Random damage to the FlatBuffer behind a valid checksum: FormatError or a valid
    payload, never IndexError/struct.error/UnicodeDecodeError/RecursionError."""
    parts = layout.split(sample_blob())
    rng = random.Random(7)
    failures = 0
    for _ in range(300):
        graph = bytearray(parts.graph)
        for _ in range(rng.choice((1, 2, 8))):
            graph[rng.randrange(len(graph))] = rng.randrange(256)
        if rng.random() < 0.2:
            graph = graph[: rng.randrange(len(graph))]
        parts_copy = layout.Parts(parts.magic, parts.version, bytes(graph), parts.manifest, parts.data)
        try:
            decode_payload(layout.join(parts_copy))
        except FormatError:
            failures += 1
    assert failures > 100  # most damage is caught; the rest decoded to a graph that passed validation
    for seed in range(50):
        garbage = random.Random(seed).randbytes(seed * 7)
        parts_copy = layout.Parts(parts.magic, parts.version, garbage, parts.manifest, parts.data)
        with pytest.raises(FormatError):
            decode_payload(layout.join(parts_copy))


# -- refusals on encode ---------------------------------------------------------------


def test_encode_refuses_missing_or_wrong_size_constants():
    s = sample()
    w = min(s.constants)
    with pytest.raises(FormatError, match=f"constant slot {w} .* has no bytes"):
        encode_payload(s.graph, {k: v for k, v in s.constants.items() if k != w}, s.manifest)
    with pytest.raises(FormatError, match=f"constant slot {w} holds 3 bytes, float32\\[4, 4\\] needs 64"):
        encode_payload(s.graph, {**s.constants, w: b"abc"}, s.manifest)
    x = s.graph.inputs[0]
    with pytest.raises(FormatError, match=f"slot {x} has bytes but is not a constant slot"):
        encode_payload(s.graph, {**s.constants, x: b""}, s.manifest)


def test_encode_refuses_bad_dataflow():
    s = sample()
    first, second = s.graph.instructions[0], s.graph.instructions[1]
    s.graph.instructions[0], s.graph.instructions[1] = second, first
    with pytest.raises(FormatError, match=r"instruction 0 \('mul'\) reads slot .* before anything writes it"):
        encode_payload(s.graph, s.constants, s.manifest)

    s = sample()
    s.graph.instructions.append(s.graph.instructions[0])
    with pytest.raises(FormatError, match="already written"):
        encode_payload(s.graph, s.constants, s.manifest)

    s = sample()
    s.graph.inputs.pop()
    with pytest.raises(FormatError, match="missing from the graph's inputs"):
        encode_payload(s.graph, s.constants, s.manifest)

    s = sample()
    s.graph.outputs.append(s.graph.add_slot("never", SlotKind.TEMP, ScalarType("int")))
    with pytest.raises(FormatError, match="is never written"):
        encode_payload(s.graph, s.constants, s.manifest)


def test_encode_refuses_bad_types_and_values():
    s = sample()
    s.graph.add_slot("d", SlotKind.TEMP, TensorType("float32", (SymDim("T", 5, 2),)))
    with pytest.raises(FormatError, match="empty range"):
        encode_payload(s.graph, s.constants, s.manifest)

    s = sample()
    s.graph.add_slot("c", SlotKind.CONSTANT, TensorType("float32", (SymDim("T", 1, 2),)))
    with pytest.raises(FormatError, match="dynamic shape"):
        encode_payload(s.graph, {**s.constants, len(s.graph.slots) - 1: b""}, s.manifest)

    s = sample()
    x = s.graph.inputs[0]
    out = s.graph.add_slot("o", SlotKind.TEMP, s.graph.slots[x].type)
    s.graph.add_slot("o2", SlotKind.TEMP, s.graph.slots[x].type)
    attrs = dict(flag=True, count=1, alpha=1.0, mode="", dtype="float32", sizes=(), weights=(True,), n=1, shape=())
    s.graph.instructions.append(Instruction(ALL_ATTRS.name, (x, None), (out, out + 1), tuple(attrs.items())))
    with pytest.raises(FormatError, match="list item True is not an int, float or SlotRef"):
        encode_payload(s.graph, s.constants, s.manifest)

    s = sample()
    with pytest.raises(FormatError, match="cannot be written as JSON"):
        encode_payload(s.graph, s.constants, {"x": float("nan")})
    with pytest.raises(FormatError, match="cannot be written as JSON"):
        encode_payload(s.graph, s.constants, {"x": object()})


def test_shared_offsets_cannot_multiply_work():
    """2,000 slot entries pointing at one slot whose shape points 2,000 times at one dim:
    a ~24 KB graph that would read 4 million tables. Refused, quickly."""
    import flatbuffers

    b = flatbuffers.Builder(0)
    fb.DimStart(b)
    fb.DimAddSize(b, 1)
    dim = fb.DimEnd(b)
    fb.SlotStartShapeVector(b, 2000)
    for _ in range(2000):
        b.PrependUOffsetTRelative(dim)
    shape = b.EndVector()
    fb.SlotStart(b)
    fb.SlotAddShape(b, shape)
    slot = fb.SlotEnd(b)
    fb.GraphStartSlotsVector(b, 2000)
    for _ in range(2000):
        b.PrependUOffsetTRelative(slot)
    slots = b.EndVector()
    fb.GraphStart(b)
    fb.GraphAddSlots(b, slots)
    b.Finish(fb.GraphEnd(b))
    parts = layout.Parts(b"MLXP", INLINE_VERSION, bytes(b.Output()), b"{}", b"")
    with pytest.raises(FormatError, match="more objects than the buffer can hold"):
        decode_payload(layout.join(parts))
