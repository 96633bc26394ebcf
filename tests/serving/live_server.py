"""An app served by uvicorn on 127.0.0.1 in a thread, for tests that talk real HTTP."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import uvicorn

START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app, **config) -> Iterator[str]:
    """The base URL of ``app`` served until the block ends (``config``: uvicorn.Config options)."""
    port = free_port()
    config = {"log_level": "warning", "lifespan": "on", **config}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT)
        assert not thread.is_alive(), "the server did not stop"
