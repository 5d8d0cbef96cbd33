"""Calling the Triton model directly, as other services do: the README's example, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (code,) = [b for b in blocks if marker in b]
    return code


def test_readme_grpc_streaming_example_runs(stack):
    code = readme_example("TRITON_GRPC_URL")
    code = code.replace('TRITON_GRPC_URL = "127.0.0.1:8001"', f'TRITON_GRPC_URL = "{stack.grpc_url}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert "Paris" in out.getvalue()


def _first_result(stack, arrays: dict[str, np.ndarray]):
    """The first (result, error) of one streaming call to ``llm`` with these inputs."""
    import time

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    client = grpcclient.InferenceServerClient(stack.grpc_url)
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.async_stream_infer("llm", inputs)
    deadline = time.time() + 30
    while not results and time.time() < deadline:
        time.sleep(0.05)
    client.stop_stream()
    return results[0]


def test_bad_sampling_parameters_get_a_triton_error_naming_the_field(stack):
    result, error = _first_result(stack, {
        "text_input": np.array([["hi"]], dtype=object),
        "sampling_parameters": np.array([[json.dumps({"top_p": 0})]], dtype=object)})
    assert result is None and "top_p" in str(error) and "[400]" in str(error)


@pytest.mark.parametrize("name, array", [
    ("input_ids", np.array([[1, 2, 3], [7, 8, 9]], dtype=np.int64)),
    ("text_input", np.array([["ab"], ["cd"]], dtype=object)),
], ids=["input_ids", "text_input"])
def test_a_request_with_two_rows_is_refused_not_merged(stack, name, array):
    """One prompt per request: two input_ids rows were generated from as one prompt, and a
    second text_input row was dropped."""
    result, error = _first_result(stack, {name: array})
    assert result is None and "[400]" in str(error) and "one prompt per request" in str(error)


def test_cancelled_stream_is_dropped_by_the_engine(stack):
    from tritonclient.grpc.aio import InferenceServerClient, InferInput

    async def run():
        client = InferenceServerClient(stack.grpc_url)

        def inp(name, arr, dt):
            i = InferInput(name, list(arr.shape), dt)
            i.set_data_from_numpy(arr)
            return i

        async def requests():
            yield {"model_name": "llm", "request_id": "cancel-me", "inputs": [
                inp("text_input", np.array([["Write a very long essay"]], dtype=object), "BYTES"),
                inp("sampling_parameters", np.array([[json.dumps({"max_tokens": 500, "ignore_eos": True})]],
                                                    dtype=object), "BYTES")]}

        before = stack.engine_metric("llm_request_cancelled_total")
        call = client.stream_infer(requests())
        got = 0
        async for _result, error in call:
            assert error is None
            got += 1
            if got == 2:
                call.cancel()
                break
        for _ in range(100):
            if stack.engine_metric("llm_request_cancelled_total") > before:
                break
            await asyncio.sleep(0.05)
        await client.close()
        return stack.engine_metric("llm_request_cancelled_total") - before

    assert asyncio.run(run()) >= 1


def test_triton_batchers_run_without_a_queue_policy(stack):
    """A queue size, a timeout or priority levels turn off Triton 2.51's payload prefetching, and
    then a request arriving while execute() runs waited out the batcher's 500 ms idle wait
    (3-9% of the requests in bursts of 8, measured). Both models must load without them."""
    import httpx

    for model in ("llm", "llm_unary"):
        batching = httpx.get(f"{stack.triton_http}/v2/models/{model}/config", timeout=10).json()["dynamic_batching"]
        policy = batching.get("default_queue_policy", {})
        assert int(policy.get("max_queue_size", 0)) == 0, (model, policy)
        assert int(policy.get("default_timeout_microseconds", 0)) == 0, (model, policy)
        assert not policy.get("allow_timeout_override", False), (model, policy)
        assert not int(batching.get("priority_levels", 0)), (model, batching)


def test_the_settings_batching_delay_is_what_triton_runs(stack):
    """ScheduleConfig.maxQueueDelayMicroseconds (600 in the test settings) replaces config.pbtxt's 500."""
    import httpx

    config = httpx.get(f"{stack.triton_http}/v2/models/llm/config", timeout=10).json()
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 600
    assert stack.settings.schedule.maxQueueDelayMicroseconds == 600
    unary = httpx.get(f"{stack.triton_http}/v2/models/llm_unary/config", timeout=10).json()
    assert int(unary["dynamic_batching"]["max_queue_delay_microseconds"]) == 500  # its own config.pbtxt
    # the repository API stays closed without the launcher's key
    r = httpx.post(f"{stack.triton_http}/v2/repository/models/llm/unload", timeout=10)
    assert r.status_code in (401, 403), r.text


def _stream(stack, i: int, params: dict, outputs: list[str] | None = None, parameters: dict | None = None):
    """One gRPC stream to ``llm``; yields ``(result, error)`` for each response until the
    FINAL one or an error (each waited for at most 120 s)."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(stack.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    t = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[f"Count to {i}:"]], dtype=object))
    p = grpcclient.InferInput("sampling_parameters", [1, 1], "BYTES")
    p.set_data_from_numpy(np.array([[json.dumps(params)]], dtype=object))
    wanted = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
    client.async_stream_infer("llm", [t, p], outputs=wanted, parameters=parameters)
    try:
        while True:
            result, error = got.get(timeout=120)
            yield result, error
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def test_finish_only_outputs_come_only_with_the_last_response(stack):
    """The ``finish_only_outputs`` request parameter (README's tensor contract): the stream's
    other responses carry only the rest of the requested outputs."""
    wanted = ["text_output", "token_ids", "prompt_tokens", "completion_tokens", "batch_size"]
    got = list(_stream(stack, 3, {"max_tokens": 6, "ignore_eos": True}, wanted,
                       parameters={"finish_only_outputs": "prompt_tokens,completion_tokens,batch_size"}))
    assert all(error is None for _, error in got), got
    names = [{o.name for o in result.get_response().outputs} for result, _ in got]
    assert len(names) >= 2 and all(n == {"text_output", "token_ids"} for n in names[:-1]), names
    assert names[-1] == set(wanted)
    last = got[-1][0]
    assert last.as_numpy("completion_tokens").reshape(-1).tolist() == [6]
    assert last.as_numpy("batch_size").size == 6  # every step's, on the finishing response
    ids = [t for result, _ in got for t in result.as_numpy("token_ids").reshape(-1).tolist()]
    assert len(ids) == 6

    (result, error), = _stream(stack, 4, {"max_tokens": 2}, wanted, parameters={"finish_only_outputs": "usage"})
    assert result is None and "[400]" in str(error) and "finish_only_outputs" in str(error)


def _rounds(stack, rounds: int, one) -> None:
    """``rounds`` rounds of 32 concurrent calls of ``one(i)``, which asserts what it got;
    every call must pass, and Triton must stay up."""
    def attempt(i: int):
        try:
            return one(i)
        except Exception as exc:  # noqa: BLE001  (reported below, with the others)
            return exc

    for round_ in range(rounds):
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(attempt, range(round_ * 32, round_ * 32 + 32)))
        failed = [r for r in results if isinstance(r, Exception)]
        assert not failed, f"round {round_}: {len(failed)} streams failed, first: {failed[0]!r}"
    assert stack.sup.triton.poll() is None


@pytest.mark.slow
def test_streams_asking_for_some_outputs_keep_the_stub_up(stack):
    """A caller may name the outputs it wants. Triton's send() drops the others with the GIL
    released, which freed numpy arrays without it. Before the model built only the requested
    outputs, this test crashed the llm stub (segfault in libpython's allocator) in 1 of 2
    runs, and a script running rounds like these crashed it in 3 of 3 runs, within 3 to 14
    rounds. Each round is 32 concurrent streams."""
    wanted = ["text_output", "finish_reason"]

    def one(i: int) -> None:
        responses, names = 0, set()
        for result, error in _stream(stack, i, {"max_tokens": 24, "ignore_eos": True}, wanted):
            assert error is None, error
            responses += 1
            names |= {o.name for o in result.get_response().outputs}
        assert responses >= 24 and names == set(wanted), (responses, names)

    _rounds(stack, 8, one)


@pytest.mark.slow
def test_bad_requests_mixed_into_live_streams_get_their_error_and_break_nothing(stack):
    """A request refused in execute() (bad parameters) gets its error FINAL from the same
    thread that sends every other response: the Python backend's senders are not safe to
    use from two threads at once. Four rounds of 32 concurrent streams, one in four bad."""
    def one(i: int) -> None:
        if i % 4 == 0:
            (result, error), = _stream(stack, i, {"top_p": 0})
            assert result is None and "top_p" in str(error), (result, error)
            return
        *_, (result, error) = _stream(stack, i, {"max_tokens": 16, "ignore_eos": True})
        assert error is None and result.get_response().parameters["triton_final_response"].bool_param

    _rounds(stack, 4, one)
