"""The CUDA decode attention over rows of unequal history, and the steps that take it.

``decode_attention`` runs only where MLX runs on CUDA; there (``bench/gpu_suite.sh`` step
``gpu_tests``) its cases compare it with float64 attention in numpy over the positions
each row sees, counted in the test (flat and ring layers, softcap, sinks), directly and
through a batched-sequence cache. Everywhere, the plan cases check which steps hand it
their rows and the query positions they hand it.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.cache import Step
from mlx_pte.runtime.mlx import decode_attention, padded

from .helpers import make_driver
from .oracle import full_attention

ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the kernel runs on CUDA only")

DTYPES = {"float32": (mx.float32, 2e-5), "bfloat16": (mx.bfloat16, 3e-2), "float16": (mx.float16, 4e-3)}


def batch_of(cache, layer: int = 0) -> padded.PaddedBatch | None:
    """The padded batch the declared step attends ``layer`` with."""
    plan = cache.step_plan
    layout = cache.policies.layouts[cache.policies.layer_layout[layer]]
    return padded.plan_padded(plan.runs_for_layer(layer), layout)


def prefilled(windows: list[int], lengths: list[int], atol: float = 1e-3, **options):
    """A batched-sequence driver whose sequences hold ``lengths`` tokens each."""
    d = make_driver("batched-sequence", windows, capacity=512, max_write=8, **options)
    seqs = [d.cache.seq_new() for _ in lengths]
    for seq, n in zip(seqs, lengths):
        for at in range(0, n, 8):  # a ring takes at most max_write tokens a step
            d.prefill(seq, at, min(8, n - at), atol=atol)
    return d, seqs


@pytest.fixture(autouse=True)
def padded_always(monkeypatch):
    """Every step of several sequences attends as one padded batch."""
    monkeypatch.setattr(padded, "SPAN_OVERHEAD_PAIRS", 10**9)


@pytest.mark.parametrize("windows", [[0], [4]], ids=["flat", "ring"])
def test_a_decode_step_of_unequal_rows_hands_over_each_rows_query_position(windows):
    d, (a, b, c, e) = prefilled(windows, [5, 2, 7, 3])
    # c and b step, a and e sit it out; rows are sequence ids, so a's row is 0.
    d.cache.declare_step(Step((c, b), (7, 2)))
    batch = batch_of(d.cache)
    assert batch.masked_decode
    rows = {seq: seq - batch.lo for seq in (a, b, c, e) if batch.lo <= seq < batch.hi}
    want = np.full(batch.hi - batch.lo, -1, np.int32)
    want[rows[c]], want[rows[b]] = 7, 2
    np.testing.assert_array_equal(np.array(batch.query_positions), want)
    d.cache.abort_step()


def test_steps_the_kernel_does_not_take():
    d, (a, b) = prefilled([0, 4], [5, 5])
    d.cache.declare_step(Step((a, b), (5, 5)))  # equal rows: the fused kernel, mask-free
    assert not batch_of(d.cache, 0).masked_decode
    d.cache.abort_step()
    d.check([a], [5])
    d.cache.declare_step(Step((a, b), (6, 5)))
    assert batch_of(d.cache, 0).masked_decode
    assert batch_of(d.cache, 1).masked_decode  # a ring too: the kernel finds each slot's position
    d.cache.abort_step()
    d.cache.declare_step(Step((a, a, b), (6, 7, 5)))  # two queries in a row: a mask
    assert not batch_of(d.cache, 0).masked_decode
    d.cache.abort_step()


def test_the_kernel_stays_off_the_cpu():
    q = mx.zeros((2, 4, 1, 64))
    kv = mx.zeros((2, 2, 8, 64))
    with mx.stream(mx.cpu):
        assert not decode_attention.available(q, kv, kv)


def visible_slots(newest: int, slots: int, ring: int, window: int) -> list[int]:
    """The slots a query at ``newest`` sees, oldest first: a flat layer holds position t at
    slot t; a ring of ``ring`` slots writes position t at slot ``t % ring`` and keeps the
    last ``ring`` positions, of which the query sees those within ``window``."""
    if not ring:
        return list(range(newest + 1))
    first = max(0, newest - ring + 1, newest - window + 1 if window else 0)
    return [t % ring for t in range(first, newest + 1) if t % ring < slots]


def contract_rows(q, k, v, newest, scale, ring, window, softcap=0.0, sinks=None) -> np.ndarray:
    """float64 [B, Hq, Dv]: each row's attention over the slots its query sees (zeros for
    a row outside the step), from arrays of any dtype."""
    q64, k64, v64 = (np.array(a.astype(mx.float32), np.float64) for a in (q, k, v))
    sinks64 = None if sinks is None else np.array(sinks.astype(mx.float32), np.float64)
    out = np.zeros((q64.shape[0], q64.shape[1], v64.shape[-1]))
    for row, p in enumerate(np.asarray(newest)):
        if p >= 0:
            seen = visible_slots(int(p), k64.shape[2], ring, window)
            # k64[row] first: [row, :, seen] would mix a scalar and a list index, moving the
            # slot axis to the front.
            out[row] = full_attention(q64[row, :, 0], k64[row][:, seen].transpose(1, 0, 2),
                                      v64[row][:, seen].transpose(1, 0, 2), scale, softcap, sinks64)
    return out


def assert_rows_match(got: np.ndarray, want: np.ndarray, newest: np.ndarray, atol: float) -> None:
    for row, p in enumerate(newest):
        if p < 0:
            np.testing.assert_array_equal(got[row], 0)
        else:
            np.testing.assert_allclose(got[row, :, 0], want[row], atol=atol, rtol=atol, err_msg=f"row {row}")


LAYOUTS = {"flat": (0, 0), "ring": (11, 7), "ring-whole": (9, 9)}  # (ring slots, window)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,dim", [(32, 8, 64), (8, 8, 128), (16, 2, 96), (4, 1, 256)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_matches_float64_attention_over_pool_views(dtype, q_heads, kv_heads, dim, layout):
    mx_dtype, atol = DTYPES[dtype]
    ring, window = LAYOUTS[layout]
    rng = np.random.default_rng(dim + q_heads)
    rows, slots = 6, 48
    read = ring or 37
    pool = mx.array(rng.standard_normal((rows + 2, kv_heads, slots, dim), np.float32)).astype(mx_dtype)
    values = mx.array(rng.standard_normal((rows + 2, kv_heads, slots, dim), np.float32)).astype(mx_dtype)
    # Queries laid out heads first, as RoPE leaves them: the kernel reads them transposed.
    q = mx.array(rng.standard_normal((q_heads, rows, dim), np.float32)).astype(mx_dtype)
    queries = q.transpose(1, 0, 2)[:, :, None, :]
    # Row 2 is outside the step; a ring's rows wrap (30), fill (5) or have not (0, 3).
    newest = np.array([0, read - 1, -1, 16, 30, 5] if not ring else [0, 3, -1, 16, 30, 5], np.int32)
    k_view, v_view = pool[1 : rows + 1, :, :read], values[1 : rows + 1, :, :read]
    got = np.array(decode_attention.decode_attention(
        queries, k_view, v_view, mx.array(newest), 0.125, ring_slots=ring, window=window).astype(mx.float32))
    assert got.shape == (rows, q_heads, 1, dim)
    assert_rows_match(got, contract_rows(queries, k_view, v_view, newest, 0.125, ring, window), newest, atol)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("softcap,with_sinks", [(30.0, False), (0.0, True), (5.0, True)])
def test_kernel_caps_scores_and_adds_sinks_as_attention_does(dtype, layout, softcap, with_sinks):
    mx_dtype, atol = DTYPES[dtype]
    ring, window = LAYOUTS[layout]
    rng = np.random.default_rng(7)
    rows, q_heads, kv_heads, dim, read = 4, 8, 2, 64, ring or 20
    k = mx.array(rng.standard_normal((rows, kv_heads, read, dim), np.float32)).astype(mx_dtype)
    v = mx.array(rng.standard_normal((rows, kv_heads, read, dim), np.float32)).astype(mx_dtype)
    # Large queries, so a cap of 5 bites.
    q = mx.array(4 * rng.standard_normal((rows, q_heads, 1, dim), np.float32)).astype(mx_dtype)
    sinks = mx.array(rng.standard_normal(q_heads, np.float32)).astype(mx_dtype) if with_sinks else None
    newest = np.array([-1, 2, read - 1, 25] if ring else [-1, 2, read - 1, 9], np.int32)
    got = np.array(decode_attention.decode_attention(
        q, k, v, mx.array(newest), 0.125, ring_slots=ring, window=window, softcap=softcap, sinks=sinks,
    ).astype(mx.float32))
    assert_rows_match(got, contract_rows(q, k, v, newest, 0.125, ring, window, softcap, sinks), newest, atol)


def kernel_contract(q, k, v, newest, scale, *, ring_slots=0, window=0, softcap=0.0, sinks=None):
    """``decode_attention``'s contract (its module docstring) in float64 numpy: the stand-in
    through which the CPU checks what the cache hands the kernel."""
    out = contract_rows(q, k, v, np.array(newest), scale, ring_slots, window, softcap, sinks)
    return mx.array(out[:, :, None].astype(np.float32)).astype(q.dtype)


def decode_steps_match_the_oracle(lengths, stepping, dtype, softcap, kernel) -> None:
    """Prefill ``lengths``, then three decode steps of drawn sequences through ``kernel``
    (the spy counts its calls), every output against the oracle."""
    mx_dtype, atol = DTYPES[dtype]
    # A flat layer and a ring (window 6 in 6 + 8 - 1 slots): both decode through the kernel.
    # Their prefill does not: a ring's runs through MLX's masked SDPA, whose fp32 on GPUs was
    # 1.7e-4 and more off float64, hence the prefill's looser tolerance (it is not under test).
    d, seqs = prefilled([0, 6], lengths, DTYPES["bfloat16"][1], q_heads=8, kv_heads=2, head_dim=64,
                        q_dtype=mx_dtype, kv_dtype=dtype, softcap=softcap)
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[3])
        return kernel(*args, **kwargs)

    for _ in range(3):
        chosen = stepping.draw(st.lists(st.sampled_from(seqs), min_size=2, unique=True))
        positions = [d.cache.pos(s) for s in chosen]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(decode_attention, "decode_attention", spy)
            d.check(chosen, positions, atol=atol)
        if len(set(positions)) > 1:
            assert len(calls) == 2, "each layer's decode step of unequal rows ran the kernel"
        calls.clear()


DECODE_STEPS = dict(
    lengths=st.lists(st.integers(1, 40), min_size=2, max_size=6),
    stepping=st.data(),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    softcap=st.sampled_from([0.0, 20.0]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**DECODE_STEPS)
def test_the_cache_hands_the_kernel_what_each_row_sees(lengths, stepping, dtype, softcap, monkeypatch):
    """On any device: the kernel's contract in its place, so the query positions, pool views,
    ring geometry and softcap the cache passes are checked against the oracle."""
    monkeypatch.setattr(decode_attention, "available", lambda q, k, v: True)
    decode_steps_match_the_oracle(lengths, stepping, dtype, softcap, kernel_contract)


@cuda_only
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**DECODE_STEPS)
def test_cache_decode_steps_through_the_kernel_match_the_oracle(lengths, stepping, dtype, softcap):
    decode_steps_match_the_oracle(lengths, stepping, dtype, softcap, decode_attention.decode_attention)
