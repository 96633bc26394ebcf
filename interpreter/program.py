"""A loaded program: the IR graph, its weights as MLX arrays, and ``run``.

``run`` binds the inputs (checked against the graph's input types, dynamic ranges
included), then either walks the prepared steps once building one lazy MLX graph, or
runs the captured program (``capture``: compiled segments between attention calls), and
evaluates the outputs together. The steps are prepared at load (``plan``); the walk of a
shape already seen runs steps specialised to it, with no attribute left to resolve.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from mlx_pte.runtime.mlx.bootstrap import mx
from mlx_pte.runtime.mlx.launcher import evaluate as evaluate_arrays

from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.glu_linears import fuse_glu_linears
from mlx_pte.ir.graph import Graph, SymDim, TensorType
from mlx_pte.ir.payload import Payload
from mlx_pte.ir.pte import read_pte
from mlx_pte.ir.norm_linears import fuse_norm_linears
from mlx_pte.ir.rotary_pairs import rotate_heads_together
from mlx_pte.ir.upstream.importer import ImportedPayload

from .capture import Capture
from .handlers import MX_DTYPES, RunContext
from .rope_handlers import rope_form
from .plan import GraphRunError, PreparedStep, ShapeKey, int_slots, prepare, specialise, with_attrs
from .quantized_kernels import check_kernels
from .temporaries import check_temporaries
from .tokenizer_dir import tokenizer_fields

__all__ = ["GraphRunError", "InputError", "Program", "load", "load_weight"]

# Numpy dtypes of the stored bytes; bfloat16 is read as uint16 and reinterpreted.
_NP_STORAGE = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
    "uint32": np.uint32,
}


# Input shapes whose specialised steps are kept (each is a list of step references); past
# this, further shapes run the generic steps.
_MAX_SHAPES = 256


class InputError(ValueError):
    """Inputs that do not match the program's signature; the message names the input."""


# Ops that read positions only as values below 2**31: the fused rope (whose kernel takes
# int32 offsets) and the cache op (which ignores the array: the declared step has them).
_POSITION_READERS = {"rope": 1, "update_and_attend": 3}


def _positions_only(graph: Graph) -> frozenset[int]:
    """The int64 graph inputs read only as positions: fed as int32, so a file exported
    with int64 positions casts them once here, not once per layer inside the kernel."""
    readers: dict[int, list[tuple[str, int]]] = {}
    for instr in graph.instructions:
        for i, slot in enumerate(instr.inputs):
            if slot is not None:
                readers.setdefault(slot, []).append((instr.op, i))
    return frozenset(
        s for s in graph.inputs
        if graph.slots[s].type.dtype == "int64" and readers.get(s) and s not in graph.outputs
        and all(_POSITION_READERS.get(op) == i for op, i in readers[s])
    )  # fmt: skip


def _linear_form(weight: mx.array) -> Optional[dict[str, Any]]:
    """``linear``'s weight as ``[1, in, out]`` (``weight_t``): a transposed view sharing the
    weight's memory, so a batch-1 ``x @ weight_t`` is one matmul node per call."""
    if weight.ndim != 2:
        return None
    transposed = mx.expand_dims(mx.transpose(weight), 0)
    mx.eval(transposed)
    return {"weight_t": transposed}


# op -> (the operand that may be a weight, the attributes worked out from it once at load,
# not per call): the fused rope's form of its frequencies (the base, or the reciprocals),
# and the transposed weight of linear and of the norms fused into one.
_WEIGHT_FORMS: dict[str, tuple[int, Callable[[mx.array], Optional[dict[str, Any]]]]] = {
    "rope": (2, rope_form),
    "linear": (1, _linear_form),
    "rms_norm_linear": (2, _linear_form),
    "add_rms_norm_linear": (3, _linear_form),
    "glu_linear": (2, _linear_form),
}


def _weight_forms(steps: list[PreparedStep], weights: Mapping[int, mx.array]) -> list[PreparedStep]:
    """Each step of a ``_WEIGHT_FORMS`` op whose operand is a weight, with the attributes
    worked out from that weight (once per weight, however many steps read it)."""
    forms: dict[tuple[str, int], Optional[dict[str, Any]]] = {}
    out = []
    for step in steps:
        operand, form = _WEIGHT_FORMS.get(step.op, (None, None))
        slot = None if operand is None else step.inputs[operand]
        if slot is not None and slot in weights:
            if (step.op, slot) not in forms:
                forms[step.op, slot] = form(weights[slot])
            if forms[step.op, slot] is not None:
                step = with_attrs(step, forms[step.op, slot])
        out.append(step)
    return out


def load_weight(raw: Union[bytes, memoryview], t: TensorType) -> mx.array:
    """A constant's stored bytes (sized for its type: the payload checks) as an MLX array."""
    array = mx.array(np.frombuffer(raw, dtype=_NP_STORAGE[t.dtype]).reshape(t.shape))
    return array.view(mx.bfloat16) if t.dtype == "bfloat16" else array


def _mx_kind(dtype: mx.Dtype) -> str:
    if dtype == mx.bool_:
        return "bool"
    return "float" if mx.issubdtype(dtype, mx.floating) else "int"


class Program:
    """A runnable graph with its weights and manifest.

    Args:
        graph: a validated IR graph.
        weights: constant slot → MLX array, one per constant slot of ``graph``.
        manifest: the JSON manifest stored with the program.
    """

    def __init__(self, graph: Graph, weights: Mapping[int, mx.array], manifest: Mapping[str, Any]) -> None:
        missing = [graph.slots[s].name for s in graph.constants() if s not in weights]
        if missing:
            raise FormatError(f"the program has no data for weights {missing}; export it again")
        check_kernels(graph)
        self.graph = graph  # as the file (or this rank's shard of it) has it
        # What runs: the same with the load-time rewrites (q's and k's rotations as one op,
        # a norm and the linear reading it as one, a glu and the linear reading it as one);
        # its slots are the file's, then the ones the rewrites add.
        self.run_graph = graph = fuse_glu_linears(fuse_norm_linears(rotate_heads_together(graph)))
        self.weights = dict(weights)
        # Evaluated here, on the loading thread: a lazy weight (a bfloat16 view of its
        # stored bits) belongs to this thread's stream, which a launcher thread cannot encode.
        mx.eval(list(self.weights.values()))
        self.manifest = dict(manifest)
        self.steps: list[PreparedStep] = _weight_forms(prepare(graph), self.weights)
        self._host_ints = int_slots(graph)
        self._by_shape: dict[ShapeKey, list[PreparedStep]] = {}
        # Each run starts from this list of slot values: the weights in place, the rest empty.
        self._weight_slots: list[Any] = [self.weights.get(s) for s in range(len(graph.slots))]
        self._capture: Optional[Capture] = None
        self._int32_inputs = _positions_only(graph)

    @property
    def capture(self) -> Capture:
        """The captured form of this program, built on first use (see ``capture``)."""
        if self._capture is None:
            self._capture = Capture(self.run_graph, self.steps, self._weight_slots)
        return self._capture

    @property
    def compilations(self) -> int:
        """How many segment compilations (``mx.compile`` traces) runs with capture made."""
        return self._capture.compilations if self._capture is not None else 0

    @classmethod
    def from_payload(cls, payload: Union[Payload, ImportedPayload], group: Any = None,
                     temporaries_budget: Optional[int] = None) -> "Program":
        """A program from a decoded (hence validated) payload, mlx-pte's or an imported
        upstream one; weights are copied into MLX. With ``group`` (an ``mx.distributed``
        group of more than one rank) it is this rank's shard (``interpreter.shards``).
        Its temps are checked against ``temporaries_budget`` bytes first (default: the
        model's own size; see ``interpreter.temporaries``)."""
        graph = payload.graph
        check_temporaries(graph, temporaries_budget)
        release = getattr(payload, "release", None)
        weights = {}
        for s in graph.constants():
            raw = payload.constant_bytes(s)
            weights[s] = load_weight(raw, graph.slots[s].type)  # a copy: the file's pages can go
            if release is not None:
                release(raw)
        manifest = payload.manifest
        if group is not None and group.size() > 1:
            from .shards import shard_program  # mx.distributed only for a sharded load

            graph, weights, manifest = shard_program(graph, weights, manifest, group)
        return cls(graph, weights, manifest)

    def weight(self, name: str) -> mx.array:
        """A weight by its export name (e.g. ``"lm_head.weight"``)."""
        for slot, array in self.weights.items():
            if self.graph.slots[slot].name == name:
                return array
        raise KeyError(f"no weight named {name!r}")

    @property
    def input_types(self) -> list[TensorType]:
        return [self.graph.slots[s].type for s in self.graph.inputs]  # type: ignore[misc]

    def session(self, *args: Any, **kwargs: Any) -> Any:
        """A ``Session`` over this program (see ``interpreter.session.Session``)."""
        from .session import Session  # the session layer builds on Program, not the reverse

        return Session(self, *args, **kwargs)

    def run(
        self, inputs: Sequence[Any], cache: Any = None, evaluate: bool = True, capture: bool = False
    ) -> list[mx.array]:
        """Run the graph once and return its outputs.

        Args:
            inputs: one array per graph input (numpy, MLX or nested lists), in order.
                An input of another dtype of the same kind (int, float, bool) is cast.
            cache: the KV cache ``update_and_attend`` writes to and reads from; the
                caller declares the step before and finishes (or aborts) it after.
            evaluate: evaluate the outputs before returning; with False they stay lazy,
                so a caller can build the next step while this one computes.
            capture: run the compiled segments (``interpreter.capture``) instead of
                walking the steps; same results, fewer dispatches.

        Raises:
            InputError: wrong number of inputs, a dtype of another kind, a wrong rank
                or size, a dynamic size outside its range or inconsistent across inputs.
            MissingCacheError: the graph attends and no cache was given.
            GraphRunError: an instruction failed (the graph contradicts itself).
        """
        arrays = self._bind_inputs(inputs)
        ctx = RunContext(cache)
        if capture:
            outputs = self.capture.run(arrays, ctx)
        else:
            outputs = self._walk(arrays, ctx)
        if evaluate:
            evaluate_arrays(outputs)
        return outputs

    def _walk(self, arrays: list[mx.array], ctx: RunContext) -> list[mx.array]:
        key: ShapeKey = tuple(tuple(a.shape) for a in arrays)
        steps = self._by_shape.get(key)
        values = list(self._weight_slots)
        for slot, array in zip(self.graph.inputs, arrays):
            values[slot] = array
        for step in steps if steps is not None else self.steps:
            step.run(values, ctx)
        if steps is None and len(self._by_shape) < _MAX_SHAPES:
            # Every host int is a function of the input shapes: bind them for next time.
            ints = {s: values[s] for s in self._host_ints}
            self._by_shape[key] = specialise(self.steps, ints, self._host_ints)
        return [values[s] for s in self.graph.outputs]

    def _bind_inputs(self, inputs: Sequence[Any]) -> list[mx.array]:
        types = self.input_types
        if len(inputs) != len(types):
            names = [self.graph.slots[s].name for s in self.graph.inputs]
            raise InputError(f"the program takes {len(types)} inputs {names}, got {len(inputs)}")
        bound: dict[str, tuple[int, str]] = {}
        arrays = []
        for slot, t, value in zip(self.graph.inputs, types, inputs):
            name = self.graph.slots[slot].name
            array = value if isinstance(value, mx.array) else mx.array(np.asarray(value))
            if _mx_kind(array.dtype) != _mx_kind(MX_DTYPES[t.dtype]):
                raise InputError(f"input {name!r} must be {t.dtype}, got {array.dtype}")
            want = mx.int32 if slot in self._int32_inputs else MX_DTYPES[t.dtype]
            if array.dtype != want:
                # Cast on the host where it can: no cast kernel on the device.
                host = want == mx.int32 and not isinstance(value, mx.array)
                array = mx.array(np.asarray(value).astype(np.int32)) if host else array.astype(want)
            _check_shape(name, tuple(array.shape), t.shape, bound)
            arrays.append(array)
        return arrays


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple, bound: dict[str, tuple[int, str]]) -> None:
    def describe(d: Any) -> str:
        return str(d) if isinstance(d, int) else f"{d.name} in [{d.min}, {'inf' if d.max is None else d.max}]"

    wanted = "[" + ", ".join(describe(d) for d in expected) + "]"
    if len(shape) != len(expected):
        raise InputError(f"input {name!r} must have shape {wanted}, got {list(shape)}")
    for axis, (size, dim) in enumerate(zip(shape, expected)):
        if isinstance(dim, SymDim):
            if size < dim.min or (dim.max is not None and size > dim.max):
                raise InputError(f"input {name!r} axis {axis} is {size}; it must be {describe(dim)}")
            seen = bound.setdefault(dim.name, (size, name))
            if seen[0] != size:
                raise InputError(
                    f"input {name!r} axis {axis} is {size}, but {dim.name} is {seen[0]} in input {seen[1]!r}; "
                    "inputs sharing a dynamic size must agree"
                )
        elif size != dim:
            raise InputError(f"input {name!r} must have shape {wanted}, got {list(shape)}")


def load(path: Union[str, Path], tokenizer: Optional[Union[str, Path]] = None, group: Any = None,
         temporaries_budget: Optional[int] = None) -> Program:
    """Read a ``.pte`` (mlx-pte's own, or upstream ExecuTorch's MLX export) and map its
    weights into MLX once.

    Args:
        path: the ``.pte`` file.
        tokenizer: a Hugging Face checkpoint directory whose tokenizer (and config) replace
            the file's; upstream files carry none, so text needs one.
        group: an ``mx.distributed`` group: load this process's tensor-parallel shard
            (``ir.sharding``); every rank of the group must load the same file and run
            the same steps. None, or a group of one, loads the whole program.
        temporaries_budget: the most bytes the file's temps may declare, at their least
            (default: the model's weights, at least 64 MiB; ``interpreter.temporaries``).

    Raises:
        FormatError: the file is not such a program, is truncated or corrupt, or declares
            temps past the budget.
        TokenizerDirError: ``tokenizer`` is not a usable checkpoint directory.
        ShardingError: the program cannot be split over the group's ranks.
    """
    fields = tokenizer_fields(tokenizer) if tokenizer is not None else {}
    program = Program.from_payload(read_pte(path), group, temporaries_budget)
    program.manifest.update(fields)
    return program
