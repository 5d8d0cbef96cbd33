"""Where the engine's threads run (llm_engine/cpu_cores.py). With the fused CPU kernels the
engine takes every core by default, unpinned. With fewer ``cpuThreads`` than cores and
``ModelConfig.cpuAffinity`` auto (the default) the engine thread has its cores to itself;
tritonserver, the adapter and the stub's other threads run on the rest. With off, nothing
is pinned."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from llm_engine.cpu_cores import fused_kernels_expected, parse_cpus

from tests.conftest import Stack, write_settings

pytestmark = pytest.mark.e2e


def thread_cpus(pid: int) -> dict[int, tuple[int, ...]]:
    """Each thread of ``pid`` -> the CPUs it may run on, as the kernel reports them."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        out[int(task.name)] = parse_cpus(line.split(":", 1)[1])
    return out


def _cores() -> int:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one CPU: nothing to split")
    return cores


def _stack_with(tmp_path, monkeypatch, offset: int, **model) -> Stack:
    monkeypatch.setenv("MINDIE_TEST_PORT_BASE",
                       str(int(os.environ.get("MINDIE_TEST_PORT_BASE", "18000")) + offset))
    path = write_settings(tmp_path)
    data = json.loads(path.read_text())
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(model)
    path.write_text(json.dumps(data))
    return Stack(path)


def test_by_default_the_fused_engine_runs_on_every_core(stack):
    _cores()
    if not fused_kernels_expected(stack.settings.model.cpuKernels):
        pytest.skip("no C compiler: the torch path keeps a core free (tested in test_cpu_cores)")
    assert stack.settings.model.cpuThreads == 0 and stack.settings.model.cpuAffinity == "auto"
    assert stack.sup.cores is None
    everything = tuple(sorted(os.sched_getaffinity(0)))
    for pid in (stack.sup.triton.pid, stack.sup.adapter.pid, *stack.sup.stubs):
        assert set(thread_cpus(pid).values()) == {everything}, pid


def test_fewer_threads_than_cores_run_alone_on_their_cores(tmp_path, monkeypatch):
    stack = _stack_with(tmp_path, monkeypatch, 800, cpuThreads=_cores() - 1)
    try:
        stack.start()
        assert stack.settings.model.cpuAffinity == "auto"
        _check_pinned(stack)
    finally:
        stack.stop()


def test_with_affinity_off_nothing_is_pinned(tmp_path, monkeypatch):
    stack = _stack_with(tmp_path, monkeypatch, 850, cpuThreads=_cores() - 1, cpuAffinity="off")
    try:
        stack.start()
        assert stack.sup.cores is None
        everything = os.sched_getaffinity(0)
        for pid in (stack.sup.triton.pid, stack.sup.adapter.pid, *stack.sup.stubs):
            assert set(thread_cpus(pid).values()) == {tuple(sorted(everything))}, pid
    finally:
        stack.stop()


def _check_pinned(stack) -> None:
    cores = stack.sup.cores
    assert cores is not None
    r = httpx.post(stack.url + "/v1/completions", json={"model": stack.settings.model.modelName, "prompt": "Hi",
                                                        "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    for name, proc in (("tritonserver", stack.sup.triton), ("adapter", stack.sup.adapter)):
        assert set(thread_cpus(proc.pid).values()) == {cores.rest}, name
    on_engine_cores = {}  # stub pid -> how many of its threads run on the engine's cores
    for stub in stack.sup.stubs:  # llm's and llm_unary's
        cpus = list(thread_cpus(stub).values())
        assert set(cpus) <= {cores.engine, cores.rest}, (stub, cpus)
        on_engine_cores[stub] = cpus.count(cores.engine)
    # llm's engine thread, plus the intra-op threads it started (one per engine core at most)
    assert sorted(on_engine_cores.values()) in ([0, n] for n in range(1, len(cores.engine) + 1)), on_engine_cores
