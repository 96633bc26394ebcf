"""Catalog entries of mixture-of-experts models: the router's ``topk`` and the routed
``experts`` (plain and quantized). Imported by ``ir.catalog``, whose ``define`` they use."""
from __future__ import annotations

from typing import Optional

from . import quantization
from .catalog import AttrSpec, OpSpec, define
from .errors import FormatError
from .graph import Graph, Instruction, TensorType

# Gated activations ``act(gate) * up`` an expert may use; the names are HF's ``hidden_act``.
# ``clamped_swiglu`` is gpt-oss's ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
# with ``g = min(gate, limit)``, its alpha and limit given as attributes.
CLAMPED_SWIGLU = "clamped_swiglu"
EXPERT_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", CLAMPED_SWIGLU)


def _static_shape(graph: Graph, slot: Optional[int]) -> Optional[tuple]:
    t = graph.slots[slot].type if slot is not None else None
    return t.shape if isinstance(t, TensorType) and t.shape is not None else None


def _check_topk(instr: Instruction, graph: Graph) -> None:
    shape = _static_shape(graph, instr.inputs[0])
    attrs = dict(instr.attrs)
    if shape is None:
        return
    dim, k = attrs["dim"], attrs["k"]
    if not 0 <= dim < len(shape):
        raise FormatError(f"instruction 'topk': dim {dim} is not an axis of its rank-{len(shape)} operand")
    size = shape[dim]
    if k < 1 or (isinstance(size, int) and k > size):
        raise FormatError(f"instruction 'topk': k = {k} is outside [1, {size}] (the size of axis {dim})")


define(
    OpSpec(
        "topk",
        ("x",),
        (AttrSpec("k", "int"), AttrSpec("dim", "int"), AttrSpec("largest", "bool")),
        n_outputs=2,
        output_rule="(values, int64 indices): x's shape with axis dim of size k; the k largest (smallest "
        "when not largest) in order, equal values by lower index first (torch.topk's order)",
        check=_check_topk,
    )
)


def _check_experts(instr: Instruction, graph: Graph) -> None:
    where = f"instruction {instr.op!r}"
    x, indices, weights = (_static_shape(graph, s) for s in instr.inputs[:3])
    attrs = dict(instr.attrs)
    clamped = attrs["activation"] == CLAMPED_SWIGLU
    if clamped != ("alpha" in attrs and "limit" in attrs) or (not clamped and ("alpha" in attrs or "limit" in attrs)):
        raise FormatError(f"{where}: alpha and limit are given exactly when the activation is {CLAMPED_SWIGLU!r}")
    n_weights = 5 if instr.op == "experts" else 9
    biases = instr.inputs[n_weights:]
    if len(biases) == 1 or (len(biases) == 2 and None in biases):
        raise FormatError(f"{where}: give both expert biases (gate_up_bias, down_bias) or neither")
    if instr.op == "experts":
        gate_up, down = (_static_shape(graph, s) for s in instr.inputs[3:5])
    else:
        gate_up, down = (quantization.read_constant(instr, graph, at).shape
                         for at in quantization.packed_positions(instr.op))  # fmt: skip
    if None in (x, indices, weights, gate_up, down):
        return
    if len(gate_up) != 3 or len(down) != 3:
        raise FormatError(f"{where}: expert weights must be [E, 2I, H] and [E, H, I], got {gate_up} and {down}")
    experts, two_i, hidden = gate_up
    if down[0] != experts or down[1] != hidden or two_i != 2 * down[2]:
        raise FormatError(
            f"{where}: gate_up {gate_up} and down {down} do not describe the same experts ([E, 2I, H], [E, H, I])"
        )
    if len(x) != 2 or x[1] != hidden:
        raise FormatError(f"{where}: x must be [T, {hidden}], got {x}")
    if len(indices) != 2 or tuple(indices) != tuple(weights) or indices[0] != x[0]:
        raise FormatError(f"{where}: indices {indices} and weights {weights} must both be [T, k] for x {x}")
    if isinstance(indices[1], int) and not 1 <= indices[1] <= experts:
        raise FormatError(f"{where}: each token picks {indices[1]} experts of {experts}")
    bias_shapes = tuple(_static_shape(graph, s) for s in biases)
    if biases and None not in bias_shapes and bias_shapes != ((experts, two_i), (experts, hidden)):
        raise FormatError(
            f"{where}: expert biases must be [E, 2I] = {[experts, two_i]} and [E, H] = {[experts, hidden]}, "
            f"got {list(bias_shapes[0])} and {list(bias_shapes[1])}"
        )


_EXPERTS_RULE = (
    "[T, H]: sum over j of weights[t, j] * (down[e] @ (act(gate) * up) + down_bias[e]), [gate; up] = "
    "gate_up[e] @ x[t] + gate_up_bias[e], e = indices[t, j] (biases [E, 2I] and [E, H], both or neither); "
    "dtype of x (MLX: gather_mm over the selected experts' weights)"
)
_ACTIVATION_ATTRS = (
    AttrSpec("activation", "str", choices=EXPERT_ACTIVATIONS),
    AttrSpec("alpha", "float", required=False),
    AttrSpec("limit", "float", required=False),
)
define(
    OpSpec(
        "experts",
        ("x", "indices", "weights", "gate_up", "down", "gate_up_bias?", "down_bias?"),
        _ACTIVATION_ATTRS,
        output_rule=_EXPERTS_RULE,
        check=_check_experts,
    )
)
define(
    OpSpec(
        "quantized_experts",
        ("x", "indices", "weights", "gate_up", "gate_up_scales", "gate_up_biases?", "down", "down_scales",
         "down_biases?", "gate_up_bias?", "down_bias?"),
        _ACTIVATION_ATTRS + (AttrSpec("group_size", "int"), AttrSpec("bits", "int"), AttrSpec("mode", "str")),
        output_rule=_EXPERTS_RULE + "; each weight replaced by its packed parts, every expert packed as a "
        "quantized_linear weight; the biases stay full precision (MLX: gather_qmm)",
        check=_check_experts,
    )  # fmt: skip
)

# Upstream ExecuTorch's MoE matmuls (GatherMmNode, GatherQmmNode), imported as MLX runs them.
# ``sorted_indices`` (0 or 1, or a host int computed at run time) promises the indices are
# sorted, which lets MLX take its grouped kernel; with unsorted indices the result is wrong,
# as upstream's runtime gives it.
_GATHER_RULE = (
    "a @ b over the batch dims, a's matrices picked by lhs_indices and b's by rhs_indices (each defaults to "
    "every batch index; indices and batch dims broadcast); dtype of a (MLX: gather_mm)"
)
define(
    OpSpec(
        "gather_mm",
        ("a", "b", "lhs_indices?", "rhs_indices?"),
        (AttrSpec("sorted_indices", "int_or_ref"),),
        output_rule=_GATHER_RULE,
    )
)


def _check_gather_qmm(instr: Instruction, graph: Graph) -> None:
    attrs = dict(instr.attrs)
    try:
        quantization.QuantSpec(attrs["mode"], attrs["bits"], attrs["group_size"])
    except quantization.QuantizationError as exc:
        raise FormatError(f"instruction 'gather_qmm': {exc}") from None


define(
    OpSpec(
        "gather_qmm",
        ("x", "w", "scales", "biases?", "lhs_indices?", "rhs_indices?"),
        (AttrSpec("transpose", "bool"), AttrSpec("group_size", "int"), AttrSpec("bits", "int"),
         AttrSpec("mode", "str"), AttrSpec("sorted_indices", "int_or_ref")),
        output_rule="x @ dequantize(w) (w's last two axes swapped when transpose) over the batch dims, x's "
        "matrices picked by lhs_indices and w's by rhs_indices, as gather_mm; dtype of x (MLX: gather_qmm)",
        check=_check_gather_qmm,
    )  # fmt: skip
)
define(
    OpSpec(
        "item",
        ("x",),
        output_rule="int: the value of x, which holds one integer (read on the host: the device syncs)",
        scalar_result=True,
    )
)
