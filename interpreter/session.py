"""A Session: one loaded program, one runtime-owned KV cache, and forwards over it.

``forward`` declares the step to the cache, runs the program (one lazy MLX graph,
evaluated once), and finishes the step; if the run fails the step is aborted, so the
cache is exactly as before.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

import mlx_pte.runtime.mlx  # noqa: F401  (registers the "mlx" cache kinds; loads BLAS first)
import mlx.core as mx

from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Graph
from mlx_pte.ir.manifest import Manifest
from mlx_pte.runtime.cache import (
    CACHE_FACTORY,
    KIND_SINGLE,
    CacheControl,
    CacheConfig,
    CacheGeometry,
    LayerGeometry,
    LayerPolicy,
    Step,
)

from mlx_pte.runtime.launch_modes import LAUNCH_MODES
from mlx_pte.runtime.mlx.launcher import Launcher, launcher_for

from .text import checked_manifest


class SessionError(ValueError):
    """A forward that cannot run as asked; the message says what to change."""


def cache_geometry(manifest: Manifest) -> CacheGeometry:
    return CacheGeometry(
        tuple(
            LayerGeometry(LayerPolicy.from_window(c.window), c.n_kv_heads, c.head_dim, c.v_head_dim)
            for c in manifest.cache
        )
    )


def check_cache_ids(graph: Graph, manifest: Manifest) -> None:
    """Every attention instruction names a cache layer the manifest declares."""
    for index, instr in enumerate(graph.instructions):
        cache_id = instr.attr("cache_id")
        if instr.op == "update_and_attend" and not 0 <= cache_id < len(manifest.cache):
            raise FormatError(
                f"instruction {index} ('update_and_attend'): attribute 'cache_id' = {cache_id} names no "
                f"cache layer (the manifest declares {len(manifest.cache)})"
            )


# The prefill chunk when none is asked for, per device, within the export's bound. On the
# CPU, prefill throughput is flat from ~256-token chunks (the GEMMs are at BLAS speed
# already) while a longer chunk grows each step's scores and the rings' slots; on the GPU
# every chunk costs a graph encode on the host (~ms), so fewer, longer chunks win: a
# 2048-token prompt prefilled in 256-token chunks ran at 0.19x mlx-lm, in one chunk 1.0x.
DEFAULT_MAX_STEP = {"cpu": 256, "gpu": 2048}


# How steps are handed to MLX when none is asked for, per device (``runtime.mlx.launcher``).
# On the CPU the launcher thread shares the cores with the compute: SmolLM2-135M decoded
# 0.94x as fast with it (bench/decode.py --launch inline,thread, 5 rounds). A GPU's decode
# step is host-bound, and overlapping its encode with the next build pays: on H100s,
# Llama-3.2-1B B=1 decode ran 1.11-1.35x (bf16) and 1.34-1.47x (q4) as fast on the thread,
# and the engine end to end 1.38-1.60x at B=8-64 (bench/gpu_suite.sh steps launch,
# launch_batches, gemv_forms).
DEFAULT_LAUNCH = {"cpu": "inline", "gpu": "thread"}


def _device() -> str:
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def default_max_step(bound: int) -> int:
    """The run-time prefill chunk for MLX's default device, at most ``bound``."""
    return min(bound, DEFAULT_MAX_STEP[_device()])


def _int_array(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise SessionError(f"{name} must be a 1-D sequence of integers")
    return array.astype(np.int64)


class Session:
    """Forwards of ``program`` over a cache of ``kind``.

    Args:
        program: a loaded Program (its manifest gives the cache geometry).
        kind: "single", "batched-cell" or "batched-sequence".
        capacity: the cache's capacity (meaning per kind: see CacheConfig);
            defaults to the model's max context.
        kv_dtype: K/V storage dtype; defaults to the model's dtype.
        max_seqs: the most live sequences (``single`` holds one).
        max_step: the most tokens one forward takes (the prefill chunk; rings keep room
            for a write of this many), at most the export's bound (``manifest.max_step``);
            default: per device (DEFAULT_MAX_STEP) within that bound.
        capture: run the program captured (``mx.compile``d segments between attention
            calls, shapes bucketed: see ``interpreter.capture``); False walks the steps.
            Results are the same either way.
        launch: how ``generate`` and the engine hand steps to MLX: "thread" encodes them
            on a thread of their own while the host builds the next, "inline" on the
            building thread; default: per device (DEFAULT_LAUNCH). Results are the same.
    """

    def __init__(
        self,
        program,
        kind: str = KIND_SINGLE,
        capacity: Optional[int] = None,
        kv_dtype: Optional[str] = None,
        backend: str = "mlx",
        initial_capacity: int = 512,
        max_seqs: Optional[int] = None,
        capture: bool = True,
        max_step: Optional[int] = None,
        launch: Optional[str] = None,
    ) -> None:
        self.program = program
        self.capture = capture
        self.manifest = checked_manifest(program.manifest)
        check_cache_ids(program.graph, self.manifest)
        self.kind = kind
        bound = self.manifest.max_step
        if max_step is not None and (isinstance(max_step, bool) or not isinstance(max_step, int)
                                     or not 1 <= max_step <= bound):
            raise SessionError(f"max_step must be an integer in [1, {bound}] (the export's bound; re-export "
                               f"with a larger --max-step for longer chunks), got {max_step!r}")
        self._max_step = max_step if max_step is not None else default_max_step(bound)
        if launch is not None and launch not in LAUNCH_MODES:
            raise SessionError(f"launch must be one of {', '.join(LAUNCH_MODES)}, got {launch!r}")
        self.launch_mode = launch or DEFAULT_LAUNCH[_device()]
        config = CacheConfig(
            capacity=capacity if capacity is not None else self.manifest.max_context,
            # A forward writes at most max_step tokens per sequence.
            max_write=self._max_step,
            initial_capacity=initial_capacity,
            kv_dtype=kv_dtype or self.manifest.dtype,
            max_seqs=max_seqs,
        )
        self.cache: CacheControl = CACHE_FACTORY.build(backend, kind, cache_geometry(self.manifest), config)

    @property
    def launcher(self) -> Launcher:
        """The calling thread's launcher of this session's mode: build a step inside its
        ``building()`` and hand it over with ``launch`` (``runtime.mlx.launcher``)."""
        return launcher_for(self.launch_mode)

    @property
    def max_step(self) -> int:
        """The most tokens one forward takes (run-time; within the export's bound)."""
        return self._max_step

    def forward(
        self,
        tokens: Sequence[int] | np.ndarray | mx.array,
        positions: Optional[Sequence[int] | np.ndarray] = None,
        seq_ids: Optional[Sequence[int] | np.ndarray | int] = None,
        rows: Optional[Sequence[int] | np.ndarray] = None,
        evaluate: bool = True,
    ) -> mx.array:
        """Run one step and return float32 logits ``[R, V]`` for the selected rows.

        Args:
            tokens: the step's token ids, in token order. An ``mx.array`` may still be
                unevaluated (e.g. the previous step's argmax): the cache needs only
                positions, so the next step's graph is built without waiting for it.
            positions: each token's position; by default each sequence continues where
                it ends.
            seq_ids: each token's sequence (an int applies to every token); by default
                the cache's one live sequence (``single``'s sequence 0).
            rows: token indices whose logits are wanted; by default the last token of
                each sequence in the step, in first-seen order.
            evaluate: evaluate the logits before returning. With False the caller
                evaluates them (MLX reports graph errors while the graph is built, so the
                step is still aborted on any error raised here).
        """
        if isinstance(tokens, mx.array):
            tokens_a = tokens.astype(mx.int64).reshape(-1)
        else:
            tokens_a = _int_array("tokens", tokens)
        count = tokens_a.size
        if count == 0:
            raise SessionError("a forward needs at least one token")
        if count > self.max_step:
            raise SessionError(
                f"{count} tokens exceed this session's max step of {self.max_step}; "
                "split the prompt into chunks (generate() does this)"
            )
        ids = self._seq_ids(seq_ids, count)
        pos = self._positions(positions, ids)
        rows_a = self._rows(rows, ids)
        step = Step(tuple(int(s) for s in ids), tuple(int(p) for p in pos))
        self.cache.declare_step(step)
        try:
            (logits,) = self.program.run(
                [tokens_a.reshape(1, count), pos, rows_a], cache=self.cache, evaluate=evaluate,
                capture=self.capture,
            )
        except BaseException:
            self.cache.abort_step()
            raise
        self.cache.finish_step()
        return logits

    def _seq_ids(self, seq_ids, count: int) -> np.ndarray:
        if seq_ids is None:
            live = self.cache.live_seqs()
            if len(live) != 1:
                raise SessionError(
                    f"this '{self.kind}' session holds {len(live)} sequences: name each token's in "
                    "seq_ids (create sequences with session.cache.seq_new())"
                )
            seq_ids = live[0]
        if isinstance(seq_ids, (int, np.integer)):
            return np.full(count, int(seq_ids), np.int64)
        ids = _int_array("seq_ids", seq_ids)
        if len(ids) != count:
            raise SessionError(f"seq_ids has {len(ids)} entries for {count} tokens")
        return ids

    def _positions(self, positions, ids: np.ndarray) -> np.ndarray:
        if positions is not None:
            pos = _int_array("positions", positions)
            if len(pos) != len(ids):
                raise SessionError(f"positions has {len(pos)} entries for {len(ids)} tokens")
            return pos
        pos = np.empty(len(ids), np.int64)
        running: dict[int, int] = {}
        for i, s in enumerate(ids.tolist()):
            if s not in running:
                running[s] = self.cache.pos(s)
            pos[i] = running[s]
            running[s] += 1
        return pos

    @staticmethod
    def _rows(rows, ids: np.ndarray) -> np.ndarray:
        if rows is not None:
            rows_a = _int_array("rows", rows)
            if len(rows_a) == 0 or rows_a.min() < 0 or rows_a.max() >= len(ids):
                raise SessionError(f"rows must be 1..{len(ids)} token indices in [0, {len(ids)})")
            return rows_a
        last: dict[int, int] = {}
        for i, s in enumerate(ids.tolist()):
            last[s] = i
        return np.fromiter(last.values(), np.int64, len(last))
