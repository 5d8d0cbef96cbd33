"""Adapter and launcher pieces that need no server: the slow-reader guard, /dev/shm cleanup,
the mapping of engine and Triton failures to MindIE statuses."""

from __future__ import annotations

import asyncio

import pytest

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
    from llm_engine.config import Settings

    from adapter.app import create_app

    app = create_app(Settings(), tokenizer=object())

    @app.get("/boom")
    async def boom():
        raise overloaded_error("the engine queue is full")

    r = TestClient(app).get("/boom")  # no lifespan: no Triton client is needed
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.content == b'{"error":"the engine queue is full","error_type":"Service Unavailable"}'


def test_an_unexpected_error_is_a_500_in_the_mindie_envelope():
    from fastapi.testclient import TestClient
    from llm_engine.config import Settings

    from adapter.app import create_app

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


def _triton_response(outputs: dict, final: bool):
    """A ModelInferResponse as Triton's gRPC frontend sends it: raw little-endian contents."""
    from tritonclient.grpc import service_pb2
    from tritonclient.grpc._infer_result import InferResult
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    response = service_pb2.ModelInferResponse()
    for name, array in outputs.items():
        out = response.outputs.add()
        out.name, out.datatype = name, np_to_triton_dtype(array.dtype)
        out.shape.extend([1, array.size])
        raw = serialize_byte_tensor(array).item() if array.dtype == object else array.tobytes()
        response.raw_output_contents.append(raw)
    response.parameters["triton_final_response"].bool_param = final
    return InferResult(response)


def test_a_response_is_read_in_one_pass_with_tritonclients_values():
    import json

    import numpy as np

    from adapter.triton import _chunk

    entries = [{"token": "好", "logprob": -0.25, "top": [["好", -0.25]]}]
    outputs = {
        "text_output": np.array(["好，".encode()], dtype=object),
        "index": np.array([2], np.int32),
        "token_ids": np.array([17, 2**40], np.int64),
        "finish_reason": np.array([b"length"], dtype=object),
        "prompt_tokens": np.array([15], np.int32),
        "cached_tokens": np.array([3], np.int32),
        "completion_tokens": np.array([64], np.int32),
        "cumulative_logprob": np.array([-1.375], np.float32),
        "seed": np.array([2**63 + 5], np.uint64),
        "batch_size": np.array([1, 8, 32], np.int32),
        "queue_wait_us": np.array([455, 0, 2**35], np.int64),
        "logprobs": np.array([json.dumps(entries).encode()], dtype=object),
    }
    result = _triton_response(outputs, final=True)
    chunk = _chunk(result)
    assert (chunk.text, chunk.index, chunk.token_ids, chunk.finish_reason) == ("好，", 2, [17, 2**40], "length")
    assert (chunk.prompt_tokens, chunk.cached_tokens, chunk.completion_tokens) == (15, 3, 64)
    assert (chunk.cumulative_logprob, chunk.seed, chunk.final) == (-1.375, 2**63 + 5, True)
    assert (chunk.batch_size, chunk.queue_wait_us, chunk.logprobs) == ([1, 8, 32], [455, 0, 2**35], entries)
    for name in ("token_ids", "batch_size", "queue_wait_us"):  # the same values as tritonclient's reader
        assert getattr(chunk, name) == result.as_numpy(name).reshape(-1).tolist()


def test_outputs_a_request_did_not_ask_for_read_as_neutral_values():
    import numpy as np

    from adapter.triton import _chunk

    chunk = _chunk(_triton_response({"text_output": np.array([b" Paris"], dtype=object),
                                     "completion_tokens": np.array([1], np.int32)}, final=False))
    assert (chunk.text, chunk.completion_tokens, chunk.final) == (" Paris", 1, False)
    assert (chunk.index, chunk.token_ids, chunk.finish_reason, chunk.seed, chunk.logprobs) == (0, [], "", 0, None)
    assert (chunk.batch_size, chunk.queue_wait_us, chunk.cumulative_logprob) == ([], [], 0.0)


@pytest.mark.parametrize("endpoint, sampling, logprobs, extra, absent", [
    ("completions", {}, None, {"batch_size", "queue_wait_us"}, {"index", "logprobs", "token_ids"}),
    ("completions", {"n": 2}, None, {"index", "cumulative_logprob"}, {"logprobs"}),
    ("completions", {"best_of": 3, "n": 1}, None, {"index", "cumulative_logprob"}, set()),
    ("completions", {"use_beam_search": True}, None, {"index", "cumulative_logprob"}, set()),
    ("completions", {"logprobs": 2}, 2, {"logprobs"}, {"index"}),
    ("infer", {}, None, {"token_ids", "seed"}, {"index", "logprobs", "batch_size"}),
])
def test_a_request_asks_triton_only_for_the_outputs_its_answer_uses(endpoint, sampling, logprobs, extra, absent):
    from llm_engine.contract import OUTPUTS

    from adapter.protocol.common import GenerationPlan
    from adapter.service import wanted_outputs

    plan = GenerationPlan(endpoint=endpoint, model=None, prompt_text="hi", prompt_ids=None, stream=True,
                          sampling=sampling, logprobs=logprobs)
    names = wanted_outputs(plan)
    assert {"text_output", "finish_reason", "completion_tokens"} | extra <= set(names)
    assert not absent & set(names)
    assert set(names) <= {t.name for t in OUTPUTS} and len(names) == len(set(names))


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


def test_a_finished_generation_overrides_a_cached_not_ready():
    """Readiness is cached for a second; a model that just answered is ready whatever the
    last probe said (CI saw /v2/health/ready stay 503 right after a 200 completion)."""
    import numpy as np

    from adapter.triton import TritonClient

    class Upstream:
        up = False

        async def is_model_ready(self, _model):
            return self.up

        def stream_infer(self, _requests):
            async def answers():
                yield _triton_response({"text_output": np.array([b"ok"], dtype=object)}, final=True), None
            return answers()

    async def scenario():
        client = TritonClient("127.0.0.1:1", "m")
        client._client = upstream = Upstream()
        assert not await client.ready()
        upstream.up = True  # Triton came; the cached probe still says no
        assert not await client.ready()
        chunks = [c async for c in client.generate("r1", {}, prompt_text="hi")]
        assert [c.text for c in chunks] == ["ok"] and chunks[-1].final
        assert await client.ready()

    asyncio.run(scenario())


def test_a_finished_requests_stream_is_read_to_its_end_not_cancelled(monkeypatch):
    """Dropping the stream after the final response cancelled it as Triton completed it,
    which left the RPC stuck holding the model: shutdown then never unloaded it."""
    import numpy as np

    from adapter import triton
    from adapter.triton import TritonClient

    class Call:
        def __init__(self, ends: bool):
            self.items = [_triton_response({"text_output": np.array([b"a"], dtype=object)}, final=False),
                          _triton_response({"text_output": np.array([b"b"], dtype=object)}, final=True)]
            self.ends, self.ended, self.cancelled = ends, asyncio.Event(), False

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.items:
                return self.items.pop(0), None
            if not self.ends:
                await asyncio.sleep(3600)
            self.ended.set()
            raise StopAsyncIteration

        def cancel(self):
            self.cancelled = True

    class Upstream:
        def __init__(self, call):
            self.call = call

        def stream_infer(self, _requests):
            return self.call

    monkeypatch.setattr(triton, "STREAM_END_SECONDS", 0.2)

    async def scenario(call: Call) -> list[str]:
        client = TritonClient("127.0.0.1:1", "m")
        client._client = Upstream(call)
        texts = []
        async for chunk in client.generate("r1", {}, prompt_text="hi"):
            texts.append(chunk.text)
            if chunk.final:
                break  # the caller leaves at the final response, as the endpoints do
        await asyncio.sleep(0.5)
        return texts

    ends = Call(ends=True)
    assert asyncio.run(scenario(ends)) == ["a", "b"]
    assert ends.ended.is_set() and not ends.cancelled
    hangs = Call(ends=False)  # a stream that never ends is cancelled after STREAM_END_SECONDS
    assert asyncio.run(scenario(hangs)) == ["a", "b"]
    assert hangs.cancelled
