"""``POST /v2/models/{model}/stopInfer`` through the real stack: the engine ends the request
with what it generated, and the stream or answer ends normally."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.conftest import MODEL_NAME

STOP = f"/v2/models/{MODEL_NAME}/stopInfer"
LONG = 400  # tokens: the request is still running when the stop comes


def _stop_when_running(client: httpx.Client, request_id: str, timeout: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.post(STOP, json={"id": request_id})
        if r.status_code != 404:
            return r
        time.sleep(0.05)
    raise AssertionError(f"{request_id} never showed up as running")


def test_a_stopped_stream_ends_with_what_it_generated(client, stack):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": LONG, "stream": True,
            "ignore_eos": True, "temperature": 0}
    events = []
    with httpx.Client(base_url=stack.url, timeout=120) as streamer:
        with streamer.stream("POST", "/v1/completions", json=body, headers={"req-id": "stop-me-stream"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    stopped = client.post(STOP, json={"id": "stop-me-stream"})
                    assert stopped.status_code == 200 and stopped.json() == {"id": "stop-me-stream"}
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "stop"
    assert 3 <= last["usage"]["completion_tokens"] < LONG
    # it is gone: a second stop finds nothing
    again = client.post(STOP, json={"id": "stop-me-stream"})
    assert again.status_code == 404
    assert again.json() == {"error": "RequestId is stop-me-stream not found.", "error_type": "NotFoundError"}


def _run_in_thread(stack, path: str, body: dict, request_id: str) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        with httpx.Client(base_url=stack.url, timeout=120) as c:
            result["r"] = c.post(path, json=body, headers={"req-id": request_id})

    worker = threading.Thread(target=run)
    worker.start()
    return worker, result


def test_a_stopped_completion_keeps_its_text_and_a_later_request_with_the_id_runs(client, stack):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": LONG, "ignore_eos": True,
            "temperature": 0}
    worker, result = _run_in_thread(stack, "/v1/completions", body, "stop-me-plain")
    time.sleep(0.3)  # some tokens first
    assert _stop_when_running(client, "stop-me-plain").status_code == 200
    worker.join(120)
    out = result["r"].json()
    choice = out["choices"][0]
    assert result["r"].status_code == 200 and choice["finish_reason"] == "stop" and choice["text"]
    assert 0 < out["usage"]["completion_tokens"] < LONG
    assert len(out["usage"]["batch_size"]) == out["usage"]["completion_tokens"]
    # the stop was for the requests running then, not for a new one with the same id
    again = client.post("/v1/completions", json=dict(body, max_tokens=4), headers={"req-id": "stop-me-plain"})
    assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"


def test_a_stopped_infer_reports_stop_sequence(client, stack):
    """/infer has no ignore_eos: near-uniform sampling keeps EOS unlikely for 400 tokens,
    and a request that still ends on its own before the stop is sent again with another seed."""
    for seed in (11, 12, 13):
        params = {"max_new_tokens": LONG, "details": True, "temperature": 5.0, "top_k": 49152, "seed": seed}
        worker, result = _run_in_thread(stack, "/infer", {"inputs": "Hello", "parameters": params},
                                        f"stop-me-infer-{seed}")
        time.sleep(0.3)
        try:
            stopped = _stop_when_running(client, f"stop-me-infer-{seed}", timeout=5)
        except AssertionError:
            worker.join(120)
            continue
        assert stopped.status_code == 200
        worker.join(120)
        details = result["r"].json()["details"]
        assert details["finish_reason"] == "stop_sequence" and 0 < details["generated_tokens"] < LONG
        return
    raise AssertionError("every request ended before it could be stopped")


def test_stop_infer_errors(client):
    assert client.post("/v2/models/other/stopInfer", json={"id": "x"}).json() == {
        "error": "Model other not found.", "error_type": "NotFoundError"}
    for bad in (b"not json", b"[1]", b'{"id": 3}', b'{"id": ""}', b"{}"):
        r = client.post(STOP, content=bad)
        assert r.status_code == 422 and r.json()["error_type"] == "Input Validation Error", bad
    r = client.post(STOP, json={"id": "never-seen"})
    assert r.status_code == 404 and r.json()["error"] == "RequestId is never-seen not found."
    assert client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}).status_code == 200
