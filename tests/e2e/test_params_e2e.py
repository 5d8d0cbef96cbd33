"""Parameters and response rules through the real stack: stop_token_ids, include_stop_str_in_output,
penalties, /infer's no-effect and priority parameters, finish reasons, req-id, timeouts inside a
stream (spec §1.5) and fullTextEnabled on both endpoints (spec §1.7)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import MODEL_NAME, wait_for

pytestmark = pytest.mark.e2e
PROMPT = "The capital of France is"
GREEDY = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT_EOS = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"  # a short answer, then EOS


def completion(client, **fields) -> dict:
    r = client.post("/v1/completions", json={**GREEDY, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def infer_ids(client, inputs: str, n: int) -> list[int]:
    """Greedy token ids, read from /infer's stream events."""
    with client.stream("POST", "/infer", json={"inputs": inputs, "stream": True, "parameters": {
            "max_new_tokens": n, "do_sample": False}}) as r:
        return [i for line in r.iter_lines() if line.startswith("data: ")
                for i in json.loads(line[6:])["token"]["id"]]


def sse(raw: bytes) -> list[bytes]:
    return [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


# ---------------------------------------------------------------------- stops


def test_stop_token_ids_end_the_choice_without_the_token(client, tokenizer):
    ids = infer_ids(client, PROMPT, 8)
    full = completion(client)["choices"][0]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # its first occurrence
    choice = completion(client, stop_token_ids=[ids[k], 2**40, "x"])["choices"][0]  # junk items are ignored
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert choice["text"] == tokenizer.decode(ids[:k]) and full["text"].startswith(choice["text"])
    assert len(choice["text"]) < len(full["text"])
    streamed = client.post("/v1/completions", json={**GREEDY, "stop_token_ids": [ids[k]], "stream": True}).content
    events = [json.loads(e) for e in sse(streamed)[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_in_output(client):
    full = completion(client, max_tokens=12)["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full.index(stop)
    without = completion(client, max_tokens=12, stop=[stop])["choices"][0]
    within = completion(client, max_tokens=12, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert without["text"] == full[:cut]
    assert within["text"] == full[:cut + len(stop)]
    assert within["finish_reason"] == without["finish_reason"] == "stop"
    # R7: ignored (not even type-checked) without stop / stop_token_ids
    assert completion(client, include_stop_str_in_output="junk")["choices"][0]["text"] == completion(
        client)["choices"][0]["text"]


# ---------------------------------------------------------------------- penalties


def test_frequency_penalty_breaks_a_repetition(client):
    base = {"prompt": "1 1 1 1 1 1 1 1 1 1", "max_tokens": 16}
    plain = completion(client, **base)["choices"][0]["text"]
    penalised = completion(client, **base, frequency_penalty=2.0)["choices"][0]["text"]
    assert plain.count("1") > penalised.count("1")


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_penalties_change_greedy_output_and_zero_is_neutral(client, penalty):
    base = {"prompt": "Repeat: cat cat cat cat cat", "max_tokens": 16}
    plain = completion(client, **base)["choices"][0]["text"]
    assert completion(client, **base, **{penalty: 0.0})["choices"][0]["text"] == plain
    assert completion(client, **base, **{penalty: 2.0})["choices"][0]["text"] != plain


# ---------------------------------------------------------------------- /infer parameters


def infer(client, **parameters) -> dict:
    r = client.post("/infer", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "do_sample": False, "details": True, **parameters}})
    assert r.status_code == 200, r.text
    return r.json()


def test_typical_p_and_watermark_are_accepted_without_effect(client):
    plain = infer(client)["generated_text"]
    assert infer(client, typical_p=0.5, watermark=True)["generated_text"] == plain
    assert infer(client, typical_p=1.0, watermark=False)["generated_text"] == plain


@pytest.mark.parametrize("priority", [1, 3, 5])
def test_priority_is_accepted(client, priority):
    assert infer(client, priority=priority)["details"]["generated_tokens"] == 6


@pytest.mark.parametrize("stream", [False, True])
def test_infer_finish_reasons(client, stream):
    def details(inputs, n):
        body = {"inputs": inputs, "stream": stream, "parameters": {"max_new_tokens": n, "do_sample": False,
                                                                   "details": True}}
        if not stream:
            return client.post("/infer", json=body).json()["details"]
        return json.loads(sse(client.post("/infer", json=body).content)[-1])["details"]

    assert details(PROMPT, 2)["finish_reason"] == "length"
    eos = details(CHAT_EOS, 40)
    assert eos["finish_reason"] == "eos_token" and eos["generated_tokens"] < 40


def test_infer_finish_reason_table():
    """Spec §2.8. "stop_sequence" is for a cancelled request: its client is gone, so no HTTP
    response ever carries it here; the mapping is checked directly."""
    from adapter.infer import finish_reason

    assert [finish_reason(r) for r in ("stop", "length", "cancelled", "", "other")] == [
        "eos_token", "length", "stop_sequence", "invalid flag", "invalid flag"]


# ---------------------------------------------------------------------- request id (§1.8)


def test_req_id_header_is_the_completion_id(client):
    r = client.post("/v1/completions", json={**GREEDY, "max_tokens": 2}, headers={"req-id": "my-request-7"})
    assert r.json()["id"] == "my-request-7"
    raw = client.post("/v1/completions", json={**GREEDY, "max_tokens": 2, "stream": True},
                      headers={"req-id": "my-stream-8"}).content
    assert {json.loads(e)["id"] for e in sse(raw)[:-1]} == {"my-stream-8"}
    first = client.post("/v1/completions", json={**GREEDY, "max_tokens": 1}, headers={"req-id": ""}).json()["id"]
    second = client.post("/v1/completions", json={**GREEDY, "max_tokens": 1}).json()["id"]
    assert first.startswith("endpoint_common_") and second.startswith("endpoint_common_")
    assert int(second.rsplit("_", 1)[1]) > int(first.rsplit("_", 1)[1])
    infer_body = client.post("/infer", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}},
                             headers={"req-id": "x"}).json()
    assert "id" not in infer_body and "my-request-7" not in json.dumps(infer_body)


# ---------------------------------------------------------------------- a timeout inside a stream (§1.5)


def test_a_timeout_inside_a_stream_is_raw_text(stack, adapter_with):
    a = adapter_with(e2eTimeout=1)
    a.wait()
    bodies = [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "Tell a long story", "max_tokens": 500,
                             "ignore_eos": True, "stream": True}),
        ("/infer", {"inputs": "Write a long essay", "stream": True, "parameters": {
            "max_new_tokens": 500, "do_sample": True, "temperature": 5.0, "seed": 7}}),
    ]
    with httpx.Client(base_url=a.url, timeout=60) as c:
        for path, body in bodies:
            with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                raw = r.read()  # the server closes the connection after the text
            tail = b"Engine callback timeout: server e2eTimeout"
            assert raw.endswith(b"\n\n" + tail), raw[-120:]  # no "data: ", no blank line after it
            assert b"[DONE]" not in raw
            events = sse(raw[: -len(tail)])
            assert events and all(e.startswith(b"{") for e in events)
        beam = {"model": MODEL_NAME, "prompt": "Tell a long story", "max_tokens": 500, "ignore_eos": True,
                "stream": True, "use_beam_search": True, "n": 2, "temperature": 1.0}
        with c.stream("POST", "/v1/completions", json=beam) as r:  # the one-event pseudo-stream times out too
            assert (r.status_code, r.read()) == (200, tail)

        def slow_body():  # e2eTimeout counts from arrival: reading the body counts too
            yield json.dumps({"model": MODEL_NAME, "prompt": "Hi"}).encode()[:-1]
            time.sleep(1.2)
            yield b', "max_tokens": 2}'

        r = c.post("/v1/completions", content=slow_body(), headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]) == (500, "Engine callback timeout: server e2eTimeout")
    # the deadline stopped the generations in the engine too
    assert wait_for(lambda: stack.engine_metric("llm_num_requests_running") == 0, timeout=10)


# ---------------------------------------------------------------------- fullTextEnabled (§1.7)


def test_full_text_enabled_on_both_endpoints(adapter_with):
    a = adapter_with(fullTextEnabled=True)
    a.wait()
    with httpx.Client(base_url=a.url, timeout=60) as c:
        raw = c.post("/v1/completions", json={**GREEDY, "stream": True}).content
        whole = c.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        infer_raw = c.post("/infer", json={"inputs": "Hello", "stream": True,
                                           "parameters": {"max_new_tokens": 4, "do_sample": False}}).content
    texts = [json.loads(e)["choices"][0]["text"] for e in sse(raw)[:-1]]
    assert len(texts) == 8 and all(texts[i].startswith(texts[i - 1]) for i in range(1, len(texts)))
    assert texts[-1] == whole  # cumulative: the last event holds the whole text
    events = [json.loads(e) for e in sse(infer_raw)]
    steps = [e["token"]["text"] for e in events[:-1]]
    assert all(steps[i].startswith(steps[i - 1]) for i in range(1, len(steps)))
    assert events[-1]["token"]["text"] is None and events[-1]["generated_text"].startswith(steps[-1])
