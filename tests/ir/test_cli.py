"""``mlx-pte inspect``, in process and as the installed command."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlx_pte.cli import main

from .sample import TOKENIZER


def test_inspect(pte_files, capsys):
    f = pte_files["segment"]
    assert main(["inspect", str(f.path)]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    for op, count in f.sample.op_counts.items():
        assert [op, str(count)] in lines
    assert "graph: 12 slots (4 inputs, 3 constants, 5 temps), 5 instructions" in out
    assert "weights: 3 constants, 82 bytes" in out  # 4x4 + 4 float32, 1 float16
    for row in (["x", "float32[1,", "2,", "T,", "4]"], ["positions", "int64[T]"], ["n", "int"], ["rows", "int64[R]"],
                ["T", "[1,", "16]"], ["R", "[1,", "unbounded)"],
                ["cache_id", "window", "n_kv_heads", "head_dim", "v_head_dim"], ["0", "0", "2", "4", "4"]):  # fmt: skip
        assert row in lines, row
    assert TOKENIZER not in out
    assert f'"tokenizer": "<tokenizer.json: {len(TOKENIZER):,} characters>"' in out
    assert '"max_context": 64' in out


def test_inspect_errors_are_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.pte")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "missing.pte" in err
    bad = tmp_path / "bad.pte"
    bad.write_bytes(b"not a program at all")
    assert main(["inspect", str(bad)]) == 1
    assert capsys.readouterr().err == f"error: {bad}: not an ExecuTorch program (no ET file identifier at byte 4)\n"


def test_installed_command(pte_files):
    f = pte_files["inline"]
    script = Path(sys.executable).parent / "mlx-pte"
    done = subprocess.run([str(script), "inspect", str(f.path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ["update_and_attend", "1"] in [line.split() for line in done.stdout.splitlines()]
    done = subprocess.run([str(script), "inspect", str(f.path) + ".nope"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr
