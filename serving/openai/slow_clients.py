"""A request-header deadline for uvicorn's h11 protocol.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but, once a byte
of a request has arrived, waits for the rest of its headers forever; a client can hold
a connection (and its buffers) open by sending half a request line. This protocol gives
every request ``header_timeout`` seconds from connection or first byte to the end of its
headers, then answers 408 and closes. Body timeouts are the app's (``request_body``).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("uvicorn.error")  # uvicorn configures it: one line per event in its log


def header_timeout_protocol(header_timeout: float) -> type:
    """An ``H11Protocol`` subclass (for ``uvicorn.Config(http=...)``) enforcing ``header_timeout``."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a client that connects and sends nothing is timed too

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # IDLE with bytes buffered: a request has begun but its headers are incomplete.
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                self._arm()
            elif self.conn.their_state is not h11.IDLE:
                self._disarm()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:  # a request began: tell the client why it ends
                log.info("%s: request headers incomplete after %g s; closing", _peer(self.client),
                         header_timeout)
                self.transport.write(_timeout_response(header_timeout))
            self.transport.close()

    return HeaderDeadlineProtocol


def _peer(client) -> str:
    return "%s:%d" % tuple(client) if client else "client"


def _timeout_response(seconds: float) -> bytes:
    body = json.dumps({"error": {"message": f"the request headers did not arrive within {seconds:g} s",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body
