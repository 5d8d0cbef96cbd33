"""/v1/completions end to end: real adapter -> Triton gRPC stream -> llm model -> engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.e2e


def sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n"), raw[-50:]
    return raw[:-2].split(b"\n\n")


def test_non_stream_shape(client):
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "The capital of France is",
                                              "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["id"].startswith("endpoint_common_")
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    (choice,) = body["choices"]
    assert list(choice) == ["index", "text", "logprobs", "stop_reason", "finish_reason"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["stop_reason"] is None
    assert choice["finish_reason"] == "length" and choice["text"].strip()
    u = body["usage"]
    assert list(u) == ["prompt_tokens", "prompt_tokens_details", "completion_tokens", "total_tokens",
                       "batch_size", "queue_wait_time"]
    assert u["completion_tokens"] == 6 and u["total_tokens"] == u["prompt_tokens"] + 6
    assert u["prompt_tokens_details"] == {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]}
    assert len(u["batch_size"]) == 6 and all(b >= 1 for b in u["batch_size"])
    assert len(u["queue_wait_time"]) == 6 and all(isinstance(w, int) and w >= 0 for w in u["queue_wait_time"])
    assert b'": ' not in r.content  # compact JSON


def test_stream_framing_byte_exact(client):
    with client.stream("POST", "/v1/completions", json={
            "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"  # spec §1.1, without a charset
        raw = r.read()
    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]"
    bodies = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert all(e.startswith(b"data: {") for e in events[:-1])
    assert len(bodies) == 4
    assert len({b["id"] for b in bodies}) == 1
    for b in bodies[:-1]:
        assert b["choices"][0]["finish_reason"] is None and "usage" not in b
    last = bodies[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 4


def test_stream_text_equals_non_stream(client):
    req = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    whole = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json=dict(req, stream=True)) as r:
        raw = r.read()
    parts = [json.loads(e[6:]) for e in sse_events(raw)[:-1]]
    assert "".join(p["choices"][0]["text"] for p in parts) == whole


def test_greedy_is_deterministic(client):
    req = {"model": MODEL_NAME, "prompt": "List three colours:", "max_tokens": 10, "temperature": 0}
    texts = {client.post("/v1/completions", json=req).json()["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 1


def test_openai_client_stream(stack):
    oc = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused")
    stream = oc.completions.create(model=MODEL_NAME, prompt="Tell me a story", max_tokens=5,
                                   temperature=0, stream=True,
                                   extra_body={"ignore_eos": True, "repetition_penalty": 1.1})
    chunks = list(stream)
    assert len(chunks) == 5
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)


def test_openai_client_non_stream(stack):
    oc = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused")
    out = oc.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, temperature=0,
                                extra_body={"top_k": 5, "skip_special_tokens": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3


def test_bad_request_then_good(client):
    bad = client.post("/v1/completions", content=b"{not json")
    assert bad.status_code == 422
    assert bad.json() == {"error": "Failed to parse request context to json", "error_type": "Input Validation Error"}
    ok = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_models_and_health(client):
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL_NAME
    # the weights' name, not the cache folder the GGUF was converted into
    assert models["data"][0]["root"] == "SmolLM2-135M-Instruct.Q4_1"
    assert client.get("/nope").status_code == 404


def test_unknown_route_is_empty_404(client):
    r = client.get("/v1/chat/unknown")
    assert r.status_code == 404 and r.content == b""
    # a trailing slash is another path, not a redirect (Starlette's default answered 307)
    for method, path in (("POST", "/v1/completions/"), ("POST", "/infer/"), ("GET", "/v1/models/"),
                         ("GET", "/health/")):
        r = client.request(method, path, json={})
        assert (r.status_code, r.content) == (404, b""), path


def test_timed_health_probe_and_static_config(client, stack):
    """Spec §4: ``/health/timed[-N]`` runs a one-token probe (N in [1, 600]); ``/v1/config``."""
    for path in ("/health/timed", "/health/timed-5", "/health/timed-600"):
        r = client.get(path)
        assert (r.status_code, r.json()) == (200, {"status": "healthy"}), path
    for path, message in (("/health/timed-0", "Wait time should be in range of [1, 600], input is not valid"),
                          ("/health/timed-601", "Wait time should be in range of [1, 600], input is not valid"),
                          ("/health/timed-1000", "Max wait time is 600, input is invalid or too long")):
        r = client.get(path)
        assert r.status_code == 404 and r.json() == {"error": message, "error_type": "NotFoundError"}, path
    assert (client.get("/health/timed-x").status_code, client.get("/health/timed-x").content) == (404, b"")
    cfg = client.get("/v1/config")
    assert cfg.status_code == 200
    body = cfg.json()
    assert list(body) == ["modelName", "maxSeqLen", "npuMemSize", "cpuMemSize", "worldSize", "maxOutputLen",
                          "cacheBlockSize"]
    sched, deploy = stack.settings.schedule, stack.settings.deploy
    assert body == {"modelName": MODEL_NAME, "maxSeqLen": deploy.maxSeqLen,
                    "npuMemSize": sched.kvCacheMemoryMiB / 1024, "cpuMemSize": 0, "worldSize": 1,
                    "maxOutputLen": sched.maxIterTimes, "cacheBlockSize": sched.cacheBlockSize}


def test_infer_token_is_the_infer_handler(client):
    """Spec §1.1/§3.1: ``POST /infer_token`` is served by the same handler as ``/infer``."""
    body = {"input_id": [1, 504, 3458, 314], "parameters": {"max_new_tokens": 3, "do_sample": False,
                                                            "details": True, "seed": 7}}
    a = client.post("/infer", json=body)
    b = client.post("/infer_token", json=body)
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json() and b.json()["details"]["generated_tokens"] == 3
    bad = client.post("/infer_token", json={"inputs": "x", "parameters": {"temperature": -1}})
    assert bad.status_code == 422 and bad.json()["error_type"] == "Input Validation Error"


def test_concurrent_requests_batch_together(stack):
    import asyncio

    async def run():
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as ac:
            reqs = [ac.post("/v1/completions", json={"model": MODEL_NAME, "prompt": f"Number {i}:",
                                                      "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                    for i in range(6)]
            return await asyncio.gather(*reqs)

    results = asyncio.run(run())
    assert all(r.status_code == 200 for r in results)
    peak = max(max(r.json()["usage"]["batch_size"]) for r in results)
    assert peak >= 2, "concurrent requests should share engine steps"


def test_latency_metrics_of_a_non_stream_request(stack):
    """A non-stream request gets one response, at its end; TTFT and the time per output
    token still come from when the engine sampled its first token."""
    import time

    from tests.conftest import wait_for

    ttft, tpot = "llm_time_to_first_token_seconds", "llm_time_per_output_token_seconds"
    names = [f"{m}_{part}" for m in (ttft, tpot) for part in ("sum", "count")]
    before = {n: stack.engine_metric(n) for n in names}
    t0 = time.monotonic()
    r = httpx.post(stack.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Tell me about the sea",
                                                        "max_tokens": 24, "temperature": 0, "ignore_eos": True},
                   timeout=120)
    latency = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
    assert wait_for(lambda: stack.engine_metric(f"{tpot}_count") >= before[f"{tpot}_count"] + 1, timeout=10)
    d = {n: stack.engine_metric(n) - before[n] for n in names}
    assert d[f"{ttft}_count"] == 1 and d[f"{tpot}_count"] == 1, d
    assert 0 < d[f"{ttft}_sum"] < latency / 2, (d, latency)  # the first of 24 tokens came early
    assert 0 < d[f"{tpot}_sum"] and 23 * d[f"{tpot}_sum"] < latency, (d, latency)


def test_metrics_carry_mindie_names_from_the_engine(client, stack):
    """Spec §4: ``/metrics`` has MindIE's names with ``model_name`` (the engine's counts, relayed)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.conftest import wait_for

    def values() -> dict:
        text = client.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.labels.get("model_name") == MODEL_NAME}

    before = values()
    for name in ("request_received_total", "request_success_total", "request_failed_total", "num_requests_running",
                 "num_requests_waiting", "time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
                 "npu_cache_usage_perc"):
        assert name in before, name
    assert client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3,
                                                "ignore_eos": True}).status_code == 200

    def moved() -> bool:  # counters reach Triton a few times a second
        after = values()
        return (after["e2e_request_latency_seconds_count"] > before["e2e_request_latency_seconds_count"]
                and after["request_received_total"] >= before["request_received_total"] + 1
                and after["request_success_total"] >= before["request_success_total"] + 1
                and after["generation_tokens_total"] >= before["generation_tokens_total"] + 3)

    assert wait_for(moved, timeout=10)
