"""Launching a step's lazy graph: encoded inline, or on a thread of its own.

MLX encodes every primitive of an evaluation on the thread that calls ``eval`` or
``async_eval``. A decode step is host-bound: building its lazy graph (Python) and encoding
it (MLX's C++, which runs without the GIL) each take about as long as the device takes to
run it. ``ThreadedLauncher`` overlaps the two: the host builds step n+1 and launches it;
the launcher's thread encodes it while the host reads step n's tokens and builds step n+2.
``InlineLauncher`` encodes on the calling thread (``async_eval``), as MLX does by itself.
Both take the same calls, so a decode loop is written once:

    with launcher.building():
        ids = draw(session.forward(...))
    launched = launcher.launch([ids], readable=[ids])
    ...                                  # build the next step from ``ids``, launch it
    tokens = launched.read().tolist()    # waits for the device

MLX's streams belong to the thread that made them (a stream's command encoder is
thread-local), which sets the rules a threaded launcher keeps:

- Steps are built inside ``building()``, where the launcher's stream is the default:
  everything made there is encoded by the launcher's thread, through ``launch``.
- The host reads a launched array only through ``Launched.read``: a copy made in the same
  launch that no later graph consumes. The original feeds later steps, and the launcher
  edits its bookkeeping (events, inputs) while it encodes those.
- Code that must wait for a value while building (a cache fork's copies, a forward asked
  to evaluate) calls ``evaluate`` instead of ``mx.eval``: it goes through the launcher.
- One thread builds for a launcher: ``threaded_launcher()`` gives each thread its own, with
  its own stream, as MLX gives each thread its own compile cache.
"""
from __future__ import annotations

import queue
import threading
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import ContextManager, Iterator, Optional, Protocol, Sequence

from mlx_pte.runtime.launch_modes import LAUNCH_MODES

from .bootstrap import mx


class LaunchError(RuntimeError):
    """MLX failed to encode a launched step (the original error is its cause)."""


@dataclass
class Launched:
    """A launched graph: ``wait`` until it is encoded, ``read`` the host's copies."""

    arrays: list[mx.array]
    copies: list[mx.array]
    _done: threading.Event = field(default_factory=threading.Event)
    _error: Optional[BaseException] = None

    def wait(self) -> None:
        """Block until this launch is encoded (not computed).

        Raises:
            LaunchError: MLX failed to encode it.
        """
        self._done.wait()
        if self._error is not None:
            raise LaunchError(f"the step failed to launch: {self._error}") from self._error

    def read(self, index: int = 0) -> mx.array:
        """The host's copy of the ``index``-th readable array, once encoded: evaluating it
        (``item``, ``tolist``) waits for the device only.

        Raises:
            LaunchError: MLX failed to encode the launch.
        """
        self.wait()
        return self.copies[index]


class Launcher(Protocol):
    """Where a step's graph is built and how it is handed to MLX (see the module)."""

    def building(self) -> ContextManager[None]: ...

    def launch(self, arrays: Sequence[mx.array], readable: Sequence[mx.array] = ()) -> Launched: ...

    def evaluate(self, arrays: Sequence[mx.array]) -> None: ...


# The launcher the calling thread builds for (inside ``ThreadedLauncher.building``), if any.
_BUILDING_FOR: ContextVar[Optional["ThreadedLauncher"]] = ContextVar("mlx_pte_building_for", default=None)


def evaluate(arrays: Sequence[mx.array]) -> None:
    """``mx.eval(arrays)``, through the launcher the calling thread is building for, if any:
    code that must wait for a value calls this, and so works under either launcher."""
    launcher = _BUILDING_FOR.get()
    if launcher is None:
        mx.eval(list(arrays))
    else:
        launcher.evaluate(arrays)


class InlineLauncher:
    """Encodes on the calling thread (``mx.async_eval``): MLX's own way."""

    @contextmanager
    def building(self) -> Iterator[None]:
        yield

    def launch(self, arrays: Sequence[mx.array], readable: Sequence[mx.array] = ()) -> Launched:
        """Encode ``arrays`` now; ``readable`` are read as they are (no other thread
        touches them). A failure to encode is raised by the launch's ``wait``/``read``,
        as the threaded launcher's is."""
        launched = Launched(list(arrays), list(readable))
        try:
            mx.async_eval(launched.arrays)
        except Exception as exc:
            launched._error = exc
        launched._done.set()
        return launched

    def evaluate(self, arrays: Sequence[mx.array]) -> None:
        mx.eval(list(arrays))


INLINE = InlineLauncher()


def _serve(inbox: "queue.SimpleQueue[Optional[Launched]]", streams: list, made: threading.Event) -> None:
    """The launcher thread's loop; it holds no reference to its ``ThreadedLauncher``, so
    that one is collected (and ends this loop) when its building thread lets it go."""
    try:
        # Made on this thread: only this thread can encode it.
        streams.append(mx.new_stream(mx.default_device()))
    finally:
        made.set()
    if not streams:
        return
    try:
        while (launched := inbox.get()) is not None:
            try:
                mx.async_eval(launched.arrays, launched.copies)
            except Exception as exc:  # handed to whoever waits on the launch
                launched._error = exc
            launched._done.set()
            del launched  # the graph goes as soon as it is encoded, not at the next launch
    finally:
        mx.synchronize(streams[0])  # what it encoded has run before its stream goes
        release_thread_state()


def release_thread_state() -> None:
    """Free the calling thread's MLX state (its streams and compiled graphs) while it still
    holds the GIL. A thread that ran MLX calls this before it ends: otherwise the state is
    freed by the thread's exit, which needs the GIL for the compiled graphs' Python parts,
    and aborts the process (std::terminate) when that happens while Python shuts down."""
    mx.synchronize()
    mx.clear_streams()


def _stop(inbox: "queue.SimpleQueue[Optional[Launched]]", thread: threading.Thread) -> None:
    inbox.put(None)
    if thread is not threading.current_thread():
        thread.join()


class ThreadedLauncher:
    """A thread that owns an MLX stream and encodes what is launched on it, in order."""

    def __init__(self) -> None:
        self._inbox: "queue.SimpleQueue[Optional[Launched]]" = queue.SimpleQueue()
        made = threading.Event()
        streams: list = []
        self._thread = threading.Thread(target=_serve, args=(self._inbox, streams, made),
                                        name="mlx-pte-launcher", daemon=True)
        self._thread.start()
        made.wait()
        if not streams:
            raise LaunchError(f"MLX could not make a stream on {mx.default_device()} for the launcher thread; "
                              "use launch='inline'")
        self.stream = streams[0]
        # Ends the thread when this launcher is collected (its building thread ended), or
        # before the process exits: MLX's per-thread state must not outlive its runtime.
        weakref.finalize(self, _stop, self._inbox, self._thread)

    @contextmanager
    def building(self) -> Iterator[None]:
        """Build for this launcher: arrays made inside are on its stream (the calling
        thread's default inside), and ``evaluate`` runs through it."""
        token = _BUILDING_FOR.set(self)
        try:
            with mx.stream(self.stream):
                yield
        finally:
            _BUILDING_FOR.reset(token)

    def launch(self, arrays: Sequence[mx.array], readable: Sequence[mx.array] = ()) -> Launched:
        """Queue ``arrays`` (built in ``building()``) for encoding; the host reads
        ``readable`` (arrays among or behind them) through the launch's copies."""
        with self.building():
            copies = [mx.stop_gradient(a) for a in readable]
        launched = Launched(list(arrays), copies)
        self._inbox.put(launched)
        return launched

    def evaluate(self, arrays: Sequence[mx.array]) -> None:
        """Evaluate ``arrays`` (built in ``building()``) now, through the launcher.

        Raises:
            LaunchError: MLX failed to encode them.
        """
        self.launch(arrays).wait()
        # Everything launched before is encoded too, and the building thread is the
        # launcher's only client: it is idle now, so waiting on the arrays here (which
        # edits their bookkeeping) races with nothing.
        mx.eval(list(arrays))


_PER_THREAD = threading.local()


def threaded_launcher() -> ThreadedLauncher:
    """The calling thread's launcher (made on first use; it ends with the thread)."""
    launcher = getattr(_PER_THREAD, "launcher", None)
    if launcher is None:
        launcher = _PER_THREAD.launcher = ThreadedLauncher()
    return launcher


def launcher_for(mode: str) -> Launcher:
    """The calling thread's launcher of ``mode`` (one of ``LAUNCH_MODES``)."""
    if mode == "thread":
        return threaded_launcher()
    if mode == "inline":
        return INLINE
    raise ValueError(f"launch mode must be one of {', '.join(LAUNCH_MODES)}, got {mode!r}")
