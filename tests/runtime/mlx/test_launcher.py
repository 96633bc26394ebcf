"""The launchers (runtime.mlx.launcher): what is launched is computed exactly (numpy is the
oracle), the host reads a chain of steps while later steps consuming them are encoded, an
encode failure reaches whoever waits, and threads that ran MLX end without aborting the
process."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from mlx_pte.runtime.mlx.bootstrap import mx
from mlx_pte.runtime.mlx.launcher import (
    INLINE,
    LaunchError,
    ThreadedLauncher,
    evaluate,
    launcher_for,
    threaded_launcher,
)
from tests.fixtures.exported import exported_pte


@pytest.fixture(scope="module")
def program_path(tmp_path_factory, tiny_checkpoint):
    return exported_pte(tmp_path_factory, tiny_checkpoint, "llama")


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_a_chain_of_steps_read_while_later_ones_are_encoded(mode):
    """Each step consumes the previous step's (unread) output, as a decode step consumes the
    last token; the host reads step n after launching step n+1."""
    launcher = launcher_for(mode)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16)).astype(np.float32) / 4
    x0 = rng.standard_normal((1, 16)).astype(np.float32)
    with launcher.building():
        weight = mx.array(w)
        state = mx.array(x0)
    expected, got = x0, []
    launched = None
    for _ in range(40):
        with launcher.building():
            state = mx.tanh(state @ weight)
        following = launcher.launch([state], readable=[state])
        if launched is not None:
            got.append(np.array(launched.read()))
        launched = following
    got.append(np.array(launched.read()))
    for value in got:
        expected = np.tanh(expected @ w)
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


def test_evaluate_while_building_goes_through_the_launcher():
    launcher = threaded_launcher()
    with launcher.building():
        total = mx.sum(mx.arange(10, dtype=mx.int32) * 3)
        evaluate([total])  # mx.eval here would be this thread encoding the launcher's stream
        assert total.item() == 135


def test_evaluate_outside_any_launcher_is_mx_eval():
    a = mx.arange(4) + 1
    evaluate([a])
    assert a.tolist() == [1, 2, 3, 4]


def test_an_encode_failure_reaches_the_waiter_and_the_launcher_goes_on():
    launcher = ThreadedLauncher()
    # Built outside building(): on this thread's stream, which the launcher cannot encode.
    stray = mx.arange(3) * 2
    failed = launcher.launch([stray], readable=[stray])
    with pytest.raises(LaunchError, match="the step failed to launch"):
        failed.read()
    with launcher.building():
        fine = mx.arange(3) * 2
    assert launcher.launch([fine], readable=[fine]).read().tolist() == [0, 2, 4]


def test_each_thread_builds_for_its_own_launcher_which_ends_with_it():
    def count() -> int:
        return sum(t.name == "mlx-pte-launcher" for t in threading.enumerate())

    mine = threaded_launcher()
    assert threaded_launcher() is mine
    before = count()
    seen = {}

    def worker() -> None:
        seen["launcher"] = threaded_launcher()
        with seen["launcher"].building():
            a = mx.ones(4) * 2
        seen["sum"] = seen["launcher"].launch([a], readable=[a]).read().sum().item()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["launcher"] is not mine and seen["sum"] == 8.0
    del seen["launcher"]
    # The worker's launcher went with the worker: its thread has ended.
    for t in [t for t in threading.enumerate() if t.name == "mlx-pte-launcher"]:
        t.join(timeout=0.2)
    assert count() == before


def test_inline_is_the_launcher_of_mode_inline():
    assert launcher_for("inline") is INLINE
    with pytest.raises(ValueError, match="launch mode must be one of inline, thread"):
        launcher_for("async")


ENDINGS = {
    # The engine's worker thread ends with stop(), just before the process does.
    "engine worker": """
        engine = Engine(program, "batched-sequence", capacity=200, launch="thread")
        engine.start()
        engine.warm_up()
        engine.submit(Request([5, 6, 7], max_tokens=4, ignore_eos=True)).result(timeout=60)
        engine.stop()
    """,
    # The main thread's launcher thread ends as the process does.
    "launcher thread": """
        generate(Session(program, capacity=64, launch="thread"), [1, 2, 3], 4)
    """,
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_process_whose_threads_ran_forwards_exits_cleanly(program_path, ending):
    """MLX frees a thread's compiled graphs when the thread ends, which needs the GIL: at
    interpreter shutdown that aborted the process (std::terminate, exit status 134) when a
    thread that had run a forward ended just before the process did."""
    script = textwrap.dedent(f"""
        from mlx_pte import Session, generate, load
        from mlx_pte.serving.engine import Engine, Request

        program = load({str(program_path)!r})
    """) + textwrap.dedent(ENDINGS[ending]) + "print('done')\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("done")
