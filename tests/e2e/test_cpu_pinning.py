"""On CPU the engine thread has its cores to itself; tritonserver, the adapter and the stub's
other threads run on the rest (``ModelConfig.cpuAffinity`` auto, llm_engine/cpu_cores.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_engine.cpu_cores import parse_cpus

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


def test_the_engine_thread_runs_alone_on_its_cores(stack, client):
    cores = stack.sup.cores
    if cores is None:
        pytest.skip("one CPU: nothing to split")
    assert client.post("/v1/completions", json={"model": stack.settings.model.modelName, "prompt": "Hi",
                                                 "max_tokens": 2}).status_code == 200
    for name, proc in (("tritonserver", stack.sup.triton), ("adapter", stack.sup.adapter)):
        assert set(thread_cpus(proc.pid).values()) == {cores.rest}, name
    on_engine_cores = {}  # stub pid -> how many of its threads run on the engine's cores
    for stub in stack.sup.stubs:  # llm's and llm_unary's
        cpus = list(thread_cpus(stub).values())
        assert set(cpus) <= {cores.engine, cores.rest}, (stub, cpus)
        on_engine_cores[stub] = cpus.count(cores.engine)
    # llm's engine thread, plus the intra-op threads it started (one per engine core at most)
    assert sorted(on_engine_cores.values()) in ([0, n] for n in range(1, len(cores.engine) + 1)), on_engine_cores
