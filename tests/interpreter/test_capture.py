"""Capture (``Session(capture=True)``): compiled segments between attention calls.

The oracle is the uncaptured walk of the same program (itself held to HF by
test_hf_pipeline, which runs with capture on and off): every step of a scenario with
chunked prefills, batched decodes, forks and rewinds, on flat, ring (past its window)
and softcapped families and on every cache kind, gives the same logits and tokens.
Compilations are counted by the program (one per segment per shape bucket).
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

from mlx_pte.interpreter.capture import Segment, bucket
from mlx_pte.interpreter.program import load
from mlx_pte.interpreter.session import Session
from mlx_pte.runtime.cache import KINDS
from tests.fixtures.exported import exported_pte

PROMPT = [5, 17, 3, 99, 42, 8, 61, 23, 7, 11, 30, 2, 54]
LOGITS_ATOL = 1e-4  # fused kernels may reorder float sums; tokens must still agree


@pytest.fixture
def fresh_program(tmp_path_factory, tiny_checkpoint):
    """A program loaded anew (its compilation count starts at 0), exported once."""
    return lambda family: load(exported_pte(tmp_path_factory, tiny_checkpoint, family))


def segments(program) -> int:
    return sum(isinstance(part, Segment) for part in program.capture.parts)


def test_bucket_is_the_next_power_of_two_within_the_limit():
    assert [bucket(n, 32) for n in (1, 2, 3, 5, 8, 9, 31, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert bucket(20, 24) == 24 and bucket(30, None) == 32


def test_buckets_above_256_are_its_multiples():
    """Brute force: the smallest allowed size (a power of two up to 256, a multiple of 256
    above) that holds ``n``, capped at the limit; so padding never exceeds 255 tokens there."""
    allowed = sorted({2**k for k in range(9)} | {256 * m for m in range(1, 20)})
    for n in range(1, 4097):
        expected = next(a for a in allowed if a >= n)
        assert bucket(n, None) == expected
        assert bucket(n, 2000) == (min(expected, 2000) if n <= 2000 else expected)
        if n > 256:
            assert bucket(n, None) - n < 256


@pytest.mark.parametrize("kind", KINDS)
def test_a_64_step_decode_compiles_once_per_bucket(fresh_program, kind):
    program = fresh_program("mistral")  # ring layers: the decode runs far past the window
    session = Session(program, kind=kind, capacity=256, capture=True)
    seq = session.cache.seq_new()
    per_bucket = segments(program)
    session.forward(PROMPT[:5], seq_ids=seq)  # bucket 8
    assert program.compilations == per_bucket
    session.forward(PROMPT[5:12], seq_ids=seq)  # 7 tokens: bucket 8 again
    assert program.compilations == per_bucket
    token = mx.array([3])
    counts = []
    for _ in range(64):
        logits = session.forward(token, seq_ids=seq)
        token = mx.argmax(logits[0]).reshape(1)
        counts.append(program.compilations)
    assert counts == [2 * per_bucket] * 64  # bucket 1 compiled at the first decode step only
    assert program.capture.buckets == 2


def scenario(session: Session) -> list[np.ndarray]:
    """Chunked prefill, decode, rewind (and on batched kinds: a fork and batched decodes)."""
    out = []
    cache = session.cache

    def step(tokens, seq_ids=None, rows=None):
        logits = session.forward(tokens, seq_ids=seq_ids, rows=rows)
        out.append(np.array(logits))
        return [int(t) for t in np.argmax(out[-1], axis=-1)]

    if cache.max_seqs() == 1:  # single: no forks
        for at in range(0, len(PROMPT), 5):
            (token,) = step(PROMPT[at : at + 5])
        for _ in range(10):
            (token,) = step([token])
        cache.rewind(0, cache.pos(0) - 3)
        for _ in range(6):
            (token,) = step([token])
        return out
    a = cache.seq_new()
    for at in range(0, len(PROMPT), 5):
        step(PROMPT[at : at + 5], seq_ids=a)
    b = cache.seq_clone(a, upto=9)  # a fork inside the prompt: b rereads from position 9
    step(PROMPT[9:], seq_ids=b)
    tokens = [3, 4]
    for _ in range(8):  # both sequences in one step
        tokens = step(tokens, seq_ids=[a, b], rows=[0, 1])
    cache.rewind(a, cache.pos(a) - 2)
    c = cache.seq_new()
    tokens = step([tokens[0], tokens[1], *PROMPT[:3]], seq_ids=[a, b, c, c, c], rows=[0, 1, 4])
    for _ in range(6):
        tokens = step(tokens, seq_ids=[a, b, c], rows=[0, 1, 2])
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_capture_equals_the_walk_through_forks_and_rewinds(programs, family, kind):
    program = programs(family)
    walked = scenario(Session(program, kind=kind, capacity=128, capture=False))
    captured = scenario(Session(program, kind=kind, capacity=128, capture=True))
    assert len(walked) == len(captured)
    for want, got in zip(walked, captured):
        np.testing.assert_allclose(got, want, atol=LOGITS_ATOL, rtol=0)
        np.testing.assert_array_equal(np.argmax(got, axis=-1), np.argmax(want, axis=-1))


class DeviceFault(RuntimeError):
    pass


@pytest.mark.parametrize("capture", [True, False], ids=["captured", "walked"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_step_failing_midway_leaves_the_cache_as_before(fresh_program, kind, capture, monkeypatch):
    """A fault in the last attention call of a step (the first run of its shape bucket,
    so mid-trace under capture) aborts the step: retrying it gives what a session that
    never failed gives, and the failed bucket is traced again."""
    program = fresh_program("mistral")
    clean = Session(program, kind=kind, capacity=64, capture=capture)
    faulty = Session(program, kind=kind, capacity=64, capture=capture)
    ids = {}
    for session in (clean, faulty):
        ids[session] = session.cache.seq_new()
        session.forward(PROMPT[:9], seq_ids=ids[session])
    before = faulty.cache.pos(ids[faulty])

    real_attend = type(faulty.cache).attend
    calls = []

    def failing(self, layer, *args, **kwargs):
        calls.append(layer)
        if len(calls) == faulty.cache.n_layers:
            raise DeviceFault("simulated failure inside the step")
        return real_attend(self, layer, *args, **kwargs)

    monkeypatch.setattr(faulty.cache, "attend", failing.__get__(faulty.cache))
    chunk = PROMPT[9:12]  # a bucket (4) no run has compiled yet
    with pytest.raises(DeviceFault):
        faulty.forward(chunk, seq_ids=ids[faulty])
    assert not faulty.cache.is_declared
    assert (faulty.cache.pos(ids[faulty])) == before
    want = np.array(clean.forward(chunk, seq_ids=ids[clean]))
    got = np.array(faulty.forward(chunk, seq_ids=ids[faulty]))
    np.testing.assert_array_equal(got, want)
    want_next = np.array(clean.forward([int(np.argmax(want[-1]))], seq_ids=ids[clean]))
    got_next = np.array(faulty.forward([int(np.argmax(got[-1]))], seq_ids=ids[faulty]))
    np.testing.assert_array_equal(got_next, want_next)


def test_the_first_bucket_of_a_process_is_not_recompiled(tmp_path_factory, tiny_checkpoint):
    """MLX creates its default stream on first use and keys compiled graphs on it: in a
    fresh process whose first MLX work is a captured forward of an exact bucket size, the
    second forward of that bucket must not compile again."""
    path = exported_pte(tmp_path_factory, tiny_checkpoint, "llama")
    script = (
        "import sys\n"
        "from mlx_pte.interpreter.program import load\n"
        "from mlx_pte.interpreter.session import Session\n"
        "session = Session(load(sys.argv[1]), capture=True)\n"
        "session.forward([1, 2, 3, 4])\n"
        "first = session.program.compilations\n"
        "session.forward([5, 6, 7, 8])\n"
        "print(first, session.program.compilations)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True)
    first, after = map(int, out.stdout.split())
    assert first > 0 and after == first


def test_int64_positions_are_fed_as_int32_with_the_same_logits(fresh_program):
    """An export declaring int64 positions (read only by rope and the cache op) gets them
    as int32 at the graph input, once, so no layer casts them; the values are unchanged."""
    program = fresh_program("llama")
    names = [program.graph.slots[s].name for s in program.graph.inputs]
    declared = {n: t.dtype for n, t in zip(names, program.input_types)}
    assert declared["positions"] == "int64"
    ids, positions, rows = np.array([PROMPT[:4]]), np.arange(4, dtype=np.int64), np.array([3])
    for inputs in ([ids, positions, rows], [mx.array(ids), mx.array(positions), mx.array(rows)]):
        bound = dict(zip(names, program._bind_inputs(inputs)))
        assert bound["positions"].dtype == mx.int32
        assert [bound[n].dtype for n in names if n != "positions"] == [mx.int64] * (len(names) - 1)
    walked = Session(program, kind="single", capacity=64).forward(PROMPT[:4])
    # The same graph with its positions fed at the declared int64 (the narrowing off).
    program._int32_inputs = frozenset()
    wide = Session(program, kind="single", capacity=64).forward(PROMPT[:4])
    np.testing.assert_array_equal(np.array(walked), np.array(wide))
