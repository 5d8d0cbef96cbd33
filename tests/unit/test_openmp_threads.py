"""OpenMP worker pools: the loading's end with it, and the engine thread keeps torch's thread count.

libgomp keeps one pool of workers per thread that opened a parallel region. With more of
them than CPUs it stops spinning between regions, and each fused kernel call at 32 rows took
~100 us instead of ~10 (measured on a 2-core VM, the loading in the caller's thread)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
from llm_engine import factory
from llm_engine.cpu_cores import in_a_passing_thread

from tests.conftest import ROOT

POOLS = textwrap.dedent("""
    import ctypes, os, sys, threading, time
    sys.path.insert(0, {engine!r})
    import torch
    from llm_engine.cpu_cores import in_a_passing_thread
    from llm_engine.cpu_ops import openmp_runtimes
    from llm_engine.device import use_in_this_thread

    torch.set_num_threads(2)
    def tasks():
        return len(os.listdir("/proc/self/task"))
    def work():  # large enough for a parallel region
        return int(torch.ones(2048, 2048).sum())
    before = tasks()
    assert in_a_passing_thread(work) == 2048 * 2048
    # join() returns before the OS thread has run its exit, where libgomp ends its pool
    deadline = time.monotonic() + 10
    while tasks() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    after_passing = tasks()
    work()
    after_here = tasks()
    print("tasks", before, after_passing, after_here)

    omp = ctypes.CDLL(openmp_runtimes()[0])
    torch.set_num_threads(1)
    seen = []
    def engine_thread():
        seen.append(omp.omp_get_max_threads())
        use_in_this_thread(torch.device("cpu"))
        seen.append(omp.omp_get_max_threads())
    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    print("max_threads", *seen)
""")


@pytest.fixture(scope="module")
def pools() -> dict[str, list[int]]:
    script = POOLS.format(engine=str(ROOT / "model_repository" / "llm" / "1"))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return {line.split()[0]: [int(v) for v in line.split()[1:]] for line in out.stdout.splitlines()}


def test_a_passing_threads_openmp_workers_end_with_it(pools):
    before, after_passing, after_here = pools["tasks"]
    assert after_passing == before
    assert after_here == before + 1  # the same work in this thread leaves its worker behind


def test_the_engine_thread_takes_torchs_thread_count(pools):
    """A new thread starts at one OpenMP thread per CPU, which oneDNN and MKL would use
    whatever ``cpuThreads`` said; use_in_this_thread() carries torch's count over."""
    fresh, carried = pools["max_threads"]
    assert fresh == len(os.sched_getaffinity(0))
    assert carried == 1


def test_a_passing_thread_hands_back_the_result_and_the_exception():
    assert in_a_passing_thread(lambda a, b: a + b, 2, 3) == 5

    def fails():
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        in_a_passing_thread(fails)


def test_the_model_loads_in_a_passing_thread(monkeypatch):
    seen = []
    monkeypatch.setattr(factory, "_build_engine", lambda *args: seen.append(threading.current_thread()) or "engine")
    assert factory.build_engine(factory.Settings()) == "engine"
    assert seen and seen[0] is not threading.current_thread() and not seen[0].is_alive()
