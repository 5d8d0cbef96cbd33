"""Adapter and launcher pieces that need no server: the slow-reader guard, /dev/shm cleanup."""

from __future__ import annotations

import asyncio

import pytest

from adapter.launch import remove_shm_leftovers
from adapter.service import BoundedStreamingResponse, SlowReader


def test_a_stalled_write_cancels_the_stream_and_closes_its_source():
    closed = asyncio.Event()
    produced = []

    async def events():
        try:
            for i in range(1000):
                produced.append(i)
                yield b"data: {}\n\n"
        finally:
            closed.set()

    async def send(message):
        if message["type"] == "http.response.body" and len(produced) > 3:
            await asyncio.sleep(3600)  # the client stopped reading

    async def run():
        response = BoundedStreamingResponse(events(), "req-1", write_timeout=0.2)
        with pytest.raises(SlowReader):
            await response.stream_response(send)
        assert closed.is_set()

    asyncio.run(run())
    assert len(produced) < 10  # nothing is produced ahead of what the client takes


def test_a_reading_client_gets_every_event():
    sent = []

    async def events():
        for i in range(5):
            yield f"data: {i}\n\n".encode()

    async def send(message):
        sent.append(message)

    asyncio.run(BoundedStreamingResponse(events(), "req-2", write_timeout=0.2).stream_response(send))
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies[:5] == [f"data: {i}\n\n".encode() for i in range(5)] and sent[-1]["more_body"] is False


def test_shm_leftovers_of_a_stopped_tritonserver_are_removed(tmp_path):
    mine = tmp_path / "mindie_triton_42_0_3f2a"
    other = tmp_path / "mindie_triton_42_1_aa00"  # a later run: still in use
    foreign = tmp_path / "triton_python_backend_shm_region_1"
    flags = tmp_path / "mindie-triton-cancel-777"
    for f in (mine, other, foreign):
        f.write_bytes(b"x")
    flags.mkdir()
    (flags / "llm_unary-0123").write_text("")
    removed = remove_shm_leftovers("mindie_triton_42_0_", 777, shm=tmp_path)
    assert sorted(removed) == ["mindie-triton-cancel-777", "mindie_triton_42_0_3f2a"]
    assert other.exists() and foreign.exists() and not mine.exists() and not flags.exists()
