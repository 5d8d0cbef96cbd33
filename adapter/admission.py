"""How many inference requests run at once, and the bounded queue in front of them (spec §1.1).

``maxLinkNum`` requests run at once and up to ``2 × maxLinkNum`` more wait, in arrival
order, for a slot; past that (and for a request that waited longer than its deadline)
the guard answers 503 with ``Retry-After`` at once (:class:`adapter.guards.Admission`).
The health routes read :attr:`AdmissionState.busy` and the drain on SIGTERM reads
:attr:`AdmissionState.in_flight`.
"""

from __future__ import annotations

import asyncio
from collections import deque


class AdmissionState:
    """What the admission guard and the health routes share: stopping, requests in flight and
    waiting, ``maxLinkNum`` (0: no limit)."""

    def __init__(self, limit: int = 0, max_wait: float = 600.0) -> None:
        self.stopping = False
        self.in_flight = 0
        self.limit = limit
        self.queue_limit = 2 * limit
        self.max_wait = max_wait  # seconds a request may wait for a slot (the e2eTimeout)
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def busy(self) -> bool:
        """Every inference slot is taken: a new request would wait or get 503 (MindIE's busy state)."""
        return bool(self.limit) and self.in_flight >= self.limit

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def would_wait(self) -> bool:
        """A request arriving now would queue for a slot (or be turned away)."""
        return bool(self.limit) and (self.in_flight >= self.limit or bool(self._waiters))

    async def acquire(self) -> bool:
        """Take a slot, waiting behind the requests that came first; False when the queue is full
        or the wait passed :attr:`max_wait`. A True must be matched by :meth:`release`."""
        if not self.limit or (self.in_flight < self.limit and not self._waiters):
            self.in_flight += 1
            return True
        if len(self._waiters) >= self.queue_limit:
            return False
        slot = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        try:
            await asyncio.wait_for(asyncio.shield(slot), self.max_wait)
        except BaseException as exc:
            if slot.done() and not slot.cancelled():
                self.release()  # handed a slot as the wait ended: pass it on
            else:
                slot.cancel()
                self._waiters.remove(slot)
            if isinstance(exc, asyncio.TimeoutError):
                return False
            raise
        return True

    def release(self) -> None:
        """Hand the slot to the longest-waiting request, or free it."""
        while self._waiters:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)  # in_flight stays: the slot changes hands
                return
        self.in_flight -= 1
