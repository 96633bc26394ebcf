"""One engine of a benchmark in a process of its own, timed in the parent's rounds.

MLX reads some settings once per process (``MLX_USE_CUDA_GRAPHS``, ``MLX_MAX_OPS_PER_BUFFER``):
to time mlx-pte under a setting against mlx-lm under MLX's defaults, the two cannot share
a process. The parent starts the child with the environment it should have; the child
builds its runner (warm-up included), says it is ready, then answers each ``run`` line on
its stdin with one run's rates. Protocol lines carry a prefix, so whatever else the child
prints (warnings, progress) passes through to the parent's stderr.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Callable, Mapping, Sequence

from decode_table import Rates

PREFIX = "@@peer "


class PeerProcess:
    """A ``Runner`` (one timed run -> Rates) backed by a child process.

    Args:
        argv: the child's arguments after the interpreter; the child must call ``serve``.
        env: the child's whole environment.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self._child = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=dict(env))
        self._reply("ready")

    def __call__(self) -> Rates:
        assert self._child.stdin is not None
        self._child.stdin.write("run\n")
        self._child.stdin.flush()
        return Rates(**json.loads(self._reply("rates")))

    def close(self) -> None:
        if self._child.poll() is None:
            assert self._child.stdin is not None
            self._child.stdin.close()  # the child's loop ends at end of input
            self._child.wait(timeout=60)

    def _reply(self, kind: str) -> str:
        """The payload of the child's next protocol line, which must be of ``kind``."""
        assert self._child.stdout is not None
        for line in self._child.stdout:
            if line.startswith(PREFIX):
                got, _, payload = line[len(PREFIX):].rstrip("\n").partition(" ")
                if got != kind:
                    raise RuntimeError(f"peer process: expected {kind!r}, got {got!r}")
                return payload
            sys.stderr.write(line)
        raise RuntimeError(f"peer process {self._child.args!r} ended (exit code {self._child.wait()}) "
                           f"before its {kind!r} line; its output above says why")


def serve(make_runner: Callable[[], Callable[[], Rates]]) -> None:
    """The child's side: build the runner, then time one run per ``run`` line on stdin."""
    run = make_runner()
    print(PREFIX + "ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            raise SystemExit(f"error: peer process: unknown request {line.strip()!r}")
        print(PREFIX + "rates " + json.dumps(dataclasses.asdict(run())), flush=True)
