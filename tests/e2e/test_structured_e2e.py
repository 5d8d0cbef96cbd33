"""``response_format`` end to end: the official openai client and httpx -> adapter -> Triton -> engine,
and a direct tritonclient caller; JSON that parses and follows its schema, and 422 for a schema
that does not compile (the server keeps serving)."""

from __future__ import annotations

import json
import time

import numpy as np
import openai
import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    # bounded, so that greedy decoding ends with "stop" on every load path: in bfloat16 the
    # model wrote digits of an unbounded "population" until max_tokens
    "properties": {"city": {"type": "string", "maxLength": 30},
                   "population": {"type": "integer", "minimum": 0, "maximum": 10**10},
                   "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": SCHEMA}}
PROMPT = "Describe Paris as JSON:"


def follows_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"city", "population", "capital"}
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 30
    assert isinstance(obj["population"], int) and 0 <= obj["population"] <= 10**10
    assert isinstance(obj["capital"], bool)


def test_openai_client_json_schema_stream_and_non_stream(stack):
    oc = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused")
    out = oc.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=100, temperature=0,
                                extra_body={"response_format": FORMAT})
    assert out.choices[0].finish_reason == "stop"
    follows_schema(out.choices[0].text)
    chunks = list(oc.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=100, temperature=0,
                                        stream=True, extra_body={"response_format": FORMAT}))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_json_object_with_n_and_logprobs(client):
    r = client.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "A JSON object about a cat:", "max_tokens": 100, "temperature": 0.9,
        "seed": 11, "n": 2, "logprobs": 2, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["text"]), dict)
        else:  # cut by max_tokens: still the start of an object
            assert choice["finish_reason"] == "length" and choice["text"].startswith("{")
        assert all(v > float("-inf") for top in choice["logprobs"]["top_logprobs"] for v in top.values())


def test_a_schema_that_does_not_compile_is_422_and_the_server_goes_on(client):
    bad = dict(FORMAT, json_schema={"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/z"}}}})
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "response_format": bad})
    assert r.status_code == 422
    assert r.json() == {"error": "Invalid json_schema: Pointer '/z' does not exist",
                        "error_type": "Input Validation Error"}
    ok = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2,
                                              "response_format": {"type": "text"}})
    assert ok.status_code == 200


def test_direct_triton_caller_sets_response_format_in_sampling_parameters(stack):
    import tritonclient.grpc as grpcclient

    def run(params: dict) -> tuple[str, str]:
        client = grpcclient.InferenceServerClient(stack.grpc_url)
        results = []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        t = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[PROMPT]], dtype=object))
        p = grpcclient.InferInput("sampling_parameters", [1, 1], "BYTES")
        p.set_data_from_numpy(np.array([[json.dumps(params)]], dtype=object))
        client.async_stream_infer("llm", [t, p])
        deadline = time.time() + 60
        while time.time() < deadline and not any(
                e is not None or r.get_response().parameters["triton_final_response"].bool_param
                for r, e in results):
            time.sleep(0.05)
        client.stop_stream()
        errors = [str(e) for _, e in results if e is not None]
        if errors:
            return "", errors[0]
        text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r, _ in results
                       if r.as_numpy("text_output") is not None)
        return text, ""

    text, error = run({"max_tokens": 100, "temperature": 0, "response_format": FORMAT})
    assert not error
    follows_schema(text)
    _, error = run({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}})
    assert "[400]" in error and "response_format" in error and "frob" in error


def test_readme_structured_output_example_runs(stack):
    import contextlib
    import io
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "Describe Paris as JSON" in b]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"client": openai.OpenAI(base_url=stack.url + "/v1", api_key="x")})
    text, reason = out.getvalue().strip().rsplit(" ", 1)
    assert reason == "stop"
    obj = json.loads(text)
    assert list(obj) == ["city", "country", "capital"] and isinstance(obj["capital"], bool)
