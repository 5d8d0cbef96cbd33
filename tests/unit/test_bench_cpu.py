"""The bench's CPU accounting of the stack's processes (bench.cpu), on real and fake processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from bench.cpu import CLIENTS, CpuMeter, cpu_seconds, cpu_table, group_of, shares
from bench.load import drive
from bench.stats import StreamTrace
from bench.workload import Workload


def test_stack_processes_are_grouped_by_their_command_lines() -> None:
    venv = "/repo/.venv/lib/python3.11/site-packages/pytriton/tritonserver"
    assert group_of(f"{venv}/bin/tritonserver --model-repository /repo/model_repository ") == "tritonserver"
    assert group_of("/repo/.triton/backends/python/triton_python_backend_stub /repo/model_repository/llm/1/"
                    "model.py triton_python_backend_shm_region_1 ") == "stub"
    assert group_of("/repo/.venv/bin/python -m adapter --config /tmp/x/config.json ") == "adapter"
    assert group_of("/repo/.venv/bin/python -m adapter.launch --config /tmp/x/config.json ") == "launcher"
    assert group_of("/usr/bin/python3 -c pass ") == "other"


def test_the_meter_counts_the_cpu_a_process_spends_between_two_readings() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.6: pass\ntime.sleep(30)"])
    try:
        meter = CpuMeter(lambda: [busy.pid])
        before = meter.read()
        deadline = time.monotonic() + 20
        while cpu_seconds(busy.pid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.05)
        spent = meter.spent(before, meter.read())
    finally:
        busy.kill()
        busy.wait()
    assert 0.3 <= spent["other"] <= 0.7  # its spin, less what it spent before the first reading
    assert CLIENTS in spent and spent[CLIENTS] >= 0.0
    assert cpu_seconds(busy.pid) == 0.0  # gone: counts nothing


def test_a_process_that_appears_between_readings_counts_from_zero() -> None:
    before = {"adapter": {1: 2.0}}
    after = {"adapter": {1: 2.5}, "stub": {7: 1.25}}
    assert CpuMeter.spent(before, after) == {"adapter": 0.5, "stub": 1.25}


def test_shares_are_percent_of_a_core_and_ms_per_token_in_a_fixed_order() -> None:
    got = shares({CLIENTS: 0.5, "adapter": 1.0, "stub": 19.0}, wall_s=10.0, tokens=2000)
    assert list(got) == ["adapter", "stub", CLIENTS]
    assert got["adapter"] == {"core_pct": 10.0, "ms_per_token": 0.5}
    assert got["stub"] == {"core_pct": 190.0, "ms_per_token": 9.5}
    table = cpu_table({32: got, 1: shares({"adapter": 0.1}, 10.0, 100)})
    lines = table.splitlines()
    assert lines[0] == f"| streams | adapter | stub | {CLIENTS} |"
    assert lines[2].startswith("| 1 | 1.0% (1.0 ms/tok) |") and lines[3].startswith("| 32 | 10.0% (0.5 ms/tok) |")


def test_drive_reads_the_meter_around_the_metered_systems_turns_only() -> None:
    readings = []

    class FakeMeter(CpuMeter):
        def __init__(self):
            self.t = 0.0

        def read(self):
            readings.append(self.t)
            self.t += 1.0  # each reading one CPU second after the one before
            return {"adapter": {1: self.t}}

    def system():
        async def send(prompt: str, max_tokens: int) -> StreamTrace:
            await asyncio.sleep(0)
            return StreamTrace(sent=0.0, token_times=[0.01, 0.02], tokens=2)
        return send

    work = Workload(max_tokens=3, concurrencies=(2,), rounds=2, repeats=2, min_requests=4, staggered=())
    results = asyncio.run(drive({"a": system(), "b": system()}, work, "float32", meters={"a": FakeMeter()}))
    by_name = {r.system: r for r in results}
    assert len(readings) == 4  # before and after each of a's two turns
    assert by_name["b"].cpu == {}
    cpu = by_name["a"].cpu["adapter"]
    assert cpu["ms_per_token"] == 1000 * 2.0 / by_name["a"].output_tokens  # 1 s per turn, 2 turns
