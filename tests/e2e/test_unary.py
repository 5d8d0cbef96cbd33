"""The unary model `llm_unary` (BLS front of `llm`) with Triton's own clients and /generate."""

from __future__ import annotations

import contextlib
import io
import json
import queue
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import wait_for

pytestmark = pytest.mark.e2e
README = Path(__file__).resolve().parents[2] / "README.md"
MODEL = "llm_unary"
PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 8, "temperature": 0}


def _inputs(mod, text: str | None = None, params: dict | str | None = None, ids: list[int] | None = None):
    tensors = []
    if text is not None:
        tensors.append(mod.InferInput("text_input", [1, 1], "BYTES"))
        tensors[-1].set_data_from_numpy(np.array([[text]], dtype=object))
    if ids is not None:
        tensors.append(mod.InferInput("input_ids", [1, len(ids)], "INT64"))
        tensors[-1].set_data_from_numpy(np.array([ids], dtype=np.int64))
    if params is not None:
        raw = params if isinstance(params, str) else json.dumps(params)
        tensors.append(mod.InferInput("sampling_parameters", [1, 1], "BYTES"))
        tensors[-1].set_data_from_numpy(np.array([[raw]], dtype=object))
    return tensors


def _http(stack, **kw) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(stack.triton_http.removeprefix("http://"), network_timeout=120, **kw)


def _streamed_text(stack, params: dict) -> str:
    """The same request through the decoupled `llm` model, streamed over gRPC."""
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("llm", _inputs(grpcclient, PROMPT, params))
    text = ""
    while True:
        result, error = got.get(timeout=60)
        assert error is None, error
        text += result.as_numpy("text_output")[0][0].decode()
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    return text


def test_http_infer_returns_the_whole_result(stack):
    result = _http(stack).infer(MODEL, _inputs(httpclient, PROMPT, GREEDY))
    out = {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}
    assert out["text_output"].shape == (1, 1) and "Paris" in out["text_output"][0][0].decode()
    assert out["text_output"][0][0].decode() == _streamed_text(stack, GREEDY)
    assert out["index"].tolist() == [[0]]
    assert out["finish_reason"].tolist() == [[b"length"]]
    assert out["completion_tokens"].tolist() == [[8]]
    assert out["prompt_tokens"][0][0] == 5 and out["cached_tokens"].shape == (1, 1)
    assert len(json.loads(out["token_ids"][0][0])) == 8
    assert out["logprobs"].tolist() == [[b""]]  # not asked for
    assert out["cumulative_logprob"][0][0] < 0 and out["seed"].dtype == np.uint64


def test_http_async_infer_concurrent_calls_are_batched_in_the_one_engine(stack):
    client = _http(stack, concurrency=8)
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    pending = [client.async_infer(MODEL, _inputs(httpclient, f"Count to {i}:", params), request_id=f"b{i}")
               for i in range(8)]
    results = [p.get_result(timeout=120) for p in pending]
    assert [r.as_numpy("completion_tokens")[0][0] for r in results] == [16] * 8
    sizes = [int(r.as_numpy("max_step_batch_size")[0][0]) for r in results]
    assert max(sizes) >= 4, f"the 8 calls did not share engine steps: {sizes}"
    client.close()


def test_grpc_unary_infer_with_input_ids(stack, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    result = client.infer(MODEL, _inputs(grpcclient, ids=ids, params=GREEDY),
                          outputs=[grpcclient.InferRequestedOutput("text_output"),
                                   grpcclient.InferRequestedOutput("prompt_tokens")])
    assert "Paris" in result.as_numpy("text_output")[0][0].decode()
    assert result.as_numpy("prompt_tokens")[0][0] == len(ids)
    assert result.as_numpy("finish_reason") is None  # only what was asked for


def test_triton_generate_endpoint(stack):
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps(GREEDY)}
    r = httpx.post(f"{stack.triton_http}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert "Paris" in data["text_output"] and data["finish_reason"] == "length"
    assert data["completion_tokens"] == 8 and len(json.loads(data["token_ids"])) == 8


def test_n_and_best_of_results_are_a_dimension(stack):
    client = _http(stack)
    params = {"max_tokens": 4, "temperature": 0.8, "seed": 11, "n": 3, "logprobs": 1}
    result = client.infer(MODEL, _inputs(httpclient, PROMPT, params))
    assert result.as_numpy("text_output").shape == (1, 3)
    assert result.as_numpy("index").tolist() == [[0, 1, 2]]
    assert result.as_numpy("completion_tokens").tolist() == [[4, 4, 4]]
    logprobs = [json.loads(x) for x in result.as_numpy("logprobs")[0]]
    tokens = [json.loads(x) for x in result.as_numpy("token_ids")[0]]
    assert [len(lp) for lp in logprobs] == [4, 4, 4] and [len(t) for t in tokens] == [4, 4, 4]
    assert all(len(e["top"]) == 1 for lp in logprobs for e in lp)
    # best_of > n: the n sequences with the highest cumulative logprob, in index order
    result = client.infer(MODEL, _inputs(httpclient, PROMPT, dict(params, n=2, best_of=4)))
    index = result.as_numpy("index")[0].tolist()
    assert result.as_numpy("text_output").shape == (1, 2) and index == sorted(index)
    assert set(index) <= {0, 1, 2, 3}


def test_bad_parameter_is_http_400_naming_the_field_then_a_good_call_succeeds(stack):
    client = _http(stack)
    for params, field in (({"top_p": 0}, "top_p"), ({"max_tokens": 4, "bogus": 1}, "bogus"),
                          ("{not json", "sampling_parameters"), ({"temperature": -1}, "temperature")):
        with pytest.raises(InferenceServerException) as err:
            client.infer(MODEL, _inputs(httpclient, "Hi", params))
        assert err.value.status() == "400" and field in err.value.message() and "[400]" in err.value.message()
    with pytest.raises(InferenceServerException) as err:  # no prompt at all
        client.infer(MODEL, _inputs(httpclient, params=GREEDY))
    assert err.value.status() == "400" and "text_input" in err.value.message()
    two = httpclient.InferInput("text_input", [2, 1], "BYTES")  # one prompt per request
    two.set_data_from_numpy(np.array([["a"], ["b"]], dtype=object))
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [two])
    assert err.value.status() == "400" and "one prompt per request" in err.value.message()
    r = httpx.post(f"{stack.triton_http}/v2/models/{MODEL}/generate",
                   json={"text_input": "Hi", "sampling_parameters": json.dumps({"top_k": -1})}, timeout=60)
    assert r.status_code == 400 and "top_k" in r.json()["error"]
    assert httpx.get(f"{stack.triton_http}/v2/models/{MODEL}/ready").status_code == 200
    result = client.infer(MODEL, _inputs(httpclient, PROMPT, GREEDY))
    assert "Paris" in result.as_numpy("text_output")[0][0].decode()


def test_request_timeout_becomes_the_engine_deadline(stack):
    params = {"max_tokens": 2000, "ignore_eos": True}
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as err:
        _http(stack).infer(MODEL, _inputs(httpclient, "Write a long essay", params), timeout=500_000)
    assert time.monotonic() - started < 30
    assert "[504]" in err.value.message() and err.value.status() == "503"


def _wait_engine_idle(stack, timeout=10.0) -> bool:
    return wait_for(lambda: stack.engine_metric("llm_num_requests_running") == 0
                    and stack.engine_metric("llm_num_requests_waiting") == 0, timeout=timeout)


LONG = {"max_tokens": 2000, "ignore_eos": True}


def test_grpc_client_timeout_cancels_the_generation(stack):
    """A gRPC deadline cancels the unary request, and the cancel reaches the engine."""
    before = stack.engine_metric("llm_request_cancelled_total")
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, _inputs(grpcclient, "Write a long essay", LONG), client_timeout=2.0)
    assert "Deadline" in str(err.value) or "DEADLINE" in str(err.value.status())
    assert wait_for(lambda: stack.engine_metric("llm_request_cancelled_total") > before, timeout=10)
    assert _wait_engine_idle(stack)
    # 2000 tokens take minutes here; the engine stopped long before that
    assert time.monotonic() - started < 20
    result = client.infer(MODEL, _inputs(grpcclient, PROMPT, GREEDY))
    assert "Paris" in result.as_numpy("text_output")[0][0].decode()


def test_grpc_cancelled_async_infer_cancels_the_generation(stack):
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    before = stack.engine_metric("llm_request_cancelled_total")
    done: queue.Queue = queue.Queue()
    calls = [client.async_infer(MODEL, _inputs(grpcclient, f"Essay {i}: the sea", LONG),
                                callback=lambda result, error: done.put(error)) for i in range(4)]
    assert wait_for(lambda: stack.engine_metric("llm_num_requests_running") == 4, timeout=20)
    for call in calls:
        call.cancel()
    errors = [done.get(timeout=10) for _ in calls]
    assert all(e is not None and "CANCELLED" in str(e.status()) for e in errors), errors
    assert wait_for(lambda: stack.engine_metric("llm_request_cancelled_total") >= before + 4, timeout=10)
    assert _wait_engine_idle(stack)


@pytest.mark.slow
def test_many_short_concurrent_calls_keep_triton_up(stack):
    """The cancellation watcher polls the senders of running calls; one queried after its
    final response crashed tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled)
    within a few hundred short concurrent calls, before the watcher and the senders shared a lock."""
    def call(i):
        params = {"max_tokens": 1 + i % 3, "ignore_eos": True}
        result = _http(stack).infer(MODEL, _inputs(httpclient, f"Hi {i}", params))
        return int(result.as_numpy("completion_tokens")[0][0])

    with ThreadPoolExecutor(16) as pool:
        tokens = list(pool.map(call, range(600)))
    assert tokens == [1 + i % 3 for i in range(600)]
    assert stack.sup.triton.poll() is None


def test_readme_http_example_runs(stack):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (code,) = [b for b in blocks if "TRITON_HTTP_URL" in b]
    host = stack.triton_http.removeprefix("http://")
    code = code.replace('TRITON_HTTP_URL = "127.0.0.1:8000"', f'TRITON_HTTP_URL = "{host}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert "Paris" in out.getvalue()
