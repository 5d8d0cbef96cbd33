"""The launcher as users run it (`python -m adapter.launch`): stub crash recovery and SIGTERM drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import MODEL_NAME, ROOT, write_settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def child_pids(parent: int) -> list[int]:
    from adapter.launch import child_pids as kids

    return kids(parent)


@pytest.fixture
def launched(tmp_path, monkeypatch, request):
    """``python -m adapter.launch``; settings overrides come as the fixture's indirect param."""
    monkeypatch.setenv("MINDIE_TEST_PORT_BASE", str(int(os.environ.get("MINDIE_TEST_PORT_BASE", "18000")) + 500))
    cfg = write_settings(tmp_path, **getattr(request, "param", {}))
    data = json.loads(cfg.read_text())
    url = f"http://127.0.0.1:{data['ServerConfig']['port']}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "model_repository/llm/1")]))
    log = tmp_path / "launch.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "adapter.launch", "--config", str(cfg)], env=env, cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"launcher exited: {log.read_text(errors='replace')[-3000:]}"
        try:
            if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    yield proc, url, log
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    from adapter.launch import alive as is_alive

    return is_alive(pid)


def ready(url: str) -> int:
    try:
        return httpx.get(url + "/v2/health/ready", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_stub_crash_ends_streams_with_an_error_and_recovers(launched):
    proc, url, _log = launched
    (triton,) = [p for p in child_pids(proc.pid) if "tritonserver" in open(f"/proc/{p}/cmdline").read()]
    # the stub of `llm` (`llm_unary` has its own)
    (stub,) = [p for p in child_pids(triton) if "/llm/1/model.py" in open(f"/proc/{p}/cmdline").read()]
    first_run = f"mindie_triton_{proc.pid}_0_"  # the launcher's shm prefix for its first tritonserver
    assert [e for e in os.listdir("/dev/shm") if e.startswith(first_run)]
    events: list[str] = []

    def stream():
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json={
                "model": MODEL_NAME, "prompt": "Write an essay", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)

    t = threading.Thread(target=stream)
    t.start()
    while len(events) < 2:
        time.sleep(0.05)
    os.kill(stub, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "the open stream hung after the stub died"
    assert '"error_type"' in events[-1]
    seen_unready = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        code = ready(url)
        seen_unready |= code != 200
        if seen_unready and code == 200:
            break
        time.sleep(0.2)
    assert seen_unready and ready(url) == 200
    # the killed stub could not unlink its shared memory; the launcher removed it
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(first_run)]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


@pytest.mark.parametrize("launched", [{"BackendConfig.ScheduleConfig": {"stepTimeout": 0.001}}], indirect=True)
def test_a_hung_engine_ends_its_stub_and_the_model_comes_back(launched):
    """Every step outlives a 1 ms stepTimeout, so the first long stream makes the engine
    count as hung: the stub exits, the stream ends with an error event instead of hanging,
    and the launcher brings the model back."""
    proc, url, log = launched
    (triton,) = [p for p in child_pids(proc.pid) if "tritonserver" in open(f"/proc/{p}/cmdline").read()]
    (stub,) = [p for p in child_pids(triton) if "/llm/1/model.py" in open(f"/proc/{p}/cmdline").read()]
    events = []
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": "Write an essay", "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert '"error_type"' in events[-1], events[-3:]
    assert not alive(stub)
    assert "an engine step has run for more than 0.001 s; exiting so that the model is restarted" in log.read_text()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and ready(url) != 200:
        time.sleep(0.2)
    assert ready(url) == 200
    stubs = [p for t in child_pids(proc.pid) for p in child_pids(t) if "/llm/1/model.py" in open(f"/proc/{p}/cmdline").read()]
    assert stubs and stub not in stubs


def test_sigterm_drains_in_flight_then_exits(launched):
    proc, url, log = launched
    result = {}

    def long_request():
        r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Count", "max_tokens": 40,
                                                      "ignore_eos": True}, timeout=60)
        result["status"] = r.status_code
        result["tokens"] = r.json()["usage"]["completion_tokens"]

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while ready(url) == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready(url) in (503, 0)
    late = None
    try:
        late = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
                          timeout=5).status_code
    except httpx.HTTPError:
        pass  # the listener may already be closed once the drain is over
    assert late in (503, None)
    t.join(60)
    assert result == {"status": 200, "tokens": 40}
    assert proc.wait(60) == 0
    # the stubs enable faulthandler: a segfault while unloading (there was one at every
    # shutdown that followed traffic) would print this to the log
    assert "Fatal Python error" not in log.read_text(errors="replace")


def test_a_killed_launcher_takes_triton_and_its_stubs_along(launched):
    """SIGKILL leaves no cleanup to the launcher: tritonserver dies with it (PR_SET_PDEATHSIG)
    and the model's stub, which Triton never tells, exits when its parent is gone."""
    proc, _url, _log = launched
    (triton,) = [p for p in child_pids(proc.pid) if "tritonserver" in open(f"/proc/{p}/cmdline").read()]
    (stub,) = [p for p in child_pids(triton) if "/llm/1/model.py" in open(f"/proc/{p}/cmdline").read()]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (alive(triton) or alive(stub)):
        time.sleep(0.2)
    assert not alive(triton) and not alive(stub)
