"""`mlx-pte export/run/bench` from the user's side: results on good input, one error line on bad."""
from __future__ import annotations

import pytest

from mlx_pte.cli import main

from .conftest import exported_pte


@pytest.fixture(scope="module")
def pte(tmp_path_factory, tiny_checkpoint):
    return exported_pte(tmp_path_factory, tiny_checkpoint, "llama")


def one_error_line(captured) -> str:
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "Traceback" not in err[0]
    return err[0]


def test_run_prints_text_and_speed(pte, capsys):
    assert main(["run", str(pte), "--prompt", "The for statement", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("The for statement")
    assert "prefill:" in out.err and "decode:" in out.err and "tok/s" in out.err


def test_a_prompt_longer_than_capacity_is_one_error_line(pte, capsys):
    assert main(["run", str(pte), "--prompt", "word " * 60, "--capacity", "16"]) == 1
    captured = capsys.readouterr()
    assert "does not fit" in one_error_line(captured)
    assert captured.out == ""  # nothing echoed for a refused prompt


def test_run_on_a_file_that_is_not_a_pte_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "notes.pte"
    bad.write_text("not a program")
    assert main(["run", str(bad), "--prompt", "hi"]) == 1
    assert "not an ExecuTorch program" in one_error_line(capsys.readouterr())


@pytest.mark.parametrize("make", ["missing", "no_config"])
def test_export_of_a_bad_checkpoint_is_one_error_line(tmp_path, capsys, make):
    model_dir = tmp_path / "model"
    if make == "no_config":
        model_dir.mkdir()
    out = tmp_path / "out.pte"
    assert main(["export", str(model_dir), "-o", str(out), "--no-progress"]) == 1
    one_error_line(capsys.readouterr())
    assert not out.exists()


def test_bench_reports_speed_and_memory(pte, capsys):
    assert main(["bench", str(pte), "--prompt-tokens", "8", "--generate", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "peak memory" in out
