"""Deadlines for slow clients, which uvicorn (0.54, h11) does not have of its own.

uvicorn closes a connection idle between requests after ``timeout_keep_alive``,
but waits forever for a connection that sends nothing, for headers that never
end, and for a body that stops arriving: a few hundred such connections hold
the server's sockets and memory. ``GuardedH11Protocol`` adds:

* a header deadline: a request's headers must be complete within
  ``header_timeout_s`` of the connection opening (or of the previous response
  ending); else 408 (when part of a request came) and the connection closes;
* a body deadline: while a request body is arriving, at most ``body_timeout_s``
  may pass between two reads; else 408 and the connection closes (the handler
  sees a disconnect);
* 431 instead of uvicorn's 400 for headers above h11's limit
  (``h11_max_incomplete_event_size``, 16 KiB by default), read to the end of
  what the client sends before closing, so that the client gets the answer
  rather than a connection reset.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
#: How long a refused connection is read (and its bytes dropped) before it is closed.
LINGER_S = 2.0

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"connection: close\r\ncontent-length: 16\r\n\r\nRequest Timeout\n")
_TOO_LARGE_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
                  b"connection: close\r\ncontent-length: 35\r\n\r\nRequest header fields are too large\n")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines, and 431 for oversized headers."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    @classmethod
    def with_timeouts(cls, header_timeout_s: float, body_timeout_s: float) -> type[GuardedH11Protocol]:
        """A subclass with these deadlines, for ``uvicorn.Config(http=...)`` (which takes a class)."""
        return type(cls.__name__, (cls,), {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for = ""  # "headers", "body" or "" (nothing to wait for)
        self._refused = False
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # dropped: read only so that the client can take the answer before the connection closes
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline("", 0.0)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers every malformed request 400; headers above the limit get their own 431."""
        buffered, _ = self.conn.trailing_data
        if len(buffered) > self.conn._max_incomplete_event_size:
            self._refuse(_TOO_LARGE_431)
        else:
            super().send_400_response(msg)

    def _watch(self) -> None:
        """Arm the deadline that fits the connection's state: the header deadline runs from when a request
        may start (not pushed back by each byte, so that a slow drip cannot hold it), the body deadline
        from the latest read."""
        if self._refused or self.transport.is_closing():
            self._set_deadline("", 0.0)
        elif self.conn.their_state is h11.IDLE and self._between_requests():
            if self._waiting_for != "headers":
                self._set_deadline("headers", self.header_timeout_s)
        elif self.conn.their_state is h11.SEND_BODY:
            self._set_deadline("body", self.body_timeout_s)
        else:
            self._set_deadline("", 0.0)

    def _between_requests(self) -> bool:
        """Whether no request is being handled (a new one may start)."""
        return self.cycle is None or self.cycle.response_complete

    def _set_deadline(self, waiting_for: str, timeout_s: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._waiting_for = waiting_for
        self._deadline = self.loop.call_later(timeout_s, self._expired) if waiting_for else None

    def _expired(self) -> None:
        self._deadline = None
        if self._waiting_for == "body" and self.flow.read_paused:
            # The handler is not reading: the client is not the slow one.
            self._set_deadline("body", self.body_timeout_s)
            return
        started = self._waiting_for == "body" or bool(self.conn.trailing_data[0])
        self.logger.info("closing the connection from %s: request %s too slow", _peer(self.client), self._waiting_for)
        if started and (self.cycle is None or not self.cycle.response_started):
            self._refuse(_TIMEOUT_408)
        else:
            self.transport.close()

    def _refuse(self, response: bytes) -> None:
        """Send ``response`` and close: at the client's end of input, or after ``LINGER_S``."""
        self._refused = True
        self._set_deadline("", 0.0)
        if self.cycle is not None:
            self.cycle.disconnected = True  # the handler, if any, stops sending
            self.cycle.message_event.set()
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def eof_received(self) -> bool | None:
        if self._refused:
            self.transport.close()
        return super().eof_received()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
