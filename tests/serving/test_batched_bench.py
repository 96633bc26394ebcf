"""bench/batched.py end to end on the tiny model (its speed is not checked here: that is the
bench's job on a real device)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.exported import exported_pte

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_batched_bench_warms_interleaves_and_reports_both_kinds(tmp_path_factory, tiny_checkpoint):
    pte = exported_pte(tmp_path_factory, tiny_checkpoint, "llama")
    argv = [sys.executable, "bench/batched.py", str(tiny_checkpoint("llama")), "--pte", str(pte),
            "--batches", "1,3", "--rounds", "2", "--prompt", "5", "--generate", "4",
            "--kinds", "batched-sequence,batched-cell"]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "batched-sequence: warmed up in" in text and "batched-cell: warmed up in" in text
    assert "medians of 2 interleaved rounds" in text
    decode = text.split("decode tok/s\n")[1].splitlines()
    assert decode[0].split()[-3:] == ["seq/lm", "cell/lm", "seq/cell"]
    assert [line.split()[0] for line in decode[1:3]] == ["1", "3"]
    overhead = text.split("engine overhead")[1].splitlines()[2:6]
    for line in overhead:  # B, kind, then three ms figures, all measured
        fields = line.split()
        assert fields[1] in ("seq", "cell") and all(float(f) > 0 for f in fields[2:])


def test_the_batched_bench_refuses_an_unknown_kind():
    out = subprocess.run([sys.executable, "bench/batched.py", "/nonexistent", "--kinds", "batched-sequence,cells"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "unknown --kinds cells" in out.stderr
