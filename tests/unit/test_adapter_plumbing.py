"""Adapter and launcher pieces that need no server: the slow-reader guard, /dev/shm cleanup,
the mapping of engine and Triton failures to MindIE statuses."""

from __future__ import annotations

import asyncio
from unittest.mock import AsyncMock

import pytest
from fastapi import Request
from llm_engine.config import Settings

from adapter.app import create_app
from adapter.errors import overloaded_error
from adapter.launch import accelerator_present, engine_cores, remove_shm_leftovers
from adapter.service import BoundedStreamingResponse, SlowReader, to_mindie
from adapter.triton import TritonError, TritonUnavailable


def test_a_stalled_write_cancels_the_stream_and_closes_its_source():
    closed = asyncio.Event()
    produced = []

    async def events():
        try:
            for i in range(1000):
                produced.append(i)
                yield b"data: {}\n\n"
        finally:
            closed.set()

    async def send(message):
        if message["type"] == "http.response.body" and len(produced) > 3:
            await asyncio.sleep(3600)  # the client stopped reading

    async def run():
        response = BoundedStreamingResponse(events(), "req-1", write_timeout=0.2)
        with pytest.raises(SlowReader):
            await response.stream_response(send)
        assert closed.is_set()

    asyncio.run(run())
    assert len(produced) < 10  # nothing is produced ahead of what the client takes


def test_a_reading_client_gets_every_event():
    sent = []

    async def events():
        for i in range(5):
            yield f"data: {i}\n\n".encode()

    async def send(message):
        sent.append(message)

    asyncio.run(BoundedStreamingResponse(events(), "req-2", write_timeout=0.2).stream_response(send))
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies[:5] == [f"data: {i}\n\n".encode() for i in range(5)] and sent[-1]["more_body"] is False


def test_shm_leftovers_of_a_stopped_tritonserver_are_removed(tmp_path):
    mine = tmp_path / "mindie_triton_42_0_3f2a"
    other = tmp_path / "mindie_triton_42_1_aa00"  # a later run: still in use
    foreign = tmp_path / "triton_python_backend_shm_region_1"
    flags = tmp_path / "mindie-triton-cancel-777"
    for f in (mine, other, foreign):
        f.write_bytes(b"x")
    flags.mkdir()
    (flags / "llm_unary-0123").write_text("")
    removed = remove_shm_leftovers("mindie_triton_42_0_", 777, shm=tmp_path)
    assert sorted(removed) == ["mindie-triton-cancel-777", "mindie_triton_42_0_3f2a"]
    assert other.exists() and foreign.exists() and not mine.exists() and not flags.exists()


@pytest.mark.parametrize("error, status, error_type, retry_after", [
    (TritonError(400, "top_p must be in (1e-06, 1.0], got 0"), 422, "Input Validation Error", None),
    (TritonError(424, "Failed to enqueue inferRequest. Invalid Input Ids"), 424, "Generation Error", None),
    (TritonError(500, "generation failed: boom"), 500, "Incomplete Generation", None),
    (TritonError(504, "Engine callback timeout: client timeout"), 500, "Incomplete Generation", None),
    # spec §1.2: "other enqueue failures" are 500, 503 is for a stopping service ...
    (TritonUnavailable("Triton is unavailable: UNAVAILABLE: failed to connect"), 500, "Incomplete Generation",
     None),
    # ... and, the project's deliberate addition, for overload (load shedding, with Retry-After)
    (TritonError(503, "the engine queue is full (2000 waiting requests)"), 503, "Service Unavailable", "1"),
])
def test_engine_and_triton_failures_map_to_mindie_statuses(error, status, error_type, retry_after):
    err = to_mindie(error)
    assert (err.status, err.error_type, err.message) == (status, error_type, error.message)
    assert err.headers.get("Retry-After") == retry_after


def test_error_headers_reach_the_response():
    from fastapi.testclient import TestClient

    app = create_app(Settings(), tokenizer=object())

    @app.get("/boom")
    async def boom():
        raise overloaded_error("the engine queue is full")

    r = TestClient(app).get("/boom")  # no lifespan: no Triton client is needed
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.content == b'{"error":"the engine queue is full","error_type":"Service Unavailable"}'


def test_an_unexpected_error_is_a_500_in_the_mindie_envelope():
    from fastapi.testclient import TestClient

    app = create_app(Settings(), tokenizer=object())

    @app.get("/bug")
    async def bug():
        raise OverflowError("Python int too large to convert to C long")

    r = TestClient(app, raise_server_exceptions=False).get("/bug")
    assert r.status_code == 500
    assert r.json() == {"error": "Failed to get engine response.", "error_type": "Incomplete Generation"}


def test_an_accelerator_device_node_means_the_engine_may_not_be_on_the_cpu(tmp_path):
    assert not accelerator_present(tmp_path)
    (tmp_path / "nvidiactl").touch()  # the driver alone, no GPU
    assert not accelerator_present(tmp_path)
    (tmp_path / "davinci0").touch()
    assert accelerator_present(tmp_path)


def _settings(tmp_path, device: str, affinity: str):
    from llm_engine.config import load_settings

    from tests.conftest import write_settings

    settings = load_settings(write_settings(tmp_path))
    settings.model.device, settings.model.cpuAffinity = device, affinity
    return settings


@pytest.mark.parametrize("device, affinity", [("cuda", "auto"), ("npu", "auto"), ("cpu", "off")])
def test_the_launcher_pins_nothing_off_the_cpu_or_when_told(device, affinity, tmp_path):
    from tests.conftest import ROOT

    assert engine_cores(_settings(tmp_path, device, affinity), ROOT / "model_repository") is None


def test_the_launcher_splits_by_the_models_instance_count(tmp_path, monkeypatch):
    from llm_engine.cpu_cores import CoreSplit

    from tests.conftest import ROOT

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MINDIE_ENGINE_CPUS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr("llm_engine.cpu_cores.cpu_quota", lambda: None)
    settings = _settings(tmp_path, "cpu", "auto")
    monkeypatch.setattr("llm_engine.cpu_cores.shutil.which", lambda name: f"/usr/bin/{name}")
    assert engine_cores(settings, ROOT / "model_repository") is None  # the fused kernels take every core
    settings.model.cpuKernels = "off"  # the torch path leaves a core to the rest
    assert engine_cores(settings, ROOT / "model_repository") == CoreSplit(engine=(1, 2, 3), rest=(0,))
    repo = tmp_path / "repo"
    (repo / "llm").mkdir(parents=True)
    config = (ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    assert "count: 1," in config
    (repo / "llm" / "config.pbtxt").write_text(config.replace("count: 1,", "count: 2,"))
    assert engine_cores(settings, repo) is None


def test_the_supervisors_health_checks_reuse_one_client_and_leave_no_connection_open(tmp_path, monkeypatch):
    """A fresh client per check built an SSL context each time (~55 ms of CPU every 2 s);
    a kept-alive connection made tritonserver wait out its exit timeout and orphan the stubs."""
    import http.server
    import threading

    import httpx

    from adapter import launch
    from tests.conftest import ROOT, write_settings

    connections, closed_by_client = [], []

    class Ready(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            connections.append(self.client_address)
            super().setup()

        def do_GET(self):
            closed_by_client.append(self.headers.get("Connection", "").lower() == "close")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    built = []

    class CountingClient(httpx.Client):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(launch.httpx, "Client", CountingClient)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = write_settings(tmp_path, TritonConfig={"httpAddress": "127.0.0.1",
                                                        "httpPort": server.server_address[1]})
        sup = launch.Supervisor(config, ROOT / "model_repository")
        assert all(sup._triton_ready() for _ in range(5))
        assert sup._triton_live()
        assert len(built) == 1  # one client, one SSL context
        assert len(connections) == 6 and all(closed_by_client)  # nothing left open for Triton to wait on
    finally:
        server.shutdown()


def test_next_within_hands_on_items_and_times_out_a_stalled_source():
    from adapter.service import next_within

    async def source():
        yield 1
        await asyncio.sleep(10)
        yield 2

    async def run():
        gen = source()
        first = await next_within(gen, 1.0)
        with pytest.raises(asyncio.TimeoutError):
            await next_within(gen, 0.05)
        await gen.aclose()
        return first

    assert asyncio.run(run()) == 1


def test_a_short_body_is_parsed_on_the_event_loop_and_a_long_one_in_a_worker_thread():
    import threading
    from types import SimpleNamespace

    from adapter.service import INLINE_PARSE_BYTES, Service

    threads = []

    def parser(raw, settings, tokenize, vocab_size):
        threads.append(threading.get_ident())
        return SimpleNamespace(prompt_ids=None, prompt_text=raw.decode(), tokens=tokenize(raw.decode()))

    svc = SimpleNamespace(settings=None, vocab_size=10, tokenizer=lambda text: SimpleNamespace(input_ids=[len(text)]))

    async def run():
        loop_thread = threading.get_ident()
        short = await Service.plan(svc, parser, b"x" * INLINE_PARSE_BYTES)
        long = await Service.plan(svc, parser, b"x" * (INLINE_PARSE_BYTES + 1))
        return loop_thread, short, long

    loop_thread, short, long = asyncio.run(run())
    assert threads[0] == loop_thread and threads[1] != loop_thread
    # the text was tokenized once, in the parser, and the plan carries those ids
    assert short.prompt_ids == [INLINE_PARSE_BYTES] and long.prompt_ids == [INLINE_PARSE_BYTES + 1]


def test_a_stalled_write_times_out_through_the_same_deadline_as_the_model_wait():
    from adapter.service import within

    async def run():
        assert await within(asyncio.sleep(0, result=7), 1.0) == 7
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(10), 0.05)

    asyncio.run(run())


def test_preparing_the_backend_twice_leaves_what_is_right_and_replaces_what_is_not(tmp_path):
    """A second launcher from the same checkout must not pull a running one's files away:
    links and the stub already right are left as they are; a stale stub is replaced whole."""
    from adapter.tritonserver import prepare_backend

    paths = prepare_backend(tmp_path)
    python_dir = paths.backend_dir / "python"
    stub = python_dir / "triton_python_backend_stub"
    before = {p.name: p.lstat().st_ino for p in python_dir.iterdir()}
    assert set(before) == {"libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"}
    assert all((python_dir / name).resolve().is_file() for name in before)
    prepare_backend(tmp_path)
    assert {p.name: p.lstat().st_ino for p in python_dir.iterdir()} == before
    source = stub.read_bytes()
    stub.write_bytes(b"stale")  # an older stub, same inode: a rename must replace it
    (python_dir / "libtriton_python.so").unlink()
    prepare_backend(tmp_path)
    assert stub.read_bytes() == source and stub.stat().st_ino != before["triton_python_backend_stub"]
    assert (python_dir / "libtriton_python.so").resolve().is_file()
    assert sorted(p.name for p in python_dir.iterdir()) == sorted(before)  # no temporary left


def test_the_launcher_refuses_to_start_while_another_server_holds_the_adapters_port(tmp_path):
    """Otherwise the readiness check could be answered by that other server."""
    import socket

    from adapter.launch import Supervisor
    from tests.conftest import ROOT, write_settings

    def free_port() -> int:  # not the run's base: the session's stack may hold those
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        config = write_settings(tmp_path, ServerConfig={"port": port}, TritonConfig={
            "httpPort": free_port(), "grpcPort": free_port(), "metricsPort": free_port()})
        sup = Supervisor(config, ROOT / "model_repository")
        with pytest.raises(RuntimeError, match=f"port 127.0.0.1:{port} is already in use"):
            sup.start_triton()
    assert sup.triton is None


def test_the_test_run_picks_ports_no_other_server_holds():
    import socket

    from tests.conftest import _pick_port_base, _ports_free

    base = int(_pick_port_base())
    assert _ports_free(base)
    with socket.socket() as other:
        # as a server does: the port may still hold TIME_WAIT connections of an earlier stack
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", base + 25))
        other.listen()
        assert not _ports_free(base)
        assert int(_pick_port_base()) != base


def test_the_timed_health_probe_reports_a_hang_an_error_and_a_token():
    """``/health/timed-N``: one token through Triton within N seconds, else MindIE's 500 text."""
    import asyncio
    from types import SimpleNamespace

    from adapter import management
    from adapter.triton import Chunk, TritonError

    def chunk(tokens: int) -> Chunk:
        return Chunk(index=0, text="", token_ids=[], finish_reason="length", prompt_tokens=1, cached_tokens=0,
                     completion_tokens=tokens, cumulative_logprob=0.0, seed=0, batch_size=[], queue_wait_us=[],
                     logprobs=None, final=True)

    seen = []

    def service(generate):
        ids = iter(range(100))
        return SimpleNamespace(triton=SimpleNamespace(generate=generate), probe_token_id=1,
                               next_request_id=lambda: f"endpoint_common_{next(ids)}")

    async def one(request_id, sampling, **kw):
        seen.append((request_id, sampling, kw["prompt_ids"]))
        yield chunk(1)

    async def hang(request_id, sampling, **kw):
        await asyncio.sleep(30)
        yield chunk(1)

    async def fail(request_id, sampling, **kw):
        raise TritonError(500, "the model is gone")
        yield

    assert asyncio.run(management.probe(service(one), 5)) is None
    assert seen == [("endpoint_common_0", {"max_tokens": 1, "temperature": 0, "ignore_eos": True}, [1])]
    assert asyncio.run(management.probe(service(hang), 0.2)) == "Health probe timed out after 0.2 s"
    assert asyncio.run(management.probe(service(fail), 5)) == "Health probe failed: the model is gone"


def test_a_client_gone_while_its_body_is_read_is_a_quiet_499(caplog):
    """Starlette's ClientDisconnect once fell to the catch-all: a 500 and a traceback in the log."""
    app = create_app(Settings(), tokenizer=object())

    @app.post("/upload")
    async def upload(request: Request):
        await request.body()

    sent = []
    receive = AsyncMock(return_value={"type": "http.disconnect"})

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/upload", "raw_path": b"/upload", "query_string": b"",
             "headers": [], "root_path": "", "scheme": "http", "server": ("127.0.0.1", 80), "app": app}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
