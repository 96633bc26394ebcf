"""Quantized weights: the formats MLX packs, and the typed view of one quantized constant.

A quantized weight of logical shape ``[N, K]`` (``K`` is the axis grouped: a linear's
input features, an embedding's width) is stored as its **packed parts**, each an
ordinary constant slot, exactly as ``mlx.core.quantize`` returns them:

    weight  uint32 [N, K * bits / 32]  the values, packed from the low bits up
    scales  [N, K / group_size]         the logical dtype (affine) or uint8 (an e8m0 or
                                        e4m3 scale: mxfp4, mxfp8, nvfp4)
    biases  like scales                 affine only

The instructions that read the parts (``quantized_linear``, ``quantized_embedding``,
``quantized_experts``: each weight operand of ``linear`` / ``embedding`` / ``experts``
replaced in place by ``weight, scales, biases?``; experts' ``[E, N, K]`` weights pack each
expert as its own ``[N, K]``, with a leading ``E`` on every part) carry the type as attributes ``(group_size, bits, mode)``. Loading checks that
the parts are exactly what MLX's packing of that type gives (``check_operands``) and that
every instruction reading one packed weight agrees on its parts and type
(``quantized_constants``), so parts and type form one logical constant.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .errors import FormatError
from .graph import UNTYPED_TENSOR, Graph, Instruction, TensorType

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
PACKED_DTYPE = "uint32"
FP_SCALE_DTYPE = "uint8"


class QuantizationError(ValueError):
    """A quantization type MLX does not support; the message lists what it supports."""


@dataclass(frozen=True)
class QuantFormat:
    """What MLX 0.32's ``quantize`` accepts for one mode."""

    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]
    default_group_size: int
    affine: bool  # scales and biases in the weight's dtype; else uint8 scales, no biases


FORMATS: dict[str, QuantFormat] = {
    "affine": QuantFormat(bits=(1, 2, 3, 4, 5, 6, 8), group_sizes=(32, 64, 128), default_group_size=64, affine=True),
    "mxfp4": QuantFormat(bits=(4,), group_sizes=(32,), default_group_size=32, affine=False),
    "mxfp8": QuantFormat(bits=(8,), group_sizes=(32,), default_group_size=32, affine=False),
    "nvfp4": QuantFormat(bits=(4,), group_sizes=(16,), default_group_size=16, affine=False),
}

# The names ``mlx-pte export --quantize`` takes: (mode, bits).
PRESETS: dict[str, tuple[str, int]] = {
    "q4": ("affine", 4), "q8": ("affine", 8), "mxfp4": ("mxfp4", 4), "nvfp4": ("nvfp4", 4),
}  # fmt: skip


@dataclass(frozen=True)
class PartType:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class QuantSpec:
    """One quantization type; constructing it checks MLX supports it.

    Raises:
        QuantizationError: an unknown mode, or bits / group size the mode does not take.
    """

    mode: str
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        fmt = FORMATS.get(self.mode)
        if fmt is None:
            raise QuantizationError(f"unknown quantization mode {self.mode!r}; MLX supports {', '.join(FORMATS)}")
        if self.bits not in fmt.bits:
            raise QuantizationError(f"{self.mode} quantization takes bits {_listed(fmt.bits)}, got {self.bits!r}")
        if self.group_size not in fmt.group_sizes:
            raise QuantizationError(
                f"{self.mode} quantization takes group sizes {_listed(fmt.group_sizes)}, got {self.group_size!r}"
            )

    @classmethod
    def from_preset(cls, name: str, group_size: Optional[int] = None) -> "QuantSpec":
        """``q4``/``q8`` (affine) or ``mxfp4``/``nvfp4``; the mode's default group size if None."""
        if name not in PRESETS:
            raise QuantizationError(f"unknown quantization {name!r}; choose one of {', '.join(PRESETS)}")
        mode, bits = PRESETS[name]
        return cls(mode, bits, FORMATS[mode].default_group_size if group_size is None else group_size)

    @property
    def affine(self) -> bool:
        return FORMATS[self.mode].affine

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "bits": self.bits, "group_size": self.group_size}

    @classmethod
    def from_dict(cls, d: Any) -> "QuantSpec":
        """The inverse of ``to_dict``; FormatError for anything else."""
        if not isinstance(d, Mapping) or set(d) != {"mode", "bits", "group_size"}:
            raise FormatError(f"a quantization record must hold mode, bits and group_size, got {d!r}")
        try:
            return cls(d["mode"], d["bits"], d["group_size"])
        except QuantizationError as exc:
            raise FormatError(f"the file's quantization record is not supported: {exc}") from None

    def describe(self) -> str:
        return f"{self.mode} {self.bits}-bit, groups of {self.group_size}"

    def unfit_reason(self, shape: tuple[int, ...]) -> Optional[str]:
        """Why a weight of ``shape`` cannot be quantized with this type (None if it can):
        ``[N, K]``, or ``[E, N, K]`` (experts, each packed as its own ``[N, K]``)."""
        if len(shape) not in (2, 3):
            return f"it has {len(shape)} dims, not 2 (3 for experts)"
        if shape[-1] % self.group_size:
            return f"its {shape[-1]} columns do not divide into groups of {self.group_size}"
        return None

    def parts(self, shape: tuple[int, ...], dtype: str) -> tuple[PartType, PartType, Optional[PartType]]:
        """The (weight, scales, biases) types of a ``dtype[..., N, K]`` weight (biases None unless affine)."""
        *lead, k = shape
        scales = PartType(dtype if self.affine else FP_SCALE_DTYPE, (*lead, k // self.group_size))
        return PartType(PACKED_DTYPE, (*lead, k * self.bits // 32)), scales, scales if self.affine else None


def _listed(values: tuple[int, ...]) -> str:
    return ", ".join(map(str, values))


# -- the typed view, and its checks on load ----------------------------------------------

# op -> index of its (first) packed weight operand (scales and biases follow it).
QUANTIZED_OPS = {"quantized_linear": 1, "quantized_embedding": 0, "quantized_experts": 3,
                 # a norm or a glu joined to the quantized linear reading it, at load (ir.norm_linears,
                 # ir.glu_linears)
                 "rms_norm_quantized_linear": 2, "add_rms_norm_quantized_linear": 3, "glu_quantized_linear": 2}
# The ops whose first operand is the row a quantized linear multiplies, or the row's source.
_LINEAR_OPS = frozenset({"quantized_linear", "rms_norm_quantized_linear", "add_rms_norm_quantized_linear",
                         "glu_quantized_linear"})
# op -> index of every packed weight it reads, where there are several.
_PACKED_AT = {"quantized_experts": (3, 6)}


def packed_positions(op: str) -> tuple[int, ...]:
    """Where a quantized op's packed weights start among its operands."""
    return _PACKED_AT.get(op, (QUANTIZED_OPS[op],))


@dataclass(frozen=True)
class QuantizedConstant:
    """One logical quantized weight: its part slots, type, logical shape and dtype."""

    weight: int
    scales: int
    biases: Optional[int]
    spec: QuantSpec
    shape: tuple[int, ...]  # [N, K], or [E, N, K] for experts
    # Of the dequantized values (what full precision would store); None: a linear of an fp
    # mode whose input's dtype is not recorded (an imported upstream program's temps).
    dtype: Optional[str]

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(s for s in (self.weight, self.scales, self.biases) if s is not None)


def _static(graph: Graph, slot: int, what: str, where: str) -> TensorType:
    t = graph.slots[slot].type
    if not isinstance(t, TensorType) or not all(isinstance(d, int) for d in t.shape):
        raise FormatError(f"{where}: {what} (slot {slot}) must be a tensor of static shape")
    return t


def read_constant(instr: Instruction, graph: Graph, at: Optional[int] = None) -> QuantizedConstant:
    """The quantized weight ``instr`` reads (its packed parts from operand ``at``; default
    its first), checked against its type.

    Raises:
        FormatError: unsupported attributes, or parts whose dtypes and shapes are not what
            MLX's packing of that type gives.
    """
    where = f"instruction {instr.op!r}"
    try:
        spec = QuantSpec(instr.attr("mode"), instr.attr("bits"), instr.attr("group_size"))
    except QuantizationError as exc:
        raise FormatError(f"{where}: {exc}") from None
    at = QUANTIZED_OPS[instr.op] if at is None else at
    rank = 3 if instr.op == "quantized_experts" else 2
    w_slot, s_slot, b_slot = instr.inputs[at : at + 3]
    w = _static(graph, w_slot, "the packed weight", where)
    s = _static(graph, s_slot, "the scales", where)
    if w.dtype != PACKED_DTYPE or len(w.shape) != rank or (w.shape[-1] * 32) % spec.bits:
        lead = "E, N" if rank == 3 else "N"
        raise FormatError(
            f"{where}: the packed weight must be {PACKED_DTYPE}[{lead}, K * bits / 32], got {w.dtype}{list(w.shape)}"
        )
    shape = (*w.shape[:-1], w.shape[-1] * 32 // spec.bits)
    if spec.affine:
        dtype = s.dtype
    else:
        dtype = instr.attr("dtype") if instr.op == "quantized_embedding" else graph.slots[instr.inputs[0]].type.dtype
    if (dtype is not None and dtype not in FLOAT_DTYPES) or spec.unfit_reason(shape):
        raise FormatError(f"{where}: {spec.describe()} cannot pack a {dtype}{list(shape)} weight")
    _, want_scales, want_biases = spec.parts(shape, dtype)
    for name, slot, want in (("scales", s_slot, want_scales), ("biases", b_slot, want_biases)):
        if want is None:
            if slot is not None:
                raise FormatError(f"{where}: {spec.mode} quantization has no biases, the payload gives some")
            continue
        if slot is None:
            raise FormatError(f"{where}: {spec.mode} quantization needs biases, the payload gives none")
        got = _static(graph, slot, f"the {name}", where)
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            raise FormatError(
                f"{where}: {spec.describe()} of a {dtype}{list(shape)} weight needs {name} "
                f"{want.dtype}{list(want.shape)}, the payload gives {got.dtype}{list(got.shape)}"
            )
    return QuantizedConstant(w_slot, s_slot, b_slot, spec, shape, dtype)


def check_operands(instr: Instruction, graph: Graph) -> None:
    """The catalog check of a quantized op: its parts fit its type, its other operands fit
    the logical weight."""
    qc = read_constant(instr, graph)
    where = f"instruction {instr.op!r}"
    n, k = qc.shape
    if instr.op in _LINEAR_OPS:
        x, out = graph.slots[instr.inputs[0]].type, graph.slots[instr.outputs[0]].type
        # A glu's gate may be a fused gate/up operand, its row the `width` features of each half.
        features = instr.attr("width") or (x.shape[-1] if x != UNTYPED_TENSOR and x.shape else None)
        if x != UNTYPED_TENSOR and (x.dtype not in FLOAT_DTYPES or (isinstance(features, int) and features != k)):
            raise FormatError(f"{where}: x must be a float tensor with {k} features, got {x.dtype}{list(x.shape)}")
        if out != UNTYPED_TENSOR and out.shape and out.shape[-1] != n:
            raise FormatError(f"{where}: the result must have {n} features, the payload gives {list(out.shape)}")
    else:
        indices, out = graph.slots[instr.inputs[3]].type, graph.slots[instr.outputs[0]].type
        if UNTYPED_TENSOR in (indices, out):  # an imported upstream program: the handler meets the shapes
            return
        if instr.attr("dtype") != out.dtype:
            raise FormatError(f"{where}: attribute 'dtype' is {instr.attr('dtype')!r}, the result is {out.dtype}")
        if indices.dtype not in ("int64", "int32"):
            raise FormatError(f"{where}: indices must be int64 or int32, got {indices.dtype}")
        if (out.dtype, out.shape) != (qc.dtype, tuple(indices.shape) + (k,)):
            raise FormatError(
                f"{where}: the result must be {qc.dtype}{list(indices.shape) + [k]}, "
                f"the payload gives {out.dtype}{list(out.shape)}"
            )


def quantized_constants(graph: Graph) -> dict[int, QuantizedConstant]:
    """Every quantized weight of ``graph``, by its packed weight slot.

    Raises:
        FormatError: a quantized op does not fit its parts, or two instructions read one
            packed weight with different parts or types.
    """
    found: dict[int, QuantizedConstant] = {}
    for instr in graph.instructions:
        if instr.op not in QUANTIZED_OPS:
            continue
        for at in packed_positions(instr.op):
            qc = read_constant(instr, graph, at)
            seen = found.setdefault(qc.weight, qc)
            if (seen.scales, seen.biases, seen.spec, seen.shape) != (qc.scales, qc.biases, qc.spec, qc.shape):
                name = graph.slots[qc.weight].name
                raise FormatError(
                    f"the packed weight {name!r} is read as two different quantized weights "
                    f"({seen.spec.describe()} and {qc.spec.describe()}, or different scales/biases)"
                )
    return found



def keep_reason(spec: QuantSpec, shape: tuple[int, ...], dtype: str, other_reads: bool) -> Optional[str]:
    """Why export keeps a linear / embedding weight at full precision (None: it quantizes).

    The one rule, shared by the exporter and by the report of a written file.
    """
    if dtype not in FLOAT_DTYPES:
        return f"it is {dtype}, not floating point"
    if other_reads:
        return "other ops read it too"
    return spec.unfit_reason(shape)


def full_precision_weights(graph: Graph, spec: QuantSpec) -> dict[str, str]:
    """The constant weights of ``linear`` / ``embedding`` / ``experts`` instructions that a
    file quantized to ``spec`` kept at full precision, each with the reason."""
    readers = {"linear": (1,), "embedding": (0,), "experts": (3, 4)}
    constants = set(graph.constants())
    weights: set[int] = set()
    other: set[int] = set()
    for instr in graph.instructions:
        for i, slot in enumerate(instr.inputs):
            if slot in constants:
                (weights if i in readers.get(instr.op, ()) else other).add(slot)
    kept = {}
    for slot in sorted(weights):
        t = graph.slots[slot].type
        reason = keep_reason(spec, tuple(t.shape), t.dtype, slot in other)
        kept[graph.slots[slot].name] = reason or "the exporter did not quantize it"
    return kept
