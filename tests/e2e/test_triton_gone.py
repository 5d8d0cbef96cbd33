"""Triton unreachable at the adapter's start and mid-run: fast 500s, then reconnection.

Spec §1.2 answers enqueue failures other than argument errors with 500 "Incomplete
Generation" and keeps 503 for a stopping service (and, in this project, for overload), so
an unreachable Triton is a 500 (it was a 503 before the status audit).

A TCP proxy stands between the adapter and the stack's Triton gRPC port; stopping it is
Triton going away (listener gone, open connections reset), starting it is Triton coming back.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.conftest import MODEL_NAME, wait_for

pytestmark = pytest.mark.e2e
GOOD = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}


class TcpProxy:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []

    def start(self) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(64)
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def stop(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() thread; close() alone does not
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        for conn in self._conns:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                # shutdown() first: close() alone leaves a pipe thread blocked in recv() on the
                # socket, which holds it open (no reset is sent) until data comes, and from the
                # adapter's side none may ever come
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()  # with linger 0: a reset, as when a server dies
        self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _post(url: str, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=dict(GOOD, **kw), timeout=60)


def test_triton_unreachable_at_start_and_mid_run(stack, adapter_with):
    host, port = stack.grpc_url.split(":")
    proxy = TcpProxy((host, int(port)))
    a = adapter_with(triton={"grpcAddress": "127.0.0.1", "grpcPort": proxy.port})
    try:
        a.wait()
        # unreachable at start: fast 500s, and readiness says so
        started = time.monotonic()
        r = _post(a.url)
        assert r.status_code == 500, r.text
        assert r.json()["error_type"] == "Incomplete Generation"
        assert "retry-after" not in r.headers
        with httpx.stream("POST", a.url + "/infer", json={"inputs": "Hi", "stream": True}, timeout=60) as s:
            assert s.status_code == 500 and s.read().startswith(b'{"error":')  # before any stream byte
        assert time.monotonic() - started < 5
        # never ready yet: initialising (spec §4), not abnormal
        assert httpx.get(a.url + "/v2/health/ready", timeout=10).status_code == 503
        health = httpx.get(a.url + "/health", timeout=10)
        assert (health.status_code, health.content) == (503, b"")
        assert httpx.get(a.url + "/v2/health/live", timeout=10).status_code == 200
        # Triton comes: the adapter connects
        proxy.start()
        assert wait_for(lambda: _post(a.url).status_code == 200, timeout=30)
        assert httpx.get(a.url + "/v2/health/ready", timeout=10).status_code == 200
        # Triton goes mid-stream: the stream ends with an error event, not a hang
        events: list[str] = []

        def stream():
            with httpx.Client(timeout=60) as c, c.stream("POST", a.url + "/v1/completions", json=dict(
                    GOOD, prompt="Tell a long story", max_tokens=300, ignore_eos=True, stream=True)) as resp:
                for line in resp.iter_lines():
                    if line:
                        events.append(line)

        t = threading.Thread(target=stream)
        t.start()
        assert wait_for(lambda: len(events) >= 2, timeout=30)
        proxy.stop()
        t.join(30)
        assert not t.is_alive(), "the stream hung after Triton went away"
        assert '"error' in events[-1], events[-3:]
        # ready once, not now: abnormal, 500 on every health route (spec §4)
        assert wait_for(lambda: httpx.get(a.url + "/v2/health/ready", timeout=10).status_code == 500, timeout=10)
        assert httpx.get(a.url + "/v2/health/ready", timeout=10).json() == {"message": "Service is abnormal"}
        live = httpx.get(a.url + "/v2/health/live", timeout=10)
        assert (live.status_code, live.json()) == (500, {"message": "Service is abnormal"})
        health = httpx.get(a.url + "/health", timeout=10)
        assert health.status_code == 500 and health.json()["error_type"] == "Incomplete Generation"
        assert httpx.get(a.url + "/health/timed-1", timeout=10).status_code == 500
        started = time.monotonic()
        assert _post(a.url).status_code == 500
        assert time.monotonic() - started < 5
        # a longer outage (gRPC's reconnect backoff would grow), then Triton comes back
        until = time.monotonic() + 8
        while time.monotonic() < until:
            assert _post(a.url).status_code == 500
            time.sleep(0.5)
        proxy.start()
        assert wait_for(lambda: _post(a.url).status_code == 200, timeout=6)
        assert httpx.get(a.url + "/v2/health/live", timeout=10).status_code == 200
        assert wait_for(lambda: httpx.get(a.url + "/health", timeout=10).status_code == 200, timeout=10)
    finally:
        proxy.stop()
