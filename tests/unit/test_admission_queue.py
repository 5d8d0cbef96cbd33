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
