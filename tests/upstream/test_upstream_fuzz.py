"""Damaged upstream MLX programs, full precision and quantized (packed weights, the folded
init chain): every truncation and byte flip is refused with one FormatError or, where it
misses what the importer checks, still imports; nothing else."""
from __future__ import annotations

import random

import pytest

from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.pte import decode_program, delegate_payload
from tests.ir.test_fuzz import time_limit


@pytest.fixture(scope="module", params=["fp32", "fp32-4w"])
def upstream_bytes(upstream_pte, request) -> bytes:
    return upstream_pte("llama", request.param).read_bytes()


def test_the_undamaged_file_imports(upstream_bytes):
    assert decode_program(upstream_bytes).graph.instructions


def test_truncations_are_refused(upstream_bytes):
    data = upstream_bytes
    rng = random.Random(0)
    with time_limit(120):
        for n in [0, 1, 8, 16, 100, len(data) - 1] + [rng.randrange(len(data)) for _ in range(100)]:
            with pytest.raises(FormatError):
                decode_program(data[:n])


def test_byte_flips_are_refused_or_import(upstream_bytes):
    data = upstream_bytes
    payload = bytes(delegate_payload(data))
    start = data.find(payload)
    assert start > 0
    rng = random.Random(1)
    refused = 0
    with time_limit(300):
        for trial in range(300):
            damaged = bytearray(data)
            for _ in range(1 if trial % 3 else 4):
                # Two flips in three hit the delegate payload (graph and header), the rest anywhere.
                at = start + rng.randrange(len(payload)) if trial % 3 != 2 else rng.randrange(len(data))
                damaged[at] ^= rng.randrange(1, 256)
            try:
                decode_program(bytes(damaged))
            except FormatError as exc:
                assert str(exc)
                refused += 1
    assert refused >= 50
