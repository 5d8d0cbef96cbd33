"""Start and stop a private copy of the whole stack (``python -m adapter.launch``) on free ports.

The bench never touches a stack already serving on the configured ports: it writes
a temporary settings file with fresh ports, launches its own supervisor, and sends
it SIGTERM at the end.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "conf" / "config.json"


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that are free on loopback right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_settings(base: Path, target: Path, ports: list[int]) -> dict:
    """Copy ``base`` to ``target`` with the adapter and Triton moved to ``ports`` (4 of them)."""
    cfg = json.loads(base.read_text())
    cfg.setdefault("ServerConfig", {})["port"] = ports[0]
    cfg["ServerConfig"]["httpsEnabled"] = False
    tc = cfg.setdefault("TritonConfig", {})
    tc["httpPort"], tc["grpcPort"], tc["metricsPort"] = ports[1], ports[2], ports[3]
    target.write_text(json.dumps(cfg, indent=2))
    return cfg


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; empty where /proc is missing)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, what: str, log_path: Path,
               poll: float = 0.5) -> None:
    """Return once ``url`` answers 200; raise if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise RuntimeError(f"{what} was not ready in {timeout:.0f}s; see {log_path}")


class Stack:
    """A supervised tritonserver + adapter owned by the bench."""

    def __init__(self, log_path: Path, base_config: Path = DEFAULT_CONFIG):
        self.log_path = log_path
        self.base_config = base_config
        self.tmpdir = tempfile.TemporaryDirectory(prefix="mindie-bench-")
        self.config_path = Path(self.tmpdir.name) / "config.json"
        self.proc: subprocess.Popen | None = None
        self.base_url = ""
        self.model_name = ""

    def start(self, timeout: float = 900.0) -> None:
        ports = free_ports(4)
        cfg = write_settings(self.base_config, self.config_path, ports)
        srv = cfg["ServerConfig"]
        self.base_url = f"http://{srv.get('ipAddress', '127.0.0.1')}:{ports[0]}"
        self.model_name = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"]
        log.info("starting the stack: adapter %s, triton http/grpc/metrics %s (log: %s)",
                 self.base_url, ports[1:], self.log_path)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = self.log_path.open("w")
        from adapter.launch import die_with_parent  # a killed bench must not leave its stack running

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adapter.launch", "--config", str(self.config_path)],
            cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent)
        wait_ready(self.proc, f"{self.base_url}/v2/health/ready", timeout, "the stack", self.log_path, poll=1.0)
        log.info("stack ready")

    def _log_match(self, pattern: str) -> str:
        try:
            m = re.search(pattern, self.log_path.read_text(errors="replace"))
        except OSError:
            return ""
        return m.group(1) if m else ""

    def engine_dtype(self) -> str:
        """The dtype the Triton model chose, from its "engine ready" log line ("" if not found)."""
        return self._log_match(r"engine ready .*?dtype=(\w+)")

    def engine_threads(self) -> str:
        """The model's torch threads on CPU, from its "engine ready" log line ("" if not found)."""
        return self._log_match(r"engine ready .*?threads=(\d+)")

    def rest_cpus(self) -> tuple[int, ...] | None:
        """The CPUs the launcher gave tritonserver and the adapter when it pinned the engine."""
        from llm_engine.cpu_cores import parse_cpus

        found = self._log_match(r"tritonserver and the adapter on CPUs \[([\d, ]*)\]")
        return parse_cpus(found) or None

    def dtype_decision(self) -> str:
        """The model's "dtype auto: ..." timing line, when the settings say ``auto``."""
        return self._log_match(r"dtype auto: ([^\n]*)")

    def stop(self, timeout: float = 90.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            log.info("stopping the stack (pid %d)", self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # tritonserver, its stub and the adapter run in their own sessions: kill them by pid too,
                # or they outlive the launcher holding ports and memory
                strays = descendants(self.proc.pid)
                log.warning("adapter.launch did not stop in %.0fs; killing it and %s", timeout, strays)
                self.proc.kill()
                self.proc.wait()
                for pid in strays:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if self.proc is not None:
            self._log.close()
        self.tmpdir.cleanup()

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
