"""Shared fixtures. The e2e ones start the REAL stack: tritonserver + the llm model + the adapter."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "model_repository" / "llm" / "1"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

MODEL_NAME = "SmolLM2-135M-Instruct"


# The stacks of a run use ports base + offset + (25, 100, 101, 102): the session's stack at
# offset 0, the tests that start their own at these offsets.
PORT_OFFSETS = (0, 500, 600, 700, 800, 850, 900)


def _ports_free(base: int) -> bool:
    for port in (base + off + p for off in PORT_OFFSETS for p in (25, 100, 101, 102)):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _pick_port_base() -> str:
    """18000 where its ports are free, else the next free base: another test run or a server
    on this machine (a second checkout's tests, CI beside a developer) must not be answered for."""
    return str(next((base for base in range(18000, 60000, 1500) if _ports_free(base)), 18000))


os.environ.setdefault("MINDIE_TEST_PORT_BASE", _pick_port_base())
os.environ["MIES_SERVICE_MONITOR_MODE"] = "1"  # /metrics answers only with it, as in MindIE (the stacks inherit it)


def _free_port_base() -> int:
    return int(os.environ["MINDIE_TEST_PORT_BASE"])


def wait_for(predicate, timeout=10.0, interval=0.05) -> bool:
    """Poll until predicate() is true; False when the timeout passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def write_settings(tmp: Path, **overrides) -> Path:
    base = _free_port_base()
    data = json.loads((ROOT / "conf" / "config.json").read_text())
    data["ServerConfig"]["port"] = base + 25
    data["ServerConfig"]["drainTimeout"] = 5
    data["TritonConfig"].update(httpPort=base + 100, grpcPort=base + 101, metricsPort=base + 102,
                                exitTimeoutSecs=2)
    sched = data["BackendConfig"]["ScheduleConfig"]
    sched["kvCacheMemoryMiB"] = 256
    sched["maxQueueDelayMicroseconds"] = 600  # not config.pbtxt's 500: the e2e tests see it applied
    for section, values in overrides.items():
        target = data
        for key in section.split("."):
            target = target[key]
        target.update(values)
    path = tmp / "config.json"
    path.write_text(json.dumps(data, indent=2))
    return path


class Stack:
    """A running tritonserver + adapter, driven through adapter.launch.Supervisor."""

    def __init__(self, config_path: Path):
        from adapter.launch import Supervisor

        self.sup = Supervisor(config_path, ROOT / "model_repository")
        self.settings = self.sup.settings
        srv = self.settings.server
        scheme = "https" if srv.httpsEnabled else "http"
        self.url = f"{scheme}://{srv.ipAddress}:{srv.port}"
        t = self.settings.triton
        self.grpc_url = t.grpc_target
        self.triton_http = t.http_url
        self.metrics_url = t.metrics_url

    def start(self) -> None:
        self.sup.start_triton(timeout=300)
        self.sup.start_adapter()
        self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sup.adapter is not None and self.sup.adapter.poll() is not None:
                raise RuntimeError(f"adapter exited with {self.sup.adapter.returncode}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=2, verify=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("adapter did not become ready")

    def stop(self) -> None:
        self.sup.shutdown()

    def engine_metric(self, name: str) -> float:
        total = 0.0
        for line in httpx.get(self.metrics_url, timeout=5).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """The real stack on test ports, shared by the whole session."""
    cfg = write_settings(tmp_path_factory.mktemp("stack"))
    s = Stack(cfg)
    try:
        s.start()
    except Exception:
        s.stop()
        raise
    yield s
    s.stop()


@pytest.fixture
def client(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def model_dir():
    from llm_engine.weights import resolve_model_dir

    return resolve_model_dir("")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# -- a second adapter process with other settings, against the same Triton ---------------------


class Adapter:
    def __init__(self, stack, tmp_path, triton: dict | None = None, **server):
        cfg = json.loads(stack.sup.config_path.read_text())
        cfg["ServerConfig"].update(server)
        cfg["TritonConfig"].update(triton or {})
        cfg["ServerConfig"]["port"] = stack.settings.server.port + 1
        path = tmp_path / "adapter.json"
        path.write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "model_repository/llm/1")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "adapter", "--config", str(path)], env=env, cwd=ROOT)
        scheme = "https" if server.get("httpsEnabled") else "http"
        self.url = f"{scheme}://127.0.0.1:{cfg['ServerConfig']['port']}"

    def wait(self, **kw):
        deadline = time.monotonic() + 60
        while not self._up(**kw):
            assert time.monotonic() < deadline, "second adapter did not start"
            time.sleep(0.1)

    def _up(self, **kw):
        assert self.proc.poll() is None
        try:
            httpx.get(self.url + "/v2/health/live", timeout=1, **kw)
            return True
        except httpx.HTTPError:
            return False

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def adapter_with(stack, tmp_path):
    started = []

    def start(triton: dict | None = None, **server):
        a = Adapter(stack, tmp_path, triton, **server)
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()


