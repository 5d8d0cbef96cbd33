"""The adapter's Triton client: reading the model's responses, readiness, and how a
request's gRPC stream ends."""

from __future__ import annotations

import asyncio


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
