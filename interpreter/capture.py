"""Graph capture: a program's forward as ``mx.compile``d segments between attention calls.

Why segments rather than the whole step under one ``mx.compile`` (measured with
``bench/capture_modes.py``, which also runs a whole-step prototype: fixed-size K/V buffers
as compiled state, written with ``slice_update`` at an array offset, read whole through an
array mask):

- On this repository's shared 2-core CPU the two are within noise of each other, and both
  beat the walk: the bundled 4M model decodes 1.3-1.6x faster than the walk (wall time;
  15-25% less process CPU time per step), the 135M benchmark model is matmul-bound and
  equal in all three modes. The CPU cannot decide between them: MLX's CPU attention is
  never the fused kernel, so the whole step's mask costs it nothing there.
- On CUDA the mask decides: MLX's fused decode attention (the vector kernel) takes no
  array mask, and a hand-written whole step with a mask decoded ~20% slower on an H200
  than without. A whole step must read its fixed buffers whole, so it needs that mask on
  every decode step; segments read exactly the written history, so decode on the
  sequence layouts needs no mask, and a prefill whose window covers the span gets the
  fused ``"causal"``.
- Segments keep the cache as it is: every kind, rings past their window, forks and
  rewinds run the byte layer the walk runs (no second, fixed-shape byte layer per kind).

``bench/gpu_decode.py --capture both --whole-step`` measures all three on the GPU.

A ``Capture`` splits the prepared steps at every op that reads the run's context (the
cache: ``CONTEXT_OPS``); each maximal run of other steps is a ``Segment``, compiled with
its live-in arrays (weights included) as inputs and its live-out arrays as outputs. Host
ints (dynamic sizes) are computed while a segment is traced and kept per shape: they
depend only on the input shapes. The KV pools never enter a compiled graph, so their
growth (by doubling) recompiles nothing.

Shapes are bucketed so that steady decode and prefill chunks reuse compiled graphs: each
dynamic dimension is padded (with zeros) up to the next power of two, or above 256 the
next multiple of 256 (``bucket``), capped at its maximum. The padding rows are computed and dropped: the context ops see only the real
tokens (their token axes are sliced before and padded after), and outputs are sliced back.
This relies on what every exported LLM forward satisfies: outside attention, a token's
row never reads another token's row. One compilation happens per segment per bucket;
``compilations`` counts them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.ir.graph import Graph, SymDim, TensorType

from .handlers import RunContext
from .plan import PreparedStep, ShapeKey, call_handler, int_slots


@dataclass(frozen=True)
class TokenAxes:
    """Where a context op's operands and result carry the step's tokens (None: nowhere)."""

    operands: tuple[Optional[int], ...]
    result: int


# Ops that read or write the run's context (the KV cache): they run between segments.
CONTEXT_OPS: dict[str, TokenAxes] = {
    # q [1, Hq, T, D], k [1, Hkv, T, D], v [1, Hkv, T, Dv], positions [T], sinks [Hq] -> [1, Hq, T, Dv]
    "update_and_attend": TokenAxes((2, 2, 2, 0, None), 2),
}


@dataclass(frozen=True)
class Segment:
    """Steps with no context op, run as one compiled function."""

    steps: tuple[PreparedStep, ...]
    inputs: tuple[int, ...]  # array slots it reads that earlier code (or the loader) wrote
    outputs: tuple[int, ...]  # array slots it writes that later code (or the caller) reads
    int_outputs: tuple[int, ...]  # host-int slots it writes that later code reads


@dataclass(frozen=True)
class ContextCall:
    """One context op, run as is (the cache's host plan drives it)."""

    step: PreparedStep
    axes: TokenAxes


Part = Union[Segment, ContextCall]


def split(graph: Graph, steps: Sequence[PreparedStep]) -> list[Part]:
    """The steps cut at every context op into segments, with each segment's live slots."""
    ints = int_slots(graph)
    # For each slot, the last step index that reads it (graph outputs: read at the end).
    last_read: dict[int, int] = {s: len(steps) for s in graph.outputs}
    for i, step in enumerate(steps):
        for s in step.reads:
            last_read[s] = i if last_read.get(s, -1) < i else last_read[s]
    parts: list[Part] = []
    start = 0
    for i in range(len(steps) + 1):
        if i < len(steps) and steps[i].op not in CONTEXT_OPS:
            continue
        if i > start:
            parts.append(_segment(steps, start, i, last_read, ints))
        if i < len(steps):
            parts.append(ContextCall(steps[i], CONTEXT_OPS[steps[i].op]))
        start = i + 1
    return parts


def _segment(steps: Sequence[PreparedStep], start: int, end: int, last_read: dict[int, int],
             ints: frozenset[int]) -> Segment:
    written: list[int] = []
    reads: list[int] = []
    for step in steps[start:end]:
        for s in step.reads:
            # Weights are inputs too: MLX checks a compiled function's captured arrays on
            # every call, which costs several times what passing them does.
            if s not in written and s not in reads and s not in ints:
                reads.append(s)
        written.extend(step.outputs)
    live = [s for s in written if last_read.get(s, -1) >= end]
    return Segment(
        tuple(steps[start:end]),
        tuple(reads),
        tuple(s for s in live if s not in ints),
        tuple(s for s in live if s in ints),
    )


# Above this, buckets are its multiples: a power of two would pad a 600-token prefill to
# 1024 (up to 2x the work), a multiple of it pads by less than BUCKET_STEP tokens.
BUCKET_STEP = 256


def bucket(size: int, limit: Optional[int]) -> int:
    """The padded size of a dynamic dimension: the next power of two up to ``BUCKET_STEP``,
    the next multiple of it above, capped at ``limit``."""
    if size <= BUCKET_STEP:
        padded = 1 << max(size - 1, 0).bit_length()
    else:
        padded = -(-size // BUCKET_STEP) * BUCKET_STEP
    return min(padded, limit) if limit is not None and size <= limit else padded


def _pad(a: mx.array, axis: int, size: int) -> mx.array:
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return mx.pad(a, widths)


def _take(a: mx.array, axis: int, size: int) -> mx.array:
    if a.shape[axis] == size:
        return a
    return a[(slice(None),) * axis + (slice(0, size),)]


@dataclass
class _Shape:
    """The compiled segments of one bucket and the host ints its trace computed."""

    calls: list[Optional[Callable[..., Any]]]  # per part: the compiled segment, None for context calls
    ints: dict[int, Any] = field(default_factory=dict)
    complete: bool = False  # one run finished: every host int is known


class Capture:
    """Runs a program's prepared steps as compiled segments, bucketed by shape.

    Args:
        graph: the program's graph.
        steps: its prepared steps (``plan.prepare``).
        template: the slot list every run starts from (weights in place).
    """

    def __init__(self, graph: Graph, steps: Sequence[PreparedStep], template: Sequence[Any]) -> None:
        self.parts = split(graph, steps)
        self._template = list(template)
        self._input_types: list[TensorType] = [graph.slots[s].type for s in graph.inputs]  # type: ignore[misc]
        self._inputs = tuple(graph.inputs)
        self._outputs = tuple(graph.outputs)
        self._output_types = [graph.slots[s].type for s in graph.outputs]
        self._token_symbol = _token_symbol(graph)
        self._shapes: dict[ShapeKey, _Shape] = {}
        self.compilations = 0

    @property
    def buckets(self) -> int:
        """Shape buckets compiled so far."""
        return len(self._shapes)

    def run(self, arrays: Sequence[mx.array], ctx: RunContext) -> list[mx.array]:
        """One forward over already bound (checked and cast) inputs; outputs stay lazy."""
        real: dict[str, int] = {}
        for t, a in zip(self._input_types, arrays):
            for dim, size in zip(t.shape, a.shape):
                if isinstance(dim, SymDim):
                    real[dim.name] = size
        padded = {name: bucket(size, _limit(self._input_types, name)) for name, size in real.items()}
        if self._token_symbol is None and padded != real:
            padded = dict(real)  # no way to tell context ops which rows are real: no padding
        padded_arrays = [self._pad_input(t, a, padded) for t, a in zip(self._input_types, arrays)]
        key: ShapeKey = tuple(tuple(a.shape) for a in padded_arrays)
        # MLX creates a thread's default stream on first use, and its compile cache (one per
        # thread) keys each entry on that stream: a segment first called on a thread before
        # the stream exists would be traced again on its next call there.
        mx.default_stream(mx.default_device())
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._compile()
        try:
            values = self._forward(shape, padded_arrays, ctx, real, padded)
        except BaseException:
            if not shape.complete:  # a bucket whose first run failed is traced again next time
                del self._shapes[key]
            raise
        shape.complete = True
        outs = []
        for slot, t in zip(self._outputs, self._output_types):
            out = values[slot]
            if isinstance(t, TensorType):
                for axis, dim in enumerate(t.shape):
                    if isinstance(dim, SymDim) and dim.name in real:
                        out = _take(out, axis, real[dim.name])
            outs.append(out)
        return outs

    def _pad_input(self, t: TensorType, a: mx.array, padded: dict[str, int]) -> mx.array:
        for axis, dim in enumerate(t.shape):
            if isinstance(dim, SymDim):
                a = _pad(a, axis, padded[dim.name])
        return a

    def _forward(self, shape: _Shape, arrays: Sequence[mx.array], ctx: RunContext,
                 real: dict[str, int], padded: dict[str, int]) -> list:
        values = list(self._template)
        for slot, a in zip(self._inputs, arrays):
            values[slot] = a
        values_ints = shape.ints
        tokens = real.get(self._token_symbol or "", 0)
        padded_tokens = padded.get(self._token_symbol or "", 0)
        for part, call in zip(self.parts, shape.calls):
            if isinstance(part, ContextCall):
                self._context_call(part, values, ctx, tokens, padded_tokens)
                continue
            outs = call(*[values[s] for s in part.inputs]) if call is not None else ()
            for slot, out in zip(part.outputs, outs):
                values[slot] = out
            for slot in part.int_outputs:
                values[slot] = values_ints[slot]
        return values

    @staticmethod
    def _context_call(part: ContextCall, values: list, ctx: RunContext, tokens: int, padded: int) -> None:
        step = part.step
        args = [None if s is None else values[s] for s in step.inputs]
        if tokens != padded:
            args = [a if axis is None or a is None else _take(a, axis, tokens)
                    for a, axis in zip(args, part.axes.operands)]
        out = call_handler(step.index, step.op, step.handler, args, step.attrs_for(values), ctx)
        values[step.outputs[0]] = _pad(out, part.axes.result, padded) if tokens != padded else out

    def _compile(self) -> _Shape:
        shape = _Shape(calls=[])
        for part in self.parts:
            if isinstance(part, ContextCall):
                shape.calls.append(None)
            elif not part.outputs:
                # Host ints only: nothing to compile; the trace below still records them.
                shape.calls.append(self._traced(part, shape.ints, compiled=False))
            else:
                shape.calls.append(mx.compile(self._traced(part, shape.ints, compiled=True)))
        return shape

    def _traced(self, segment: Segment, ints: dict[int, Any], compiled: bool) -> Callable[..., tuple]:
        template = self._template
        ctx = RunContext()

        def run(*arrays: mx.array) -> tuple:
            if compiled:
                self.compilations += 1  # MLX calls this only while tracing
            values = list(template)
            for slot, value in ints.items():
                values[slot] = value
            for slot, a in zip(segment.inputs, arrays):
                values[slot] = a
            for step in segment.steps:
                step.run(values, ctx)
            for slot in segment.int_outputs:
                ints[slot] = values[slot]
            return tuple(values[s] for s in segment.outputs)

        return run


def _limit(types: Sequence[TensorType], name: str) -> Optional[int]:
    for t in types:
        for dim in t.shape:
            if isinstance(dim, SymDim) and dim.name == name:
                return dim.max
    return None


def _token_symbol(graph: Graph) -> Optional[str]:
    """The dynamic dimension counting the step's tokens: axis 0 of the ``positions`` input
    (the exported forward's signature), or None when there is no context op to tell."""
    if not any(i.op in CONTEXT_OPS for i in graph.instructions):
        return ""  # nothing needs the real token count: pad freely
    for slot in graph.inputs:
        s = graph.slots[slot]
        if s.name == "positions" and isinstance(s.type, TensorType) and isinstance(s.type.shape[0], SymDim):
            return s.type.shape[0].name
    return None
