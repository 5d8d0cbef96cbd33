"""The only module that speaks to Triton: one gRPC bidirectional stream per HTTP request.

gRPC streaming is used rather than HTTP ``generate_stream`` because cancelling the
call reaches the model at its next step (``response_sender.is_cancelled()``), also
while the request is queued or prefilling, whereas a closed HTTP connection is only
noticed when the server next writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
from llm_engine.contract import FINISH_ONLY_OUTPUTS
from llm_engine.errors import parse_error
from llm_engine.sequence import StepOutput
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE
from tritonclient.grpc.aio import InferenceServerClient, InferInput, InferRequestedOutput, KeepAliveOptions
from tritonclient.utils import InferenceServerException

log = logging.getLogger(__name__)
RECONNECT_BACKOFF_MS = (250, 2000)  # first and longest wait between reconnection attempts
STUB_RECOVERY_SECONDS = 15.0  # report not-ready this long after an unhealthy-stub error
STREAM_END_SECONDS = 5.0  # how long a finished request's stream may take to end before it is cancelled


# One response of the ``llm`` model: the wire carries exactly the engine's StepOutput
# fields (``llm_engine.contract``), so the adapter reads responses into that type.
Chunk = StepOutput


class TritonError(Exception):
    """Triton or the model answered with an error; ``status`` is the HTTP status to use."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class TritonUnavailable(TritonError):
    """Triton or the model cannot be reached: a failed generation (500, spec §1.2), not overload."""

    def __init__(self, message: str):
        super().__init__(500, message)


TRITON_QUEUE_FULL = "Exceeds maximum queue size"  # Triton's rejection when max_queue_size is reached


def _input(name: str, array: np.ndarray, dtype: str) -> InferInput:
    tensor = InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _status_and_message(error) -> tuple[int, str]:
    """A stream's error response as the engine's status and message (``[424] ...``)."""
    return parse_error(str(error.message() if hasattr(error, "message") else error))


def _short(exc: Exception) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        details = exc.details() if callable(getattr(exc, "details", None)) else ""
        return f"{code().name}: {(details or '').splitlines()[0] if details else ''}".rstrip(": ")
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# memoryview formats of Triton's fixed-size dtypes (Triton's wire order is little-endian,
# as is every host this runs on)
_FORMATS = {"INT32": "i", "INT64": "q", "UINT64": "Q", "FP32": "f", "BOOL": "?"}


def _values(datatype: str, raw: bytes) -> list:
    """One raw output tensor as a flat Python list (BYTES: a list of ``bytes``)."""
    if datatype != "BYTES":
        return memoryview(raw).cast(_FORMATS[datatype]).tolist()
    items, at = [], 0
    while at < len(raw):  # each element: a 4-byte little-endian length, then the bytes
        size = int.from_bytes(raw[at:at + 4], "little")
        items.append(raw[at + 4:at + 4 + size])
        at += 4 + size
    return items


def _chunk(result) -> Chunk:
    """One response as a :data:`Chunk`, read in one pass over its outputs.

    ``InferResult.as_numpy`` searches the outputs by name and builds a numpy array per
    call; twelve of those per token were a quarter of the adapter's CPU under load. An
    output the request did not ask for gets its neutral value.
    """
    response = result.get_response()
    raw = response.raw_output_contents
    if len(raw) == len(response.outputs):
        got = {o.name: _values(o.datatype, raw[i]) for i, o in enumerate(response.outputs)}
    else:  # not raw: let tritonclient decode
        got = {o.name: result.as_numpy(o.name).reshape(-1).tolist() for o in response.outputs}

    def first(name: str, default):
        values = got.get(name)
        return values[0] if values else default

    logprobs = first("logprobs", b"")
    return Chunk(
        index=first("index", 0),
        text=first("text_output", b"").decode("utf-8", "replace"),
        token_ids=got.get("token_ids", []),
        finish_reason=first("finish_reason", b"").decode(),
        prompt_tokens=first("prompt_tokens", 0),
        cached_tokens=first("cached_tokens", 0),
        completion_tokens=first("completion_tokens", 0),
        cumulative_logprob=first("cumulative_logprob", 0.0),
        seed=first("seed", 0),
        batch_size=got.get("batch_size", []),
        queue_wait_us=got.get("queue_wait_us", []),
        logprobs=json.loads(logprobs) if logprobs else None,
        final=response.parameters["triton_final_response"].bool_param,
    )


def _channel_args() -> list[tuple[str, int]]:
    """tritonclient's defaults, plus a short reconnect backoff: gRPC's default grows to two
    minutes during a long outage, which would keep the adapter failing after Triton is back."""
    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]


class TritonClient:
    def __init__(self, url: str, model: str):
        self.url = url
        self.model = model
        self._client: InferenceServerClient | None = None
        self._ready_cache: tuple[float, bool] = (0.0, False)
        self._broken_until = 0.0  # set when Triton reports the model's stub unhealthy
        self.was_ready = False  # the model has been ready once: not ready now is abnormal, not starting
        self._ending: set[asyncio.Task] = set()  # streams read to their end after the final response

    def _get(self) -> InferenceServerClient:
        if self._client is None:
            self._client = InferenceServerClient(self.url, channel_args=_channel_args())
        return self._client

    async def close(self) -> None:
        for task in list(self._ending):
            task.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self, max_age: float = 1.0) -> bool:
        """Whether Triton answers and the model is ready (cached for ``max_age`` seconds)."""
        now = time.monotonic()
        if now < self._broken_until:
            return False
        if now - self._ready_cache[0] < max_age:
            return self._ready_cache[1]
        try:
            ok = await asyncio.wait_for(self._get().is_model_ready(self.model), timeout=2.0)
        except Exception:
            ok = False
        self._ready_cache = (now, bool(ok))
        self.was_ready = self.was_ready or bool(ok)
        return bool(ok)

    def invalidate(self) -> None:
        self._ready_cache = (0.0, False)

    def _answered(self) -> None:
        """The model just finished a request: it is ready, whatever an older probe said."""
        self._ready_cache = (time.monotonic(), True)
        self.was_ready = True

    async def generate(self, request_id: str, sampling: dict, *, prompt_ids: list[int] | None = None,
                       prompt_text: str | None = None, stream: bool = True,
                       outputs: list[str] | None = None,
                       finish_only: tuple[str, ...] = ()) -> AsyncIterator[Chunk]:
        """Yield the model's responses until the final one; with ``outputs``, only those
        outputs travel (the others read as neutral values, see :func:`_chunk`), and those
        also in ``finish_only`` only on responses that end a sequence (finish reason) or
        the request.

        Leaving the loop early (``break``, an exception, task cancellation) cancels the
        gRPC call, and the engine drops the request at its next step.
        """
        inputs = [
            _input("stream", np.array([[stream]], dtype=bool), "BOOL"),
            _input("sampling_parameters", np.array([[json.dumps(sampling).encode()]], dtype=object), "BYTES"),
        ]
        if prompt_ids is not None:
            inputs.append(_input("input_ids", np.array([prompt_ids], dtype=np.int64), "INT64"))
        else:
            inputs.append(_input("text_input", np.array([[(prompt_text or "").encode()]], dtype=object),
                                 "BYTES"))

        wanted = [InferRequestedOutput(name) for name in outputs] if outputs else None
        parameters = {FINISH_ONLY_OUTPUTS: ",".join(finish_only)} if finish_only else None

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "outputs": wanted, "request_id": request_id,
                   "parameters": parameters}

        try:
            call = self._get().stream_infer(requests())
        except Exception as exc:
            self.invalidate()
            raise TritonUnavailable(f"Triton is unavailable: {_short(exc)}") from exc
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    status, message = _status_and_message(error)
                    finished = True
                    self._end_quietly(call)
                    if "is not healthy" in message:  # the Python stub died; Triton still says ready
                        self._broken_until = time.monotonic() + STUB_RECOVERY_SECONDS
                        self.invalidate()
                        raise TritonUnavailable(message)
                    if TRITON_QUEUE_FULL in message:  # overload, like the engine's own full queue
                        status = 503
                    raise TritonError(status, message)
                chunk = _chunk(result)
                if chunk.final:
                    finished = True
                    self._answered()
                    self._end_quietly(call)
                    yield chunk
                    return
                yield chunk
            finished = True
            raise TritonUnavailable("the model stream ended without a final response")
        except InferenceServerException as exc:
            finished = True
            self.invalidate()
            raise TritonUnavailable(f"Triton is unavailable: {_short(exc)}") from exc
        except grpc.RpcError as exc:
            finished = True
            self.invalidate()
            raise TritonUnavailable(f"Triton is unavailable: {_short(exc)}") from exc
        finally:
            if not finished:
                call.cancel()

    async def stop(self, request_id: str) -> None:
        """End the model's running requests that have ``request_id`` (the ``stop_request_id``
        control call; they finish as ``cancelled`` with what they generated)."""
        stop = _input("stop_request_id", np.array([[request_id.encode("utf-8", "surrogatepass")]], dtype=object),
                      "BYTES")

        async def requests():
            yield {"model_name": self.model, "inputs": [stop], "request_id": f"stop:{request_id}"[:255]}

        try:
            call = self._get().stream_infer(requests())
            async for _, error in call:
                self._end_quietly(call)
                if error is not None:
                    status, message = _status_and_message(error)
                    raise TritonError(status, message)
                return
        except (InferenceServerException, grpc.RpcError) as exc:
            self.invalidate()
            raise TritonUnavailable(f"Triton is unavailable: {_short(exc)}") from exc
        raise TritonUnavailable("the model stream ended without a final response")

    def _end_quietly(self, call) -> None:
        """Read a finished request's stream to its end in the background.

        Dropped instead, the call is cancelled when it is collected (grpc.aio does that),
        just after Triton wrote the final response. A cancel that reached Triton's stream
        handler before it had completed the RPC left that RPC waiting for a callback that
        never came, and it kept the model referenced: at shutdown tritonserver then waited
        out its exit timeout with the model UNLOADING, never finalised it, and the stub
        was orphaned (in about 1 shutdown in 5 after traffic, with verbose logs)."""
        task = asyncio.get_running_loop().create_task(_read_to_end(call))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)


async def _read_to_end(call) -> None:
    """Wait for Triton to end the stream (this client half-closed it after its one request);
    cancel it only if it has not ended in :data:`STREAM_END_SECONDS`."""

    async def drain() -> None:
        async for _ in call:
            pass

    try:
        await asyncio.wait_for(drain(), STREAM_END_SECONDS)
    except asyncio.TimeoutError:
        log.warning("a finished request's gRPC stream did not end in %.0f s; cancelling it", STREAM_END_SECONDS)
        call.cancel()
    except (grpc.RpcError, InferenceServerException, StopAsyncIteration):
        pass  # it ended, one way or another
