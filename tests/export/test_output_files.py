"""Where and how an export writes its file: mode from the umask, a visible partial file that a
later export cleans up after a kill, directories as -o, and a missing directory refused."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest
import torch
from torch import nn

from mlx_pte.cli import main
from mlx_pte.export.errors import OutputPathError
from mlx_pte.export.program import PARTIAL_SUFFIX, export_module
from mlx_pte.interpreter.program import load


def export_linear(out):
    return export_module(nn.Linear(4, 2).eval(), (torch.randn(1, 4),), out)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_mode_is_0666_less_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        path = export_linear(tmp_path / "m.pte")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert load(path).run([torch.randn(1, 4).numpy()])[0].shape == (1, 2)


def test_a_killed_export_leaves_a_visible_partial_that_the_next_export_removes(tmp_path):
    out = tmp_path / "m.pte"
    # kill -9 at the worst moment: the whole temp file written, the rename not yet done.
    script = (
        "import os, signal, torch\n"
        "from torch import nn\n"
        "os.replace = lambda a, b: os.kill(os.getpid(), signal.SIGKILL)\n"
        "from mlx_pte.export.program import export_module\n"
        f"export_module(nn.Linear(4, 2).eval(), (torch.randn(1, 4),), {str(out)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    left = [p.name for p in tmp_path.iterdir()]
    assert not out.exists()
    assert len(left) == 1 and left[0].startswith("m.pte.") and left[0].endswith(PARTIAL_SUFFIX), left
    assert not left[0].startswith(".")  # the user sees it
    export_linear(out)
    assert [p.name for p in tmp_path.iterdir()] == ["m.pte"]
    live = tmp_path / f"m.pte.{os.getppid()}{PARTIAL_SUFFIX}"  # a writer still running is left alone
    other = tmp_path / f"other.pte.1{PARTIAL_SUFFIX}"  # another output's partial is not ours to judge
    live.write_bytes(b"in progress")
    other.write_bytes(b"another output's")
    export_linear(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.pte", live.name, other.name])


def test_the_written_file_replaces_the_old_one_whole(tmp_path):
    out = tmp_path / "m.pte"
    out.write_bytes(b"old")
    export_linear(out)
    assert load(out).run([torch.randn(1, 4).numpy()])[0].shape == (1, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["m.pte"]


def test_a_missing_directory_or_a_directory_target_is_refused(tmp_path):
    with pytest.raises(OutputPathError, match="does not exist; create it first"):
        export_linear(tmp_path / "no" / "such" / "m.pte")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutputPathError, match="is a directory"):
        export_linear(tmp_path)


def one_error_line(captured) -> str:
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_cli_missing_directory_is_one_error_line_before_any_work(tiny_checkpoint, tmp_path, capsys):
    checkpoint = tiny_checkpoint("llama")
    capsys.readouterr()  # building the checkpoint reports progress
    out = tmp_path / "missing" / "m.pte"
    assert main(["export", str(checkpoint), "-o", str(out), "--no-progress"]) == 1
    assert "missing does not exist" in one_error_line(capsys.readouterr())
    assert not (tmp_path / "missing").exists()
    assert main(["export", str(checkpoint), "-o", f"{tmp_path}/missing/", "--no-progress"]) == 1
    assert "does not exist" in one_error_line(capsys.readouterr())


@pytest.mark.parametrize("trailing_slash", [pytest.param(True, marks=pytest.mark.slow), False])  # an export each
def test_cli_directory_output_writes_model_name_pte_inside(tiny_checkpoint, tmp_path, capsys, trailing_slash):
    target = tmp_path / "out"
    target.mkdir()
    arg = f"{target}/" if trailing_slash else str(target)
    assert main(["export", str(tiny_checkpoint("llama")), "-o", arg, "--no-progress", "--max-step", "8"]) == 0
    written = target / "llama.pte"
    assert [p.name for p in target.iterdir()] == ["llama.pte"]
    assert f"wrote {written}" in capsys.readouterr().out
    assert load(written).manifest["max_step"] == 8
