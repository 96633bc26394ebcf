"""`mlx-pte export/run/bench` from the user's side: results on good input, one error line on bad."""
from __future__ import annotations

import pytest

from mlx_pte.cli import main

from tests.fixtures.exported import exported_pte


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


@pytest.mark.parametrize("flags, names", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--seed", "-1"], "--seed"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
])  # fmt: skip
def test_a_bad_flag_value_is_one_error_line_naming_the_flag(pte, capsys, flags, names):
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(pte), "--prompt", "hi", *flags])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert f"argument {names}:" in one_error_line(captured) and captured.out == ""


def test_max_new_tokens_is_refused_the_same_way_with_prompts(pte, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    with pytest.raises(SystemExit):
        main(["run", str(pte), "--prompts", str(prompts), "--max-new-tokens", "0"])
    assert "argument --max-new-tokens:" in one_error_line(capsys.readouterr())


def test_a_prompt_of_undecodable_bytes_is_one_error_line(pte, capsys):
    # How Python hands over argv bytes that are not UTF-8: as lone surrogates.
    assert main(["run", str(pte), "--prompt", b"\xff\xfe".decode("utf-8", "surrogateescape")]) == 1
    assert "--prompt is not valid UTF-8 text (it starts b'\\xff\\xfe')" in one_error_line(capsys.readouterr())


def test_a_jsonl_line_with_a_lone_surrogate_is_one_error_line(pte, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": "bad \\ud800"}\n')
    assert main(["run", str(pte), "--prompts", str(prompts)]) == 1
    assert f"{prompts}:2: the line holds a lone surrogate" in one_error_line(capsys.readouterr())


def test_a_tiny_temperature_is_greedy_without_warnings(pte, capsys):
    from mlx_pte.serving.sampling import params as sampling

    if not hasattr(sampling, "GREEDY_TEMPERATURE"):
        pytest.skip("the tiny-temperature rule of SamplingParams (issue 12, item 2) is not merged here")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy overflow warning fails the test
        assert main(["run", str(pte), "--prompt", "The", "--max-new-tokens", "4", "--temperature", "1e-320"]) == 0
    tiny = capsys.readouterr().out
    assert main(["run", str(pte), "--prompt", "The", "--max-new-tokens", "4"]) == 0
    assert tiny == capsys.readouterr().out  # the same text as greedy


@pytest.mark.parametrize("command, flags, name", [
    ("serve", ["--port", "99999"], "--port"),
    ("serve", ["--capacity", "0"], "--capacity"),
    ("serve", ["--max-seqs", "-2"], "--max-seqs"),
    ("serve", ["--prompt-cache-tokens", "-1"], "--prompt-cache-tokens"),
    ("serve", ["--cache", "paged"], "--cache"),
    ("bench", ["--repeats", "0"], "--repeats"),
    ("run", ["--prompt", "hi", "--max-batch-tokens", "0"], "--max-batch-tokens"),
])  # fmt: skip
def test_bad_engine_and_server_flags_are_one_error_line_naming_the_flag(pte, capsys, command, flags, name):
    with pytest.raises(SystemExit) as exit_:
        main([command, str(pte), *flags])
    assert exit_.value.code == 2
    assert f"argument {name}:" in one_error_line(capsys.readouterr())


def test_each_command_states_its_own_capacity_default(capsys):
    helps = {}
    for command in ("run", "serve", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helps[command] = " ".join(capsys.readouterr().out.split())
    assert "default: the model's max context with --prompt, 4 x it with --prompts" in helps["run"]
    assert "default: 4 x the model's max context" in helps["serve"]
    assert "(batched-sequence); default: the model's max context" in helps["bench"]


def test_inspect_into_a_closed_pipe_exits_quietly(pte):
    import subprocess
    import sys

    reader_gone = subprocess.Popen([sys.executable, "-m", "mlx_pte", "inspect", str(pte)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader_gone.stdout.close()  # as `| head` does once it has read enough (here: before any output)
    _, err = reader_gone.communicate(timeout=120)
    assert reader_gone.returncode == 141 and err == b"", err.decode()


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_a_fifo_as_the_model_is_refused_at_once(tmp_path, capsys, command):
    import os

    from tests.ir.test_fuzz import time_limit

    fifo = tmp_path / "model.pte"
    os.mkfifo(fifo)
    with time_limit(30):
        assert main([command, str(fifo), *(["--prompt", "hi"] if command == "run" else [])]) == 1
    assert "not a regular file" in one_error_line(capsys.readouterr())


def test_run_with_a_prefill_chunk_within_the_export_bound(pte, capsys):
    assert main(["run", str(pte), "--prompt", "The for statement " * 3, "--max-new-tokens", "3",
                 "--max-step", "4"]) == 0
    assert capsys.readouterr().out.startswith("The for statement")


def test_a_prefill_chunk_past_the_export_bound_is_one_error_line(pte, capsys):
    assert main(["run", str(pte), "--prompt", "hi", "--max-step", "33"]) == 1  # exported with 32
    assert "max_step must be an integer in [1, 32]" in one_error_line(capsys.readouterr())
