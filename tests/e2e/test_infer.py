"""/infer end to end."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e


def test_non_stream_without_details(client):
    r = client.post("/infer", json={"inputs": "My name is Olivier and I", "parameters": {"max_new_tokens": 5}})
    assert r.status_code == 200
    assert list(r.json()) == ["generated_text"]


def test_non_stream_with_details(client):
    r = client.post("/infer", json={"inputs": "My name is Olivier and I",
                                    "parameters": {"max_new_tokens": 5, "details": True, "seed": 42}})
    body = r.json()
    assert list(body) == ["generated_text", "details"]
    assert body["details"] == {"finish_reason": "length", "generated_tokens": 5, "seed": 42}


def test_default_max_new_tokens_is_20(client):
    r = client.post("/infer", json={"inputs": "Count: 1, 2, 3,", "parameters": {
        "details": True, "top_k": 1}})
    d = r.json()["details"]
    assert d["generated_tokens"] <= 20
    assert isinstance(d["seed"], int) and d["seed"] > 0


def test_stream_events(client):
    with client.stream("POST", "/infer", json={"inputs": "Hello there", "stream": True,
                                               "parameters": {"max_new_tokens": 4, "details": True}}) as r:
        assert r.status_code == 200
        raw = r.read()
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw
    events = [json.loads(e[6:]) for e in raw[:-2].split(b"\n\n")]
    assert len(events) == 4
    first, *middle, last = events
    assert list(first) == ["prefill_time", "decode_time", "token"]
    assert first["prefill_time"] > 0 and first["decode_time"] is None
    for e in middle:
        assert e["prefill_time"] is None and e["decode_time"] > 0
        assert isinstance(e["token"]["text"], str) and len(e["token"]["id"]) == 1
    assert list(last) == ["prefill_time", "decode_time", "generated_text", "details", "token"]
    assert last["token"]["text"] is None
    assert last["details"]["generated_tokens"] == 4
    streamed = first["token"]["text"] + "".join(e["token"]["text"] for e in middle)
    assert last["generated_text"].startswith(streamed)


def test_bad_parameter(client):
    r = client.post("/infer", json={"inputs": "x", "parameters": {"top_p": 1.0}})
    assert r.status_code == 422
    assert r.json()["error_type"] == "Input Validation Error"
    assert client.post("/infer", json={"inputs": "x", "parameters": {"max_new_tokens": 1}}).status_code == 200
