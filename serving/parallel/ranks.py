"""Running a command over several processes, tensor-parallel (``ir.sharding``).

Every rank runs the same command on its own shard and its own session: the same prompt,
the same steps (cache verbs, positions, sequence ids, rows), the same draws. Their logits
are the same bits (``all_sum`` gives every rank the same sum, and everything after it is
replicated), so their tokens agree without being sent; only a random seed is, once, from
rank 0. Rank 0 alone writes to stdout.

A process joins its group when a launcher started it (``mlx.launch``, ``mpirun``, or
``MLX_RANK`` + ``MLX_HOSTFILE`` set by hand); ``--tp N`` starts N local processes itself
over MLX's ring backend (``launch_local``), watches each one's exit status, and stops the
rest within ``STOP_BOUND_S`` when one fails. A rank that dies closes its connections, so
the others' next collective fails at once (the ring backend raises); ``lost_ranks`` turns
that failure into a ``RankLostError`` naming the rank.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

# How long ranks still running get, once one has failed, before they are killed.
STOP_BOUND_S = 10.0
# Environment variables by which a launcher hands a process its rank.
_LAUNCHED_BY = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# Prefixes MLX's backends put on a failed collective's message.
_BACKEND_ERRORS = ("[ring]", "[nccl]", "[mpi]", "[jaccl]")


class RankLostError(ConnectionError):
    """Another rank of the group stopped; this rank stops too (the message names the rank)."""


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tp", type=int, default=None, metavar="N",
        help="split the model over N local processes (tensor parallel, MLX's ring backend); "
        "under mlx.launch the launcher's group is used instead",
    )


def launched() -> bool:
    """Whether a launcher started this process as one rank of a group."""
    return any(name in os.environ for name in _LAUNCHED_BY)


def join_group() -> Any:
    """This process's ``mx.distributed`` group when launched as a rank (None otherwise); on
    a rank other than 0, stdout goes to /dev/null from here on."""
    if not launched():
        return None
    from mlx_pte.runtime.mlx.bootstrap import mx

    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as exc:
        raise RankLostError(f"could not join the process group ({exc}); check the hostfile and that every rank started") from None
    if group.rank() != 0:
        sys.stdout.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return group


def shared_seed(group: Any, seed: Optional[int]) -> Optional[int]:
    """``seed`` if given; else, with a group, rank 0's random seed (so every rank draws alike)."""
    if seed is not None or group is None or group.size() == 1:
        return seed
    import mlx.core as mx

    mine = int.from_bytes(os.urandom(3), "little") if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine, mx.int32), group=group).item())


@contextlib.contextmanager
def lost_ranks(group: Any) -> Iterator[None]:
    """Turn a collective that failed because a peer stopped into a ``RankLostError``."""
    try:
        yield
    except RuntimeError as exc:
        if group is None or not str(exc).startswith(_BACKEND_ERRORS):
            raise
        rank, size = group.rank(), group.size()
        who = f"rank {1 - rank}" if size == 2 else f"another of the {size} ranks"
        raise RankLostError(f"rank {rank}: {who} stopped ({exc}); every rank stops") from None


def write_local_hostfile(path: Path, n: int) -> Path:
    """A ring hostfile (MLX's JSON: one list of ``ip:port`` per rank) of ``n`` ranks on this
    host, on ports free right now."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return path


def without_tp(argv: Sequence[str]) -> list[str]:
    """``argv`` less its ``--tp N`` / ``--tp=N``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--tp":
            skip = True
        elif not a.startswith("--tp="):
            out.append(a)
    return out


def _describe(status: int) -> str:
    if status < 0:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        return f"was killed by {name}"
    return f"exited with status {status}"


def launch_local(n: int, argv: Sequence[str]) -> int:
    """Run ``mlx-pte ARGV`` as ``n`` local ranks over the ring backend and wait for them.

    Returns 0 when every rank exits 0; otherwise reports (on stderr) the first rank that
    failed, stops the others within ``STOP_BOUND_S`` and returns 1.
    """
    if n < 1:
        raise ValueError(f"--tp takes a positive number of processes, got {n}")
    with tempfile.TemporaryDirectory(prefix="mlx-pte-tp-") as tmp:
        hostfile = write_local_hostfile(Path(tmp) / "hosts.json", n)
        procs = []
        for rank in range(n):
            env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
            procs.append(subprocess.Popen([sys.executable, "-m", "mlx_pte", *argv], env=env))
        return _supervise(procs)


def _supervise(procs: list[subprocess.Popen]) -> int:
    failed: Optional[tuple[int, int]] = None
    deadline: Optional[float] = None
    try:
        while [p.poll() for p in procs].count(None):  # every rank polled, each time
            if failed is None:
                failed = next(((r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
                if failed is not None:
                    deadline = time.monotonic() + STOP_BOUND_S
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        raise
    for p in procs:
        p.wait()
    if failed is None:
        failed = next(((r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0), None)
    if failed is None:
        return 0
    rank, status = failed
    print(f"error: rank {rank} of {len(procs)} {_describe(status)}; every rank was stopped", file=sys.stderr)
    return 1
