"""The engine's lifecycle: its thread and device, health checks, a bounded queue, stopping."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from llm_engine.errors import EngineError

from tests.conftest import wait_for
from tests.unit.engine_harness import Run, build


def test_the_engine_thread_makes_its_device_current(monkeypatch):
    """On CUDA/NPU the loop's thread must not run on device 0 when its instance has another."""
    import llm_engine.engine as engine_module
    from llm_engine.device import use_in_this_thread

    seen = []
    monkeypatch.setattr(engine_module, "use_in_this_thread",
                        lambda device: seen.append((device, threading.current_thread().name)))
    eng = build(kvCacheMemoryMiB=16)
    try:
        assert Run(eng, "Hi", max_tokens=1, temperature=0).wait().error is None
    finally:
        eng.stop()
    assert seen == [(eng.runner.device, "llm-engine")]

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    use_in_this_thread(torch.device("cuda", 3))
    use_in_this_thread(torch.device("cpu"))
    assert calls == [torch.device("cuda", 3)]


def test_health_reports_a_hung_step_and_recovers_when_it_ends(monkeypatch):
    eng = build(kvCacheMemoryMiB=16)
    eng.step_timeout = 0.3
    real = eng.runner.forward
    calls = []

    def slow_once(step):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.2)
        return real(step)

    monkeypatch.setattr(eng.runner, "forward", slow_once)
    try:
        assert eng.health() == ""
        r = Run(eng, "Hi", max_tokens=2, temperature=0)
        assert wait_for(lambda: "has run for more than 0.3 s" in eng.health(), 5)
        assert r.wait().error is None and eng.health() == ""
    finally:
        eng.stop()


def test_health_reports_steps_failing_in_a_row_and_a_dead_thread(monkeypatch):
    eng = build(kvCacheMemoryMiB=16)
    eng.max_failed_steps = 3
    real = eng.runner.forward

    def broken(step):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.runner, "forward", broken)
    try:
        for i in range(3):
            assert isinstance(Run(eng, f"Try {i}", max_tokens=2, temperature=0).wait().error, EngineError)
        assert eng.health() == "3 engine steps failed in a row"
        monkeypatch.setattr(eng.runner, "forward", real)
        assert Run(eng, "Works again", max_tokens=2, temperature=0).wait().error is None
        assert eng.health() == ""
        with eng._wake:  # the thread ends without stop(): an unexpected death
            eng._stop = True
            eng._wake.notify()
        eng._thread.join(5)
        eng._stop = False
        assert eng.health() == "the engine thread has ended"
    finally:
        eng.stop()



def test_a_full_engine_queue_refuses_at_once_and_serves_again_when_it_drains(monkeypatch):
    """maxWaitingRequests bounds the queue: beyond it submit() raises Overloaded (503 with
    Retry-After at the API) instead of queueing without bound."""
    from llm_engine.errors import Overloaded

    eng = build(kvCacheMemoryMiB=16, maxBatchSize=1, maxPrefillBatchSize=1, maxWaitingRequests=2)
    release = threading.Event()
    real = eng.runner.forward
    monkeypatch.setattr(eng.runner, "forward", lambda step: (release.wait(30), real(step))[1])
    try:
        running = Run(eng, "First", max_tokens=2, temperature=0)
        assert wait_for(lambda: len(eng.scheduler.running) == 1, 10)
        queued = [Run(eng, f"Queued {i}", max_tokens=2, temperature=0) for i in range(2)]
        with pytest.raises(Overloaded, match="queue is full"):
            Run(eng, "One too many", max_tokens=2, temperature=0)
        release.set()
        for r in [running, *queued]:
            assert r.wait().error is None
        assert Run(eng, "After", max_tokens=2, temperature=0).wait().error is None
    finally:
        release.set()
        eng.stop()


def test_stop_during_a_long_step_leaves_the_scheduler_to_the_engine_thread(monkeypatch):
    """stop() that times out while a step runs must not end requests from another thread;
    the engine thread ends them, with one error each, when the step is over."""
    eng = build(kvCacheMemoryMiB=16)
    real = eng.runner.forward
    monkeypatch.setattr(eng.runner, "forward", lambda step: (time.sleep(1.0), real(step))[1])
    r = Run(eng, "Hi", max_tokens=50, temperature=0, ignore_eos=True)
    assert wait_for(lambda: eng._step_started > 0, 10)
    eng.stop(timeout=0.1)
    assert eng._thread.is_alive() and not r.done.is_set()  # the step is still running
    assert r.wait(10).error is not None and "shutting down" in str(r.error)
    eng._thread.join(5)
    assert not eng._thread.is_alive() and not eng.scheduler.requests()
    assert [o.final for o in r.outputs].count(True) == 0
