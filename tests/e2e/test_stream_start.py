"""Spec §1.2: validation, tokenisation and enqueue finish before the first stream byte, so an
enqueue failure is plain JSON with its status even with ``stream: true``; a stream that starts
still sends every step as it is made."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.e2e
TOO_LONG = "hello " * 3000  # > maxInputTokenLen (2048) tokens: the engine rejects it at enqueue
VOCAB = 49152  # SmolLM2's vocabulary: token id 49152 passes validation, the engine rejects it

CASES = {
    "completions-too-long": ("/v1/completions", {"model": MODEL_NAME, "prompt": TOO_LONG, "max_tokens": 2}),
    "completions-bad-ids": ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, VOCAB], "max_tokens": 2}),
    "completions-negative-ids": ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, -5], "max_tokens": 2}),
    # found by the fuzz test: an id beyond INT64 crashed the adapter with a 500
    "completions-huge-ids": ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 2**70], "max_tokens": 2}),
    "infer-too-long": ("/infer", {"inputs": TOO_LONG, "parameters": {"max_new_tokens": 2}}),
    "infer-bad-ids": ("/infer", {"input_id": [1, VOCAB], "parameters": {"max_new_tokens": 2}}),
}


@pytest.mark.parametrize("case", CASES)
def test_enqueue_rejection_is_the_same_json_with_or_without_stream(client, case):
    path, body = CASES[case]
    plain = client.post(path, json=body)
    with client.stream("POST", path, json=dict(body, stream=True)) as r:
        streamed_status, streamed_type, streamed = r.status_code, r.headers["content-type"], r.read()
    assert plain.status_code == 424, plain.text
    assert plain.json()["error_type"] == "Generation Error"
    assert plain.json()["error"].startswith("Failed to enqueue inferRequest. ")
    if case.endswith("-ids"):
        assert plain.json()["error"] == "Failed to enqueue inferRequest. Invalid Input Ids"
    else:
        assert "cannot be greater than 2048,the input ids length is" in plain.json()["error"]
    assert (streamed_status, streamed_type) == (424, "application/json")
    assert streamed == plain.content  # byte for byte, no "data: " framing
    good = {"/v1/completions": {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
            "/infer": {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}}[path]
    assert client.post(path, json=dict(good, stream=True)).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Count to fifty:", "max_tokens": 32, "ignore_eos": True,
                         "temperature": 0}),
    ("/infer", {"inputs": "Count to fifty:", "parameters": {"max_new_tokens": 32, "do_sample": False}}),
])
def test_a_started_stream_sends_each_step_as_it_comes(client, path, body):
    """Waiting for the first response must not turn the stream into one late burst: the first
    event arrives long before the last, and each step is its own event, in order."""
    arrivals, events = [], []
    t0 = time.monotonic()
    with client.stream("POST", path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - t0)
                events.append(line[6:])
    if path == "/v1/completions":
        assert events[-1] == "[DONE]"
        events = events[:-1]
        arrivals = arrivals[:-1]
    assert len(events) == 32
    assert arrivals[0] < 0.5 * arrivals[-1], arrivals  # the first token was not held back
    bodies = [json.loads(e) for e in events]
    if path == "/infer":
        assert bodies[0]["prefill_time"] > 0 and bodies[0]["decode_time"] is None
        assert all(b["prefill_time"] is None for b in bodies[1:])
    else:
        assert [b["choices"][0]["finish_reason"] for b in bodies] == [None] * 31 + ["length"]
