"""uvicorn's h11 protocol with a deadline for each request head.

uvicorn arms its keep-alive timer only after a response, and any byte cancels it. So a
connection that never sent a request, or that sent its head a byte at a time, stayed
open for ever, and each counted against ``limit_concurrency``: ~3 x ``maxLinkNum`` idle
sockets (measured: 67 at ``maxLinkNum`` 1) made every route, health probes included,
answer 503. Here a connection must deliver each request head within the keep-alive
time, counted from its opening or from the previous response, however it dribbles.
"""

from __future__ import annotations

import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadDeadlineProtocol(H11Protocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(time.monotonic() + self.timeout_keep_alive)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # uvicorn cancels its timer at any byte
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm(self._head_deadline)  # still no whole head: the same deadline, not a new one

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer for the next request
        self._head_deadline = time.monotonic() + self.timeout_keep_alive

    def _arm(self, deadline: float) -> None:
        self._head_deadline = deadline
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(
            max(0.0, deadline - time.monotonic()), self.timeout_keep_alive_handler)
