"""``serve`` over a tensor-parallel group: rank 0 runs the tokenizer, the engine, sampling and
HTTP; every other rank follows rank 0's steps on its own session of its own shard.

Rank 0 sends each follower, over a TCP connection of its own (the step channel: one JSON
line a message), every cache verb that succeeded (``seq_new``, ``seq_rm``, ``seq_clone``,
``rewind``, ``clear``) and every forward's host-side plan (token count, positions,
sequence ids, rows) before the forward is queued. The token ids are not sent: the
sharded graph takes rank 0's from an ``all_sum`` (``ir.sharding``), so rank 0 queues a
step whose ids are still on the device (the engine's pipelining), and a follower feeds
zeros. Followers build their engine from the same command line, so their sessions are
configured alike; the same verbs in the same order give the same sequence ids.

Faults: a follower that dies closes its channel; rank 0 notices at once (a thread reads
every channel), reports the rank and exits 1. A follower whose channel closes without
rank 0's stop message exits 1 naming rank 0. Both ends beat every ``BEAT_S``, so a
stopped or hung peer (its connection open) is lost after ``SILENCE_S`` too. A collective that fails raises on the
ranks still alive (``ranks.lost_ranks``).

``run`` and ``bench`` (every rank runs the whole command) open the same channel only to
watch each other (``watched``): a collective waiting on a dead peer may never return
(MLX's queue of pending work blocks the caller), so liveness cannot rest on its error.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from .ranks import RankLostError

MIRRORED_VERBS = ("seq_new", "seq_rm", "seq_clone", "rewind", "clear")
# Both ends of a step channel send a beat this often; a peer silent for SILENCE_S (a stopped
# or hung process, whose connection stays open) counts as lost. MLX_PTE_TP_SILENCE_S sets
# it (seconds), e.g. for a model whose single step may take longer.
BEAT_S = 1.0
_FINISHED = b"!"  # a follower's last byte under ``watched``: it ended, it was not lost
SILENCE_S = float(os.environ.get("MLX_PTE_TP_SILENCE_S", 30.0))
CONNECT_TIMEOUT_S = 60.0
# Rank 0 waits this long after a follower is lost, so error responses reach their clients.
LOST_GRACE_S = 1.0


def _leader_host() -> str:
    """Rank 0's address: the first entry of a ring hostfile (``["ip:port"]`` per rank), else
    this host."""
    try:
        first = json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())[0]
        return str(first[0]).rsplit(":", 1)[0]
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return "127.0.0.1"


def _share_port(group: Any, port: int) -> int:
    import mlx.core as mx

    return int(mx.distributed.all_sum(mx.array(port if group.rank() == 0 else 0, mx.int32), group=group).item())


class StepChannel:
    """Rank 0's side: one connection per follower rank."""

    def __init__(self, conns: dict[int, socket.socket]) -> None:
        self.conns = conns
        self._lock = threading.Lock()
        self.closing = False  # a channel closed after the stop message is no lost rank
        self.finished: set[int] = set()  # followers that said they ended (``watched``)

    @classmethod
    def accept(cls, group: Any) -> "StepChannel":
        server = socket.create_server(("0.0.0.0", 0))
        server.settimeout(CONNECT_TIMEOUT_S)
        _share_port(group, server.getsockname()[1])
        conns: dict[int, socket.socket] = {}
        try:
            while len(conns) < group.size() - 1:
                conn, _ = server.accept()
                rank = int(conn.makefile("r").readline())
                conn.settimeout(None)
                conns[rank] = conn
        except (OSError, ValueError) as exc:
            missing = sorted(set(range(1, group.size())) - set(conns))
            raise RankLostError(f"rank 0: ranks {missing} did not open their step channel ({exc})") from None
        finally:
            server.close()
        return cls(conns)

    def send(self, message: dict) -> None:
        line = (json.dumps(message) + "\n").encode()
        with self._lock:
            for rank, conn in self.conns.items():
                if rank in self.finished:
                    continue
                try:
                    conn.sendall(line)
                except OSError as exc:
                    raise RankLostError(f"rank 0: rank {rank} stopped (its step channel: {exc}); every rank stops") from None

    def watch(self, on_lost: Callable[[int, str], None]) -> None:
        """Beat to every follower, and call ``on_lost(rank, why)`` (on a thread of its own)
        when a follower's channel closes or it is silent for ``SILENCE_S``."""
        heard = {rank: time.monotonic() for rank in self.conns}
        for rank, conn in self.conns.items():
            def read(rank: int = rank, conn: socket.socket = conn) -> None:
                try:
                    while byte := conn.recv(1):
                        heard[rank] = time.monotonic()
                        if byte == _FINISHED:
                            self.finished.add(rank)
                            heard.pop(rank, None)
                            return
                except OSError:
                    pass
                if not self.closing:
                    on_lost(rank, "its step channel closed")

            threading.Thread(target=read, name=f"tp-watch-{rank}", daemon=True).start()

        def beat() -> None:
            while not self.closing:
                try:
                    self.send({"verb": "beat"})
                except RankLostError:
                    return  # its reader reports it
                for rank, when in list(heard.items()):
                    if time.monotonic() - when > SILENCE_S and not self.closing:
                        on_lost(rank, f"silent for {SILENCE_S:g} s")
                time.sleep(BEAT_S)

        threading.Thread(target=beat, name="tp-beat", daemon=True).start()

    def close(self) -> None:
        self.closing = True
        try:
            self.send({"verb": "stop"})
        except RankLostError:
            pass
        for conn in self.conns.values():
            conn.close()


def _ints(value: Any) -> Any:
    if value is None or isinstance(value, (int, np.integer)):
        return None if value is None else int(value)
    return np.asarray(value).astype(np.int64).tolist()


def lead(engine: Any, channel: StepChannel) -> None:
    """Mirror ``engine``'s cache verbs and forwards to the followers.

    The engine's own objects are wrapped in place (its cache face, its session's forward,
    the prompt store's release callback, which holds the cache's ``seq_rm``), so the
    engine itself needs no tensor-parallel code.
    """
    cache, session = engine.cache, engine.session
    for name in MIRRORED_VERBS:
        setattr(cache, name, _mirrored(name, getattr(cache, name), channel))
    engine.prompt_store._release = cache.seq_rm
    forward = session.forward

    def mirrored_forward(tokens: Any, positions: Any = None, seq_ids: Any = None, rows: Any = None,
                         evaluate: bool = True) -> Any:
        count = int(tokens.size) if hasattr(tokens, "size") and not isinstance(tokens, list) else len(tokens)
        channel.send({"verb": "forward", "count": count, "positions": _ints(positions),
                      "seq_ids": _ints(seq_ids), "rows": _ints(rows)})
        return forward(tokens, positions, seq_ids, rows, evaluate=evaluate)

    session.forward = mirrored_forward


def _mirrored(name: str, verb: Callable[..., Any], channel: StepChannel) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        result = verb(*args)  # a refused verb raises here and is not sent
        channel.send({"verb": name, "args": [int(a) for a in args], "result": result})
        return result

    return call


def follow(session: Any, group: Any, host: Optional[str] = None) -> int:
    """Follow rank 0's steps on ``session`` until rank 0 says stop (returns 0).

    Raises:
        RankLostError: rank 0's channel closed without a stop, or this rank's cache
            disagrees with rank 0's (the ranks no longer hold the same sequences).
    """
    from mlx_pte.interpreter.session import SessionError
    from mlx_pte.runtime.cache import CacheError

    rank = group.rank()
    conn = _connect(group, host)
    for message in _messages(conn, rank):
        verb = message["verb"]
        if verb == "stop":
            return 0
        if verb == "forward":
            try:
                session.forward(np.zeros(message["count"], np.int64), message["positions"], message["seq_ids"],
                                message["rows"], evaluate=True)
            except (CacheError, SessionError):
                pass  # rank 0 was refused the same step, before its graph ran
            continue
        result = getattr(session.cache, verb)(*message["args"])
        if result != message["result"]:
            raise RankLostError(f"rank {rank}: {verb} gave {result!r}, rank 0's gave {message['result']!r}; "
                                "the ranks' caches disagree, every rank stops")
    raise RankLostError(f"rank {rank}: rank 0 stopped (its step channel closed); every rank stops")


def _connect(group: Any, host: Optional[str]) -> socket.socket:
    """A follower's end of the step channel, announced with its rank."""
    port = _share_port(group, 0)
    conn = socket.create_connection((host or _leader_host(), port), timeout=CONNECT_TIMEOUT_S)
    conn.settimeout(None)
    conn.sendall(f"{group.rank()}\n".encode())
    return conn


def _messages(conn: socket.socket, rank: int) -> Iterator[dict]:
    """Rank 0's messages, beats left out. Threads read the channel and beat back, so a
    follower busy in a step still hears rank 0; one silent for ``SILENCE_S`` stops this
    process (exit 1)."""
    inbox: queue.Queue = queue.Queue()
    heard = [time.monotonic()]
    done = threading.Event()

    def read() -> None:
        try:
            for line in conn.makefile("r"):
                heard[0] = time.monotonic()
                message = json.loads(line)
                if message["verb"] != "beat":
                    inbox.put(message)
        except (OSError, ValueError):
            pass
        inbox.put(None)

    def beat() -> None:
        while not done.is_set():
            if time.monotonic() - heard[0] > SILENCE_S:
                print(f"error: rank {rank}: rank 0 silent for {SILENCE_S:g} s; every rank stops", file=sys.stderr,
                      flush=True)
                os._exit(1)
            try:
                conn.sendall(b".")
            except OSError:
                return
            time.sleep(BEAT_S)

    threading.Thread(target=read, name="tp-read", daemon=True).start()
    threading.Thread(target=beat, name="tp-beat", daemon=True).start()
    try:
        while (message := inbox.get()) is not None:
            yield message
    finally:
        done.set()


def serve_ranks(group: Any, open_engine: Callable[..., Any], serve: Callable[[Any], None]) -> int:
    """Run ``serve(engine)`` on rank 0 (the HTTP server, or ``run --prompts``' file) with
    every other rank following it; ``open_engine(group)`` builds each rank's engine."""
    engine = open_engine(group)
    if group.rank() != 0:
        return follow(engine.session, group)
    channel = StepChannel.accept(group)
    lead(engine, channel)

    def lost(rank: int, why: str) -> None:
        print(f"error: rank 0: rank {rank} stopped ({why}); every rank stops", file=sys.stderr, flush=True)
        time.sleep(LOST_GRACE_S)
        os._exit(1)

    channel.watch(lost)
    try:
        serve(engine)
    finally:
        channel.close()
    return 0


def _stop_all(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


@contextlib.contextmanager
def watched(group: Any, host: Optional[str] = None) -> Iterator[None]:
    """Run the body on every rank of ``group`` while each watches the others: a rank that
    dies (or is silent for ``SILENCE_S``) makes rank 0, and rank 0's end makes every
    follower, print an error naming the rank and exit 1 at once, even from inside a
    collective that will never return. No-op without a group of several ranks."""
    if group is None or group.size() == 1:
        yield
        return
    rank = group.rank()
    if rank == 0:
        channel = StepChannel.accept(group)
        channel.watch(lambda lost, why: _stop_all(f"error: rank 0: rank {lost} stopped ({why}); every rank stops"))
        try:
            yield
        finally:
            channel.close()
        return
    conn = _connect(group, host)
    ending = threading.Event()

    def listen() -> None:
        for message in _messages(conn, rank):
            if message["verb"] == "stop":
                return
        if not ending.is_set():
            _stop_all(f"error: rank {rank}: rank 0 stopped (its step channel closed); every rank stops")

    threading.Thread(target=listen, name="tp-listen", daemon=True).start()
    try:
        yield
    finally:
        ending.set()
        with contextlib.suppress(OSError):
            conn.sendall(_FINISHED)
        conn.close()
