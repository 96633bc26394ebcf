"""Damaged .pte files: every truncation and byte flip is refused with FormatError or,
where it hits bytes the reader does not depend on, reads back the same program."""
from __future__ import annotations

import random
import signal
from contextlib import contextmanager

import pytest

from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.payload import decode_payload
from mlx_pte.ir.pte import delegate_payload


@contextmanager
def time_limit(seconds: int):
    """Turn a hang into a test failure."""

    def fail(signum, frame):
        raise TimeoutError(f"reading damaged files took more than {seconds}s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def read(data: bytes):
    try:
        return decode_payload(delegate_payload(data))
    except FormatError:
        return None


@pytest.mark.parametrize("kind", ["segment", "inline"])
def test_truncations_are_refused(pte_files, kind):
    data = pte_files[kind].data
    rng = random.Random(kind)
    with time_limit(60):
        for n in [0, 1, 8, 16, len(data) - 1] + [rng.randrange(len(data)) for _ in range(150)]:
            with pytest.raises(FormatError):
                decode_payload(delegate_payload(data[:n]))


@pytest.mark.parametrize("kind", ["segment", "inline"])
def test_byte_flips_are_refused_or_harmless(pte_files, kind):
    f = pte_files[kind]
    rng = random.Random(kind)
    refused = 0
    with time_limit(60):
        for trial in range(300):
            data = bytearray(f.data)
            for _ in range(1 if trial % 3 else 4):
                data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            p = read(bytes(data))
            if p is None:
                refused += 1
                continue
            # Not refused: the damage missed everything the program depends on but weights.
            assert p.graph == f.sample.graph and p.manifest == f.sample.manifest
            assert {s: (c.offset, c.nbytes) for s, c in p.constants.items()} == {
                s: (c.offset, c.nbytes) for s, c in decode_payload(f.payload).constants.items()
            }
    assert refused >= 100
