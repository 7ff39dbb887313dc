"""uvicorn's HTTP/1.1 protocol with a deadline for a request's head.

uvicorn bounds idle keep-alive connections, and the app bounds a stalled body
(``--body-read-timeout``), but nothing bounds the request line and headers: a client that opens a
connection and sends nothing, or trickles its headers a byte at a time, holds a socket (and a file
descriptor) for as long as it likes.  :func:`http_protocol` returns uvicorn's h11 protocol with a
timer armed whenever the connection waits for a new request's head (at connect, and after each
response); the connection is closed if the head is not complete in time.  Requests whose head arrived
are untouched, however long their body or their streamed response takes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def http_protocol(header_timeout: float) -> type[H11Protocol]:
    """An ``H11Protocol`` that closes connections whose request head takes over ``header_timeout``
    seconds (pass it as ``uvicorn.Config(http=...)``)."""

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request's head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # waiting for the next request on this keep-alive connection

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection from %s: no complete request head in %g s", self.client,
                         header_timeout)
                self.transport.close()

    return HeadTimeoutProtocol
