"""Bounds on the HTTP listener that uvicorn leaves open: how long a request may take to arrive and
how many connections may be open at once.

uvicorn times out idle keep-alive connections, but nothing else: a client that sends half a
request line, or headers and then a body one byte a minute, holds its connection (a file
descriptor and a coroutine) for as long as it likes, and nothing bounds how many it opens. The
gRPC ports end such callers with a first-message deadline (card.common.gate); this is the same
rule for HTTP, on uvicorn's own h11 protocol:

- a request must arrive whole (request line, headers and body) within ``REQUEST_ARRIVAL_S`` of its
  first byte (of the connection, for the first request); otherwise the connection is closed, and
  an app waiting on the body sees the client gone;
- at most ``MAX_CONNECTIONS`` connections are open; one more is closed as it is accepted, before
  anything is read. Streams under way are connections too: the bound is far above the engine's
  --max-batch-size + --max-waiting, which refuse load with 429 long before it.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_ARRIVAL_S = 20.0  # as the gRPC ports' first-message deadline (card.common.gate)
MAX_CONNECTIONS = 1024


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with an arrival deadline per request and a cap on connections."""

    arrival_s = REQUEST_ARRIVAL_S
    max_connections = MAX_CONNECTIONS

    _arrival: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # nothing read, nothing answered: the cap is the answer
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._arrival is None and self._between_requests():
            self._arm()  # the next request on a kept-alive connection starts its own clock
        super().data_received(data)
        if self._arrival is not None and self.conn.their_state is not h11.IDLE and not self._arriving():
            self._disarm()  # the request has arrived whole (or the connection is ending)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arriving(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY

    def _arm(self) -> None:
        self._disarm()
        self._arrival = self.loop.call_later(self.arrival_s, self._too_slow)

    def _disarm(self) -> None:
        if self._arrival is not None:
            self._arrival.cancel()
            self._arrival = None

    def _too_slow(self) -> None:
        self._arrival = None
        if not self.transport.is_closing() and (self.conn.their_state is h11.IDLE or self._arriving()):
            self.transport.close()  # connection_lost tells an app reading the body that it is gone
