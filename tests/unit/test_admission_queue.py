"""maxLinkNum running, 2 x maxLinkNum waiting in arrival order, the rest turned away (spec §1.1)."""

from __future__ import annotations

import asyncio

import pytest

from adapter.admission import AdmissionState


def run(coro):
    return asyncio.run(coro)


def test_waiters_get_slots_in_arrival_order_and_the_queue_is_bounded():
    async def scenario():
        state = AdmissionState(limit=1)
        assert await state.acquire() and state.busy
        order: list[str] = []

        async def wait(name: str):
            assert await state.acquire()
            order.append(name)

        waiters = [asyncio.create_task(wait(n)) for n in ("b", "c")]
        await asyncio.sleep(0.01)
        assert state.waiting == 2
        assert not await state.acquire()  # 1 running + 2 waiting: full
        state.release()  # the slot passes to "b"; in_flight stays 1
        await asyncio.sleep(0.01)
        assert order == ["b"] and state.in_flight == 1 and state.waiting == 1
        state.release()
        await asyncio.gather(*waiters)
        assert order == ["b", "c"]
        state.release()
        assert (state.in_flight, state.waiting) == (0, 0) and not state.busy

    run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_a_wait_has_a_deadline():
    async def scenario():
        state = AdmissionState(limit=1, max_wait=0.05)
        assert await state.acquire()
        gone = asyncio.create_task(state.acquire())
        await asyncio.sleep(0.01)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert state.waiting == 0
        assert not await state.acquire()  # waited max_wait for a slot that did not come
        assert state.waiting == 0
        state.release()
        assert state.in_flight == 0

    run(scenario())


def test_a_slot_handed_to_a_waiter_that_is_going_away_is_not_lost():
    async def scenario():
        state = AdmissionState(limit=1)
        assert await state.acquire()
        first = asyncio.create_task(state.acquire())
        second = asyncio.create_task(state.acquire())
        await asyncio.sleep(0.01)
        state.release()  # handed to "first" ...
        first.cancel()  # ... which is cancelled before it runs: it keeps the slot or passes it on
        try:
            got = await first
        except asyncio.CancelledError:
            got = False
        if got:
            state.release()
        assert await second and state.in_flight == 1 and state.waiting == 0
        state.release()
        assert state.in_flight == 0

    run(scenario())


def test_no_limit_never_waits():
    async def scenario():
        state = AdmissionState(limit=0)
        assert all([await state.acquire() for _ in range(50)]) and not state.busy

    run(scenario())


class Client:
    """One HTTP request as the ASGI server hands it on: its body, then (when ``hang_up``
    is set) the disconnect; and what the app sent back."""

    def __init__(self, body: bytes = b'{"prompt": "hi"}', chunked: bool = False):
        self.body, self.hang_up, self.sent = body, asyncio.Event(), []
        headers = [] if chunked else [(b"content-length", str(len(body)).encode())]
        self.scope = {"type": "http", "path": "/infer", "method": "POST", "headers": headers}
        self._body_sent = False

    async def receive(self):
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)

    def through(self, guard) -> asyncio.Task:
        """The request, sent through the admission guard."""
        return asyncio.create_task(guard(self.scope, self.receive, self.send))


async def one_slot_taken():
    """maxLinkNum 1, its slot held by a long generation: the guard, its state, what it served."""
    state = AdmissionState(limit=1)
    guard, served = admission_with(state)
    assert await state.acquire()
    return state, guard, served


def admission_with(state):
    from adapter.guards import Admission

    served: list[bytes] = []

    async def app(scope, receive, send):
        served.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return Admission(app, state), served


def test_a_client_that_hangs_up_while_queued_leaves_the_queue_at_once():
    """Dead entries once kept their places for up to e2eTimeout, and live clients got 503."""
    async def scenario():
        state, guard, served = await one_slot_taken()
        gone = [Client() for _ in range(2)]
        queued = [c.through(guard) for c in gone]
        await asyncio.sleep(0.01)
        assert state.waiting == 2
        for client in gone:
            client.hang_up.set()
        await asyncio.gather(*queued)
        assert state.waiting == 0 and not any(c.sent for c in gone)
        live = Client(b'{"inputs": "live"}')
        task = live.through(guard)
        await asyncio.sleep(0.01)
        assert state.waiting == 1  # queued, not turned away
        state.release()
        await task
        assert served == [b'{"inputs": "live"}'] and live.sent[0]["status"] == 200  # the body, replayed
        assert (state.in_flight, state.waiting) == (0, 0)

    run(scenario())


def test_a_client_that_hangs_up_as_its_slot_comes_passes_the_slot_on():
    async def scenario():
        state, guard, served = await one_slot_taken()
        first, second = Client(b"1"), Client(b"2")
        tasks = [c.through(guard) for c in (first, second)]
        await asyncio.sleep(0.01)
        first.hang_up.set()
        state.release()  # handed to "first", which is going away at the same moment
        await asyncio.gather(*tasks)
        assert served == [b"2"] and not first.sent and state.in_flight == 0

    run(scenario())


def test_a_chunked_body_is_left_to_the_route_and_waits_as_before():
    async def scenario():
        state, guard, served = await one_slot_taken()
        client = Client(b"chunked", chunked=True)
        task = client.through(guard)
        await asyncio.sleep(0.01)
        assert state.waiting == 1 and not client._body_sent  # not read while it waits
        state.release()
        await task
        assert served == [b"chunked"] and state.in_flight == 0

    run(scenario())
