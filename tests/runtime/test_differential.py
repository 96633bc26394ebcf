"""Differential: the MLX and reference byte layers of every kind, and a cacheless oracle.

Hypothesis draws a geometry (flat and ring layers, GQA ratio, head dims with Dv != D,
softcap, attention sinks, max_write, storage dtype) and a script of verbs and steps. Every step's random
q/k/v are generated once and fed to every cache; every layer's output must match the
oracle (float64 attention recomputed from each sequence's stored history) and the other
caches. Scripts hold only verbs every kind accepts and verbs every kind refuses, so one
oracle describes all caches; each refusal's reason must be the same on both backends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_pte.runtime.mlx.blas  # noqa: F401  (loads OpenBLAS before mlx.core)
import mlx.core as mx
import mlx_pte.runtime.mlx  # noqa: F401  (registers the "mlx" caches)
import mlx_pte.runtime.reference  # noqa: F401  (registers the "reference" caches)
from mlx_pte.runtime.cache import (
    CACHE_FACTORY,
    KIND_SINGLE,
    KINDS,
    CacheConfig,
    CacheGeometry,
    CacheRefused,
    Step,
)

from .reference.oracle import HistoryOracle
from .reference.scenario import (
    TORCH,
    Backend,
    StepData,
    attend_all,
    expected_all,
    geometry,
    random_step,
    stored,
)

MLX = Backend("mlx", mx.array, lambda a: np.array(a.astype(mx.float32)))
BACKENDS = (TORCH, MLX)
ATOL = 1e-5
CAPACITY = 256  # room is never what refuses a scripted verb
MAX_TOKENS = 6  # most tokens a sequence writes in one step


FAST = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@dataclass(frozen=True)
class Setup:
    geo: CacheGeometry
    config: CacheConfig
    n_q: int
    softcap: float
    sinks: Optional[np.ndarray]  # [n_q] float32 (gpt-oss's attention sinks), or None

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(layer.policy.window for layer in self.geo.layers)


@st.composite
def setups(draw) -> Setup:
    windows = draw(st.lists(st.sampled_from([0, 0, 1, 2, 3, 5]), min_size=1, max_size=3))
    n_kv = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8]))
    v_head_dim = draw(st.sampled_from([head_dim, 3]))
    config = CacheConfig(
        capacity=CAPACITY,
        max_write=draw(st.sampled_from([None, 1, 2, 4])),
        initial_capacity=draw(st.sampled_from([1, 4, 512])),
        kv_dtype=draw(st.sampled_from(["float32", "float32", "float16", "bfloat16"])),
    )
    n_q = n_kv * draw(st.sampled_from([1, 2, 3]))
    sinks = draw(st.none() | st.lists(st.floats(-3, 3, width=32), min_size=n_q, max_size=n_q))
    return Setup(
        geometry(windows, n_kv, head_dim, v_head_dim),
        config,
        n_q,
        draw(st.sampled_from([0.0, 2.5])),
        None if sinks is None else np.array(sinks, np.float32),
    )


@dataclass
class Harness:
    """Every (backend, kind) cache and the oracle, driven through the same script."""

    setup: Setup
    kinds: tuple[str, ...]
    caches: dict[tuple[str, str], Any] = field(default_factory=dict)
    oracle: HistoryOracle = field(init=False)
    pos: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for backend in BACKENDS:
            for kind in self.kinds:
                self.caches[backend.name, kind] = CACHE_FACTORY.build(
                    backend.name, kind, self.setup.geo, self.setup.config
                )
        self.oracle = HistoryOracle(self.setup.windows)

    @property
    def single(self) -> bool:
        return KIND_SINGLE in self.kinds

    @property
    def step_limit(self) -> int:
        """Most tokens a sequence may write in one step on every kind."""
        rings = [c.max_write for c in self.any_cache.policies.rings]
        return min([MAX_TOKENS, *rings])

    @property
    def any_cache(self) -> Any:
        return next(iter(self.caches.values()))

    def floor(self, seq: int) -> int:
        """The oldest position every kind can resume ``seq`` at."""
        floor = max(
            cache.rewind_floor(seq) for cache in self.caches.values()
        )
        # A sequence can always resume where it stands.
        assert floor <= self.pos[seq], f"sequence {seq} at {self.pos[seq]} has floor {floor}"
        return floor

    # -- verbs ------------------------------------------------------------------------
    def verb(self, name: str, *args: Any) -> list[Any]:
        """Apply a verb to every cache; all accept (returns their results) or all refuse."""
        results: dict[tuple[str, str], Any] = {}
        refused: dict[tuple[str, str], Optional[str]] = {}
        for (backend, kind), cache in self.caches.items():
            try:
                results[backend, kind] = getattr(cache, name)(*args)
                refused[backend, kind] = None
            except CacheRefused as refusal:
                refused[backend, kind] = refusal.reason
        self.assert_same_verdicts(name, refused)
        if any(refused.values()):
            return []
        return list(results.values())

    def assert_same_verdicts(
        self, what: str, refused: dict[tuple[str, str], Optional[str]]
    ) -> None:
        assert len({r is None for r in refused.values()}) == 1, f"{what}: kinds disagree {refused}"
        for kind in self.kinds:
            reasons = {refused[b.name, kind] for b in BACKENDS}
            assert len(reasons) == 1, f"{what} on {kind}: backends disagree {reasons}"

    def refuse(self, name: str, *args: Any) -> None:
        assert self.verb(name, *args) == [], f"{name}{args} was accepted"

    def seq_new(self) -> int:
        ids = set(self.verb("seq_new"))
        assert len(ids) == 1, ids
        seq = ids.pop()
        self.oracle.new(seq)
        self.pos[seq] = 0
        return seq

    def seq_rm(self, seq: int) -> None:
        self.verb("seq_rm", seq)
        self.oracle.remove(seq)
        del self.pos[seq]

    def seq_clone(self, src: int, upto: int) -> int:
        ids = set(self.verb("seq_clone", src, upto))
        assert len(ids) == 1, ids
        dst = ids.pop()
        self.oracle.clone(src, dst, upto)
        self.pos[dst] = upto
        return dst

    def clear(self) -> None:
        self.verb("clear")
        self.oracle = HistoryOracle(self.setup.windows)
        self.pos = {}

    def rewind(self, seq: int, position: int) -> None:
        self.verb("rewind", seq, position)
        self.oracle.rewind(seq, position)
        self.pos[seq] = position

    # -- steps ------------------------------------------------------------------------
    def step(
        self, seq_ids: list[int], data: StepData, bad: Optional[Step] = None, abort: bool = False
    ) -> None:
        """Run one step on every cache and check every layer's output.

        ``bad``: a declaration every kind refuses, tried once the step is declared; the
        declared step must still run. ``abort``: abandon the step after attending.
        """
        running = dict(self.pos)
        positions = []
        for s in seq_ids:
            positions.append(running[s])
            running[s] += 1
        step = Step(seq_ids, positions)
        softcap = self.setup.softcap
        # The oracle holds K/V as storage keeps them; attention itself runs in fp32.
        truth = stored(data, self.setup.config.kv_dtype)
        want = expected_all(self.oracle, step, truth, 0.5, softcap, self.setup.sinks)
        self.verb("declare_step", step)
        if bad is not None:
            self.refuse("declare_step", bad)
        outs = {}
        for (backend, kind), cache in self.caches.items():
            converter = MLX if backend == MLX.name else TORCH
            outs[backend, kind] = attend_all(cache, converter, data, 0.5, softcap, self.setup.sinks)
        self.verb("abort_step" if abort else "finish_step")
        reference = outs[TORCH.name, self.kinds[0]]
        for key, got in outs.items():
            for layer, (out, expected, ref) in enumerate(zip(got, want, reference)):
                where = f"{key} layer {layer} of {step}"
                close = dict(atol=ATOL, rtol=0)
                np.testing.assert_allclose(out, expected, **close, err_msg=f"oracle: {where}")
                np.testing.assert_allclose(out, ref, **close, err_msg=f"reference: {where}")
        if not abort:
            self.oracle.commit(step.seq_ids, step.positions, truth.k, truth.v)
            self.pos = running

    def a_bad_step(self, draw, live: list[int]) -> Step:
        """A declaration every kind refuses: an unknown sequence, or a stale position."""
        stale = [s for s in live if self.pos[s] > 0]
        if stale and draw(st.booleans()):
            seq = draw(st.sampled_from(stale))
            return Step((seq,), (draw(st.integers(0, self.pos[seq] - 1)),))
        unknown = max(live, default=0) + draw(st.integers(1, 3))
        return Step((unknown,), (0,))


def run_script(harness: Harness, data: st.DataObject, seqs: list[int], n_ops: int) -> None:
    draw = data.draw
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    setup = harness.setup
    batched = not harness.single
    for _ in range(n_ops):
        choices = ["step", "step", "step", "abort", "rewind", "bad"]
        if batched:
            choices += ["new", "new", "clone", "rm", "clear"]
        op = draw(st.sampled_from(choices))
        held = [s for s in seqs if harness.pos[s] > 0]
        if op in ("step", "abort"):
            if not seqs:
                continue
            seq_ids: list[int] = []
            taken: dict[int, int] = {}
            for _ in range(draw(st.integers(1, 4 if batched else 1))):
                seq = draw(st.sampled_from(seqs))
                room = harness.step_limit - taken.get(seq, 0)
                if room > 0:
                    count = draw(st.integers(1, room))
                    taken[seq] = taken.get(seq, 0) + count
                    seq_ids += [seq] * count
            if not seq_ids:
                continue
            bad = harness.a_bad_step(draw, seqs) if draw(st.booleans()) else None
            step_data = random_step(rng, setup.geo, setup.n_q, len(seq_ids))
            harness.step(seq_ids, step_data, bad=bad, abort=op == "abort")
        elif op == "rewind" and held:
            seq = draw(st.sampled_from(held))
            harness.rewind(seq, draw(st.integers(harness.floor(seq), harness.pos[seq])))
        elif op == "bad":
            seq = draw(st.sampled_from(seqs)) if seqs else 0
            beyond = harness.pos.get(seq, 0) + draw(st.integers(1, 3))
            if batched and draw(st.booleans()):
                harness.refuse("seq_clone", seq, beyond)
            elif seqs:
                harness.refuse("rewind", seq, beyond)
            else:
                harness.refuse("declare_step", harness.a_bad_step(draw, seqs))
        elif op == "new":
            seqs.append(harness.seq_new())
        elif op == "clone" and held:
            src = draw(st.sampled_from(held))
            upto = draw(st.integers(max(1, harness.floor(src)), harness.pos[src]))
            seqs.append(harness.seq_clone(src, upto))
        elif op == "clear":
            harness.clear()
            seqs.clear()
        elif op == "rm" and seqs:
            seq = draw(st.sampled_from(seqs))
            seqs.remove(seq)
            harness.seq_rm(seq)


@FAST
@given(setup=setups(), data=st.data())
def test_one_sequence_agrees_across_every_kind_and_backend(setup: Setup, data) -> None:
    harness = Harness(setup, KINDS)
    # Every kind hands out id 0 first (single: its one sequence).
    for cache in harness.caches.values():
        assert cache.seq_new() == 0
    harness.oracle.new(0)
    harness.pos[0] = 0
    run_script(harness, data, [0], n_ops=data.draw(st.integers(1, 8)))


@FAST
@given(setup=setups(), data=st.data())
def test_many_sequences_agree_across_batched_kinds_and_backends(setup: Setup, data) -> None:
    harness = Harness(setup, tuple(k for k in KINDS if k != KIND_SINGLE))
    seqs = [harness.seq_new() for _ in range(data.draw(st.integers(2, 4)))]
    run_script(harness, data, seqs, n_ops=data.draw(st.integers(1, 10)))
