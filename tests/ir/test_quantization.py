"""Quantized weight types: the supported set and its part types against MLX's own
``mx.quantize``, one clear error for an unsupported type, and the load-time checks that a
payload's packed parts fit the type its instructions give them."""
from __future__ import annotations

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Graph, Instruction, SlotKind, SymDim, TensorType
from mlx_pte.ir.manifest import Manifest
from mlx_pte.ir.payload import decode_payload, encode_payload
from mlx_pte.ir.quantization import FORMATS, QuantizationError, QuantSpec, quantized_constants

from .sample import sample

N, T = 8, SymDim("T", 1, 16)
MX_NAMES = {mx.uint32: "uint32", mx.uint8: "uint8", mx.float32: "float32"}


@pytest.mark.parametrize("mode", FORMATS)
def test_every_supported_type_has_the_parts_mx_quantize_returns(mode):
    fmt = FORMATS[mode]
    for bits in fmt.bits:
        for group in fmt.group_sizes:
            spec = QuantSpec(mode, bits, group)
            k = 2 * group
            parts = mx.quantize(mx.ones((N, k)), group_size=group, bits=bits, mode=mode)
            expected = [(MX_NAMES[p.dtype], tuple(p.shape)) for p in parts]
            assert [(t.dtype, t.shape) for t in spec.parts((N, k), "float32") if t is not None] == expected


@pytest.mark.parametrize(
    "mode, bits, group, message",
    [
        ("affine", 4, 48, "affine quantization takes group sizes 32, 64, 128, got 48"),
        ("affine", 7, 64, "affine quantization takes bits 1, 2, 3, 4, 5, 6, 8, got 7"),
        ("mxfp4", 4, 64, "mxfp4 quantization takes group sizes 32, got 64"),
        ("nvfp4", 4, 32, "nvfp4 quantization takes group sizes 16, got 32"),
        ("nvfp4", 8, 16, "nvfp4 quantization takes bits 4, got 8"),
        ("int4", 4, 64, "unknown quantization mode 'int4'"),
    ],
)
def test_an_unsupported_type_is_one_clear_error(mode, bits, group, message):
    with pytest.raises(QuantizationError, match=message):
        QuantSpec(mode, bits, group)


def test_presets_and_their_default_groups():
    assert QuantSpec.from_preset("q4") == QuantSpec("affine", 4, 64)
    assert QuantSpec.from_preset("q8", 128) == QuantSpec("affine", 8, 128)
    assert QuantSpec.from_preset("nvfp4") == QuantSpec("nvfp4", 4, 16)
    with pytest.raises(QuantizationError, match="unknown quantization 'q3'; choose one of q4, q8, mxfp4, nvfp4"):
        QuantSpec.from_preset("q3")


def _linear_graph(spec: QuantSpec, k: int = 64, scales_cols: int | None = None, biases: bool | None = None,
                  reread: QuantSpec | None = None):
    """x[T, k] -> quantized_linear with N outputs, parts shaped as MLX packs them unless told."""
    g = Graph()
    x = g.add_slot("x", SlotKind.INPUT, TensorType("float32", (T, k)))
    parts = mx.quantize(mx.array(np.random.default_rng(0).standard_normal((N, k)).astype(np.float32)),
                        group_size=spec.group_size, bits=spec.bits, mode=spec.mode)  # fmt: skip
    arrays = [np.array(p) for p in parts]
    if scales_cols is not None:
        arrays[1] = np.zeros((N, scales_cols), arrays[1].dtype)
        if len(arrays) == 3:
            arrays[2] = arrays[1]
    with_biases = spec.affine if biases is None else biases
    if with_biases and len(arrays) == 2:
        arrays.append(arrays[1])
    if not with_biases:
        arrays = arrays[:2]
    names = ["w", "w.scales", "w.biases"]
    slots = [g.add_slot(names[i], SlotKind.CONSTANT, TensorType(str(a.dtype), a.shape)) for i, a in enumerate(arrays)]
    operands = (slots + [None])[:3]
    out = g.add_slot("out", SlotKind.TEMP, TensorType("float32", (T, N)))
    g.instructions = [Instruction("quantized_linear", (x, *operands, None), (out,), tuple(spec.to_dict().items()))]
    g.inputs, g.outputs = [x], [out]
    if reread is not None:  # a second reader, with as many features as ``reread`` unpacks
        x2 = g.add_slot("x2", SlotKind.INPUT, TensorType("float32", (T, arrays[0].shape[1] * 32 // reread.bits)))
        again = g.add_slot("again", SlotKind.TEMP, TensorType("float32", (T, N)))
        attrs = tuple(reread.to_dict().items())
        g.instructions.append(Instruction("quantized_linear", (x2, *operands, None), (again,), attrs))
        g.inputs.append(x2)
    return g, dict(zip(slots, arrays))


@pytest.mark.parametrize("spec", [QuantSpec("affine", 4, 32), QuantSpec("affine", 8, 64), QuantSpec("mxfp4", 4, 32),
                                  QuantSpec("nvfp4", 4, 16)], ids=str)  # fmt: skip
def test_a_quantized_graph_round_trips_with_its_type(spec):
    graph, constants = _linear_graph(spec)
    decoded = decode_payload(encode_payload(graph, constants, {}))
    (qc,) = quantized_constants(decoded.graph).values()
    assert (qc.spec, qc.shape, qc.dtype) == (spec, (N, 64), "float32")
    assert (qc.biases is not None) == spec.affine


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: _linear_graph(QuantSpec("affine", 4, 32), scales_cols=3), r"needs scales float32\[8, 2\]"),
        (lambda: _linear_graph(QuantSpec("affine", 4, 32), biases=False), "affine quantization needs biases"),
        (lambda: _linear_graph(QuantSpec("mxfp4", 4, 32), biases=True), "mxfp4 quantization has no biases"),
        # affine 4-bit groups of 64 and 8-bit groups of 32 give parts of the same shapes
        (lambda: _linear_graph(QuantSpec("affine", 4, 64), k=128, reread=QuantSpec("affine", 8, 32)),
         "is read as two different quantized weights"),
    ],
    ids=["scales shape", "affine without biases", "mxfp4 with biases", "two types for one weight"],
)
def test_parts_that_do_not_fit_their_type_are_refused(build, message):
    graph, constants = build()
    with pytest.raises(FormatError, match=message):
        encode_payload(graph, constants, {})


def test_an_unsupported_type_in_a_payload_is_refused():
    graph, constants = _linear_graph(QuantSpec("affine", 4, 32))
    instr = graph.instructions[0]
    graph.instructions[0] = Instruction(instr.op, instr.inputs, instr.outputs,
                                        (("group_size", 32), ("bits", 4), ("mode", "int4")))  # fmt: skip
    with pytest.raises(FormatError, match="unknown quantization mode 'int4'"):
        encode_payload(graph, constants, {})


def test_the_manifest_quantization_record_is_validated():
    manifest = dict(sample().manifest)
    assert Manifest.from_dict({**manifest, "quantization": QuantSpec("affine", 4, 64).to_dict()}).quantization == (
        QuantSpec("affine", 4, 64)
    )
    with pytest.raises(FormatError, match="takes group sizes 32, 64, 128, got 50"):
        Manifest.from_dict({**manifest, "quantization": {"mode": "affine", "bits": 4, "group_size": 50}})
