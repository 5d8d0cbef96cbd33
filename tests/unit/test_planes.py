"""MindIE's business, management and metrics planes: which listener serves which route."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys

import httpx
import pytest
from llm_engine.config import ServerSection

from adapter.planes import BUSINESS, MANAGEMENT, METRICS, Listener, listeners, plane_of
from tests.conftest import ROOT, wait_for, write_settings


def test_unset_planes_share_the_business_listener():
    assert listeners(ServerSection()) == [Listener("127.0.0.1", 1025, frozenset({BUSINESS, MANAGEMENT, METRICS}))]


def test_mindie_planes_get_their_own_listeners(monkeypatch):
    srv = ServerSection(ipAddress="0.0.0.0", allowAllZeroIpListening=True, port=1025, managementIpAddress="127.0.0.2",
                        managementPort=1026, metricsPort=1027)
    assert listeners(srv) == [Listener("0.0.0.0", 1025, frozenset({BUSINESS})),
                              Listener("127.0.0.2", 1026, frozenset({MANAGEMENT})),
                              Listener("127.0.0.2", 1027, frozenset({METRICS}))]
    # a port shared by two planes is one listener
    shared = ServerSection(port=1025, managementIpAddress="127.0.0.2", managementPort=1026, metricsPort=1026)
    assert listeners(shared)[1] == Listener("127.0.0.2", 1026, frozenset({MANAGEMENT, METRICS}))
    monkeypatch.setenv("MIES_CONTAINER_IP", "10.0.0.5")
    monkeypatch.setenv("MIES_CONTAINER_MANAGEMENT_IP", "10.0.0.6")
    assert [(x.host, x.port) for x in listeners(srv)] == [("10.0.0.5", 1025), ("10.0.0.6", 1026), ("10.0.0.6", 1027)]


@pytest.mark.parametrize("path, plane", [
    ("/v1/completions", BUSINESS), ("/infer", BUSINESS), ("/infer_token", BUSINESS), ("/v1/models", BUSINESS),
    ("/v2/models/m/stopInfer", BUSINESS), ("/health", MANAGEMENT), ("/v2/health/live", MANAGEMENT),
    ("/v2/health/ready", MANAGEMENT), ("/v2/models/m/ready", MANAGEMENT), ("/health/timed", MANAGEMENT),
    ("/health/timed-5", MANAGEMENT), ("/v1/config", MANAGEMENT), ("/metrics", METRICS), ("/nope", BUSINESS),
])
def test_each_route_has_a_plane(path, plane):
    assert plane_of(path) == plane


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_adapter_serves_each_plane_on_its_own_port_only(tmp_path):
    """The real adapter process (no Triton is needed for these routes)."""
    business, management, metrics = _free_port(), _free_port(), _free_port()
    config = write_settings(tmp_path, ServerConfig={"port": business, "managementIpAddress": "127.0.0.1",
                                                    "managementPort": management, "metricsPort": metrics},
                            TritonConfig={"httpPort": _free_port(), "grpcPort": _free_port(),
                                          "metricsPort": _free_port()})
    env = dict(os.environ, MIES_SERVICE_MONITOR_MODE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "model_repository/llm/1")]))
    proc = subprocess.Popen([sys.executable, "-m", "adapter", "--config", str(config)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{management}/v2/health/live", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, timeout=120), "the adapter did not start"

        def status(port: int, path: str) -> tuple[int, bytes]:
            r = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)
            return r.status_code, r.content if r.status_code == 404 else b"..."

        assert status(business, "/v1/models")[0] == 200
        assert status(management, "/v1/models") == (404, b"")
        assert status(metrics, "/v1/models") == (404, b"")
        assert status(management, "/v1/config")[0] == 200
        assert status(business, "/v2/health/live") == (404, b"")
        assert status(business, "/metrics") == (404, b"")
        assert status(management, "/metrics") == (404, b"")
        assert status(metrics, "/metrics")[0] == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_container_health_check_probes_the_management_listener():
    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "docker" / "healthcheck.py")
    healthcheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(healthcheck)
    assert healthcheck.management_listener({"ipAddress": "0.0.0.0", "port": 1025}) == ("0.0.0.0", 1025)
    assert healthcheck.management_listener({"ipAddress": "0.0.0.0", "port": 1025, "managementPort": 1025,
                                            "managementIpAddress": "127.0.0.2"}) == ("0.0.0.0", 1025)
    assert healthcheck.management_listener({"port": 1025, "managementIpAddress": "127.0.0.2",
                                            "managementPort": 1026}) == ("127.0.0.2", 1026)


def test_accepted_connections_send_small_writes_at_once():
    """The adapter's listeners set TCP_NODELAY, which accepted connections inherit: asyncio
    sets it only on sockets it creates, and without it a response written as headers then
    body waited for the client's delayed ACK (44 ms for each GET with a body on a
    keep-alive connection, against ~1 ms with it)."""
    from adapter.__main__ import _listen

    listener = _listen(Listener("127.0.0.1", 0, frozenset({BUSINESS})), write_timeout=5.0)
    try:
        with socket.create_connection(listener.getsockname()):
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        listener.close()


def test_connections_that_send_no_whole_request_head_are_closed_and_do_not_starve_health_probes(tmp_path):
    """uvicorn counts open connections against limit_concurrency (3 x maxLinkNum + 64) and
    closed none that never sent a request: 67 idle sockets at maxLinkNum 1 made every route,
    health probes included, answer 503 for good. A head must now arrive within the
    keep-alive time, however slowly it is sent."""
    import time

    port = _free_port()
    config = write_settings(tmp_path, ServerConfig={"port": port, "maxLinkNum": 1},
                            TritonConfig={"httpPort": _free_port(), "grpcPort": _free_port(),
                                          "metricsPort": _free_port()})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "model_repository/llm/1")]))
    proc = subprocess.Popen([sys.executable, "-m", "adapter", "--config", str(config)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    idle: list[socket.socket] = []
    try:
        def live() -> int:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=2).status_code
            except httpx.HTTPError:
                return 0

        assert wait_for(lambda: live() == 200, timeout=120), "the adapter did not start"
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(70)]
        dribbler = idle[0]
        opened = time.monotonic()
        try:
            for byte in b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n":  # a byte every 0.3 s: 10 s in all
                dribbler.sendall(bytes([byte]))
                time.sleep(0.3)
            raise AssertionError("a head dribbled for 10 s was not cut off")
        except (BrokenPipeError, ConnectionResetError):
            assert 4 < time.monotonic() - opened < 8  # the keep-alive time (5 s) from its opening
        assert wait_for(lambda: live() == 200, timeout=10)
        for sock in idle:  # each was closed by the server
            sock.settimeout(5)
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
        assert time.monotonic() - opened < 15
    finally:
        for sock in idle:
            sock.close()
        proc.terminate()
        proc.wait(30)
