"""Tensor parallelism over two processes on the ring backend (each process's exit status
checked): a sharded program against the whole one, the command line under ``--tp 2``, and
a follower killed mid-generation."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter.program import load
from mlx_pte.ir.quantization import QuantSpec
from mlx_pte.ir.pte import read_pte
from mlx_pte.ir.sharding import ShardingError, linear_roles
from mlx_pte.serving.parallel.ranks import STOP_BOUND_S, write_local_hostfile
from tests.fixtures.exported import MAX_STEP, exported_pte

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tp_worker.py")
START_S = 60  # generous: two interpreters importing MLX on a loaded 2-core machine


def _env(rank: int, hostfile: Path) -> dict[str, str]:
    return dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile), PYTHONPATH=str(ROOT))


def _two_ranks(tmp_path: Path, commands: list[list[str]], timeout: float) -> list[subprocess.CompletedProcess]:
    """Run ``commands[r]`` as rank r of a local ring; each one's own status and output."""
    hostfile = write_local_hostfile(tmp_path / "hosts.json", len(commands))
    procs = [subprocess.Popen(cmd, env=_env(r, hostfile), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r, cmd in enumerate(commands)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


@pytest.fixture(scope="module")
def variants(tmp_path_factory, tiny_checkpoint) -> list[Path]:
    """A q8 llama (fused projections, as exports are by default) and one with separate ones."""
    root = tmp_path_factory.mktemp("tp")
    export_hf(tiny_checkpoint("llama"), root / "q8.pte", max_step=MAX_STEP, progress=False,
              quantize=QuantSpec.from_preset("q8", group_size=32))
    export_hf(tiny_checkpoint("llama"), root / "separate.pte", max_step=MAX_STEP, progress=False,
              fused_projections=False)
    return [root / "q8.pte", root / "separate.pte"]


# The two-rank run over every variant (~21 s with the two exports it adds) is the slow tier's;
# the fast tier checks two ranks against one process through `run --tp 2` below.
@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path, tmp_path_factory, tiny_checkpoint, variants):
    """Greedy tokens equal, logits within 1e-5, for every cache kind, capture off and on:
    llama (fp32), gemma3 (sliding window, run past it), a q8 llama (whole groups per rank)
    with fused q/k/v and gate/up projections (each part split, padding included), and a
    llama with separate projections."""
    paths = [str(exported_pte(tmp_path_factory, tiny_checkpoint, f)) for f in ("llama", "gemma3")]
    paths += [str(p) for p in variants]
    ranks = _two_ranks(tmp_path, [[sys.executable, str(WORKER), *paths]] * 2, timeout=600)
    for r, done in enumerate(ranks):
        assert done.returncode == 0, f"rank {r}: {done.stdout}{done.stderr[-2000:]}"
        assert f"rank {r}: 0 failures" in done.stdout


@dataclass
class _FakeGroup:
    """Only what sharding reads of a group: no collective runs before the plan is checked."""

    rank_: int
    size_: int

    def rank(self) -> int:
        return self.rank_

    def size(self) -> int:
        return self.size_


def test_ranks_that_do_not_divide_the_kv_heads_are_refused(tmp_path_factory, tiny_checkpoint):
    path = exported_pte(tmp_path_factory, tiny_checkpoint, "llama")
    with pytest.raises(ShardingError, match="4 ranks do not divide the 2 KV heads of cache layer 0"):
        load(path, group=_FakeGroup(0, 4))


def test_a_file_without_a_plan_splits_by_hf_module_names(tmp_path_factory, tiny_checkpoint):
    payload = read_pte(exported_pte(tmp_path_factory, tiny_checkpoint, "qwen3"))
    recorded = linear_roles(payload.graph, payload.manifest)
    older = linear_roles(payload.graph, {**payload.manifest, "extra": {}})
    assert older == recorded
    names = {payload.graph.slots[payload.graph.instructions[i].inputs[1]].name.split(".")[-2]: style
             for i, style in recorded.items()}
    # Exports fuse q/k/v and gate/up (ir/fuse_projections.py); HF's plan names them apart.
    assert names == {"qkv_proj": "colwise", "o_proj": "rowwise", "gate_up_proj": "colwise", "down_proj": "rowwise"}


@pytest.mark.slow  # needs the separate-projections export of `variants`
def test_a_plan_splitting_a_linear_another_way_is_refused(variants):
    payload = read_pte(variants[1])  # separate projections: q_proj is a linear of its own
    plan = {**payload.manifest["extra"]["tp_plan"], "layers.*.self_attn.q_proj": "local_colwise"}
    with pytest.raises(ShardingError, match="splits 'layers.\\*.self_attn.q_proj' as 'local_colwise'"):
        linear_roles(payload.graph, {**payload.manifest, "extra": {"tp_plan": plan}})


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlx_pte", *args]


def test_run_with_tp_prints_the_single_process_text(tmp_path_factory, tiny_checkpoint):
    path = str(exported_pte(tmp_path_factory, tiny_checkpoint, "llama"))
    args = ["run", path, "--prompt", "def f(x):", "--max-new-tokens", "16"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    one = subprocess.run(_cli(*args), env=env, capture_output=True, text=True, timeout=START_S)
    two = subprocess.run(_cli(*args, "--tp", "2"), env=env, capture_output=True, text=True, timeout=2 * START_S)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.startswith("def f(x):")


def test_bench_with_tp_reports_the_bytes_each_rank_sums(tmp_path_factory, tiny_checkpoint):
    path = exported_pte(tmp_path_factory, tiny_checkpoint, "llama")
    config = load(path).manifest["config"]
    # Two fp32 hidden vectors per layer (after o_proj and down_proj), and one int32 token id.
    want = 2 * config["num_hidden_layers"] * config["hidden_size"] * 4 + 4
    done = subprocess.run(_cli("bench", str(path), "--prompt-tokens", "8", "--generate", "4", "--repeats", "1",
                               "--tp", "2"), env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=2 * START_S)
    assert done.returncode == 0, done.stderr
    assert f"each all-sums {want:,} bytes per token" in done.stdout


def test_run_prompts_with_tp_prints_the_single_process_replies(tmp_path, tmp_path_factory, tiny_checkpoint):
    """``--prompts`` runs the batching engine: rank 0 leads, rank 1 replays its steps."""
    path = str(exported_pte(tmp_path_factory, tiny_checkpoint, "llama"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nThe class\nimport os\n")
    args = ["run", path, "--prompts", str(prompts), "--max-new-tokens", "10", "--temperature", "0"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    one, two = (subprocess.run(_cli(*args, *extra), env=env, capture_output=True, text=True, timeout=2 * START_S)
                for extra in ([], ["--tp", "2"]))
    assert one.returncode == 0 and two.returncode == 0, two.stderr

    def replies(out: str) -> list[str]:  # less the closing line of timings
        return [line for line in out.splitlines() if not line.startswith("=== ")]

    assert replies(two.stdout) == replies(one.stdout) and len(replies(one.stdout)) == 6


# A rank running the real command line, with a forward that kills its own process on the 6th step.
_DYING_RANK = textwrap.dedent("""
    import os, signal, sys
    from mlx_pte.interpreter.session import Session
    forward, calls = Session.forward, []
    def dying(self, *a, **k):
        calls.append(1)
        if len(calls) == 6:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(self, *a, **k)
    Session.forward = dying
    from mlx_pte.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_killed_follower_stops_rank_0_with_an_error_naming_it(tmp_path, tmp_path_factory, tiny_checkpoint):
    path = str(exported_pte(tmp_path_factory, tiny_checkpoint, "llama"))
    args = ["run", path, "--prompt", "def f(x):", "--max-new-tokens", "200"]
    started = time.monotonic()
    leader, follower = _two_ranks(tmp_path, [_cli(*args), [sys.executable, "-c", _DYING_RANK, *args]],
                                  timeout=START_S + STOP_BOUND_S)
    assert follower.returncode == -9
    assert leader.returncode == 1, leader.stderr
    assert "error: rank 0: rank 1 stopped" in leader.stderr
    assert time.monotonic() - started < START_S + STOP_BOUND_S


@pytest.mark.parametrize("command", ["run", "bench"])
def test_a_killed_rank_0_stops_its_follower_with_an_error_naming_it(tmp_path, tmp_path_factory, tiny_checkpoint,
                                                                     command):
    path = str(exported_pte(tmp_path_factory, tiny_checkpoint, "llama"))
    args = ([command, path, "--prompt", "def f(x):", "--max-new-tokens", "200"] if command == "run"
            else [command, path, "--prompt-tokens", "8", "--generate", "100", "--repeats", "3"])
    started = time.monotonic()
    leader, follower = _two_ranks(tmp_path, [[sys.executable, "-c", _DYING_RANK, *args], _cli(*args)],
                                  timeout=START_S + STOP_BOUND_S)
    assert leader.returncode == -9
    assert follower.returncode == 1, follower.stderr
    assert "error: rank 1: rank 0 stopped" in follower.stderr
    assert time.monotonic() - started < START_S + STOP_BOUND_S
