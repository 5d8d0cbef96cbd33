"""MindIE protocol features through the real stack: n/best_of, beam search, logprobs, stops
(fullTextEnabled on both endpoints: test_params_e2e.py)."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.e2e
BASE = {"model": MODEL_NAME, "prompt": "The weather today is", "max_tokens": 6}


def events(raw: bytes) -> list:
    return [e[6:] for e in raw[:-2].split(b"\n\n")]


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": "x"}, 422, "Request contains not model or model null"),
    (dict(BASE, model="other"), 422, "Not found given model, please check modelName in config file."),
    (dict(BASE, top_p=0), 422, "Parameter top_p must be in (1e-6,1.0], got 0."),
    (dict(BASE, repetition_penalty=3), 422, "Parameter 'repetition_penalty' must be in (0.0, 2], got 3."),
    (dict(BASE, logprobs=6), 422, "logprobs should be in range [0, 5], got 6."),
    (dict(BASE, max_tokens=0), 422, "Parameter max_tokens must be (0,2147483647], got 0"),
    (dict(BASE, use_beam_search=True, stop="x", temperature=1), 422, None),
    (dict(BASE, n=2, best_of=1, temperature=1), 422,
     "Best_of must be greater than or equal to n, but best_of is 1 and n is 2."),
    (dict(BASE, n=2, best_of=3, temperature=1, stream=True), 422,
     "best_of must be equal to n, but best_of is 3 and n is 2."),
    (dict(BASE, n=2), 422, None),
])
def test_validation_errors_then_success(client, body, status, message):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error_type"] == "Input Validation Error"
    if message:
        assert r.json()["error"] == message
    assert client.post("/v1/completions", json=BASE).status_code == 200


def test_best_of_returns_best_of_sorted_choices(client):
    r = client.post("/v1/completions", json=dict(BASE, n=2, best_of=3, temperature=1.0, seed=5, logprobs=0,
                                                   ignore_eos=True)).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in r["choices"]]
    assert sums == sorted(sums, reverse=True)
    assert r["usage"]["completion_tokens"] == 18


def test_n_streams_one_choice_per_event(client):
    with client.stream("POST", "/v1/completions", json=dict(BASE, n=2, best_of=2, temperature=1.0, stream=True,
                                                             ignore_eos=True)) as r:
        raw = r.read()
    evs = events(raw)
    assert evs[-1] == b"[DONE]"
    bodies = [json.loads(e) for e in evs[:-1]]
    assert all(len(b["choices"]) == 1 for b in bodies)
    assert {b["choices"][0]["index"] for b in bodies} == {0, 1}
    finishing = [b for b in bodies if b["choices"][0]["finish_reason"]]
    assert len(finishing) == 2 and all(b["usage"]["completion_tokens"] == 6 for b in finishing)


def test_beam_search_non_stream_and_pseudo_stream(client):
    req = dict(BASE, use_beam_search=True, n=2, temperature=1.0)
    body = client.post("/v1/completions", json=req).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    with client.stream("POST", "/v1/completions", json=dict(req, stream=True)) as r:
        raw = r.read()
    evs = events(raw)
    assert len(evs) == 2 and evs[-1] == b"[DONE]"
    streamed = json.loads(evs[0])
    assert [c["text"] for c in streamed["choices"]] == [c["text"] for c in body["choices"]]


def test_beam_search_top_logprobs_list_the_alternatives(client):
    """Spec §2.9: up to k+1 entries a position, the token first, beam search too (it used to
    list the chosen token alone)."""
    req = dict(BASE, use_beam_search=True, n=2, temperature=1.0, logprobs=2)
    for body in (client.post("/v1/completions", json=req).json(),
                 json.loads(events(client.post("/v1/completions", json=dict(req, stream=True)).content)[0])):
        for choice in body["choices"]:
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(lp["top_logprobs"]) > 0
            for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
                assert next(iter(top)) == tok and 2 <= len(top) <= 3


def test_logprobs_shape(client):
    body = client.post("/v1/completions", json=dict(BASE, logprobs=2, temperature=0)).json()
    lp = body["choices"][0]["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert len(lp["tokens"]) == 6 and lp["text_offset"][0] == 0
    for i in range(1, 6):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1].encode())
    for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert next(iter(top)) == tok and 1 <= len(top) <= 3
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]


def test_stop_string_is_removed(client):
    req = dict(BASE, max_tokens=12, temperature=0, ignore_eos=True)
    full = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    body = client.post("/v1/completions", json=dict(req, stop=[stop])).json()
    assert body["choices"][0]["text"] == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] is None
    # the API limits stop strings by total length only: thousands of them work the same
    decoys = [f"<{i:04d}>" for i in range(4000)]
    many = client.post("/v1/completions", json=dict(req, stop=[*decoys, stop], stream=True))
    assert many.status_code == 200
    events = [json.loads(line[6:]) for line in many.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == full[: full.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_infer_multimodal_list_uses_first_text(client):
    r = client.post("/infer", json={"inputs": [{"type": "text", "text": "Hello"}],
                                    "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and "generated_text" in r.json()
    # spec §3.4: a valid media element is validated, then ignored by a text-only model
    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="
    greedy = {"max_new_tokens": 4, "do_sample": False}
    with_media = client.post("/infer", json={"inputs": [{"type": "text", "text": "Hello"},
                                                         {"type": "image_url", "image_url": png}], "parameters": greedy})
    alone = client.post("/infer", json={"inputs": [{"type": "text", "text": "Hello"}], "parameters": greedy})
    assert with_media.status_code == 200 and with_media.json() == alone.json()
    bad = client.post("/infer", json={"inputs": [{"type": "image_url", "image_url": "http://127.0.0.1/x.png"}]})
    assert bad.status_code == 422


def test_keep_alive_responses_are_not_held_for_the_clients_delayed_ack(client):
    """Each GET with a body on one keep-alive connection took 44 ms while the listeners
    lacked TCP_NODELAY (the body waited for the ACK of the headers), ~1 ms with it."""
    times = []
    for _ in range(11):
        start = time.perf_counter()
        assert client.get("/v1/models").status_code == 200
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.030, times
