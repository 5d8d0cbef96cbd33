"""What both endpoints share: request ids, tokenization, validation off the event loop,
the Triton call with MindIE's timeouts, and the mapping of engine errors to MindIE statuses."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from llm_engine.config import Settings
from llm_engine.weights import gguf_source, model_limits, resolve_model_dir
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from adapter.errors import (
    MindIEError,
    generation_error,
    incomplete_error,
    overloaded_error,
    validation_error,
)
from adapter.protocol.common import GenerationPlan
from adapter.sse import compact, event
from adapter.triton import Chunk, TritonClient, TritonError

log = logging.getLogger(__name__)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
T = TypeVar("T")
INLINE_PARSE_BYTES = 1024  # bodies up to this size are parsed and tokenized on the event loop
INVALID_INPUT_IDS = "Failed to enqueue inferRequest. Invalid Input Ids"  # the engine's message (424)


# The ``llm`` outputs each endpoint builds its answers from. Triton sends only the outputs
# a request names, and each one costs the model's sender thread, tritonserver and the
# adapter work on every token.
_OUTPUTS = {
    "completions": ("text_output", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens",
                    "batch_size", "queue_wait_us"),
    "infer": ("text_output", "finish_reason", "completion_tokens", "token_ids", "seed"),
}
# The outputs the answers read only from a response that ends a sequence (usage, details,
# ranking). The model leaves them out of the other responses of a stream (the
# ``finish_only_outputs`` request parameter), so a streamed token carries its text, and
# its ids, index and logprobs where asked for: at 32 streams on 2 cores, one output a token
# instead of seven gave the stack 1.04-1.2x its throughput (bench/README.md).
FINISH_ONLY = ("finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens", "cumulative_logprob",
               "seed", "batch_size", "queue_wait_us")


def wanted_outputs(plan: GenerationPlan) -> list[str]:
    """The outputs ``plan``'s answer needs: its endpoint's, plus the sequence index and
    ranking score when a request has several sequences, plus logprobs when asked for."""
    names = list(_OUTPUTS[plan.endpoint])
    sampling = plan.sampling
    if (sampling.get("n") or 1) > 1 or (sampling.get("best_of") or 1) > 1 or sampling.get("use_beam_search"):
        names += ["index", "cumulative_logprob"]
    if plan.logprobs is not None or sampling.get("logprobs") is not None:
        names.append("logprobs")
    return names


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """``awaitable``'s result, or ``asyncio.TimeoutError`` after ``seconds``.

    Both waits of every streamed token (the model's next response, the client's write)
    go through here. ``asyncio.timeout`` where there is one (3.11+): ``wait_for`` wraps
    every wait in a task of its own, which was 46 against 12 us per token (measured).
    """
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout=seconds)


async def next_within(gen: AsyncIterator[Chunk], seconds: float) -> Chunk:
    """``gen``'s next item, or ``asyncio.TimeoutError`` after ``seconds``."""
    return await within(gen.__anext__(), seconds)


class DeadlineExceeded(Exception):
    """A MindIE timeout fired; ``which`` is ``client timeout``, ``server tokenTimeout`` or ``server e2eTimeout``."""

    def __init__(self, which: str):
        super().__init__(f"Engine callback timeout: {which}")
        self.which = which


def to_mindie(exc: TritonError) -> MindIEError:
    """The engine's status travels in its message (``[424] ...``); Triton's own failures are 500."""
    if exc.status == 400:
        return validation_error(exc.message)
    if exc.status == 424:
        return generation_error(exc.message)
    if exc.status == 503:  # only Overloaded: the engine's or Triton's queue is full
        return overloaded_error(exc.message)
    return incomplete_error(exc.message)


class Service:
    def __init__(self, settings: Settings, triton: TritonClient, tokenizer=None):
        self.settings = settings
        self.triton = triton
        self.model_name = settings.model.modelName
        model_dir = resolve_model_dir(settings.model.modelWeightPath)
        # /v1/models' "root": the weights' name as configured (a GGUF file's stem), not the
        # cache folder it was converted into
        gguf = gguf_source(settings.model.modelWeightPath)
        self.model_root = gguf.stem if gguf is not None else model_dir.name
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer = tokenizer
        limits = model_limits(Path(model_dir))
        self.vocab_size = limits["vocab_size"] or len(tokenizer)
        self.started = int(time.time())
        self._ids = itertools.count()
        self.stopping = False
        # MindIE request id -> the Triton request ids of its generations in flight (what stopInfer stops)
        self.running: dict[str, set[str]] = collections.defaultdict(set)
        self._generations = itertools.count()

    # -- per request -------------------------------------------------------------------
    def request_id(self, request: Request) -> str:
        given = request.headers.get("req-id")
        return given if given else self.next_request_id()

    def next_request_id(self) -> str:
        """MindIE's generated id (spec §1.8); the timed health probe draws from it too."""
        return f"endpoint_common_{next(self._ids)}"

    @property
    def probe_token_id(self) -> int:
        """The one-token prompt of the timed health probe."""
        for tid in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id):
            if isinstance(tid, int) and 0 <= tid < self.vocab_size:
                return tid
        return 0

    def sse_response(self, events: AsyncIterator[bytes], request_id: str) -> StreamingResponse:
        """An SSE answer: MindIE's error framing once started, and the slow-reader bound."""
        return BoundedStreamingResponse(guard_stream(events, request_id), request_id,
                                        self.settings.server.streamWriteTimeout)

    async def begin(self, request: Request, parser: Callable) -> tuple[GenerationPlan, str]:
        """Read and validate a request body; return its plan and its request id."""
        arrival = getattr(request.state, "arrival", None) or time.monotonic()  # MetricsMiddleware's
        plan = await self.plan(parser, await request.body())
        plan.arrival = arrival
        return plan, self.request_id(request)

    async def plan(self, parser: Callable, raw: bytes) -> GenerationPlan:
        """Validate a body: a small one on the event loop, a larger one in a worker thread.

        Tokenizing 4 MB must not block the loop, but the hand-over to a worker thread
        costs more than parsing a short request (measured: 158 against 57 us for a
        154-byte body on an idle machine, and more on a loaded one, where the worker
        waits for a core); a 4 KiB prompt took 2 ms to tokenize.
        """
        seen: dict[str, list[int]] = {}

        def tokenize(text: str) -> list[int]:
            ids = self.tokenizer(text).input_ids
            seen[text] = ids
            return ids

        if len(raw) <= INLINE_PARSE_BYTES:
            plan = parser(raw, self.settings, tokenize, self.vocab_size)
        else:
            plan = await run_in_threadpool(parser, raw, self.settings, tokenize, self.vocab_size)
        if plan.prompt_ids is None and plan.prompt_text in seen:
            plan.prompt_ids = seen[plan.prompt_text]  # tokenized once, here
        return plan

    async def open_stream(self, request: Request, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        """Wait for the model's first response before a stream sends its first byte (spec §1.2).

        Enqueue failures (a prompt over the token limit, invalid input ids, a full queue,
        Triton unreachable) then raise here, before the response starts, and are answered
        as plain JSON with their status, exactly as without ``stream``. The first chunk is
        handed on in front of the others. A client that hangs up while we wait cancels the
        generation through :func:`until_disconnect`, as in the non-stream path. A timeout
        while waiting belongs to the stream: it is written there as MindIE's raw text.
        """

        async def first() -> Chunk | DeadlineExceeded | None:
            try:
                return await chunks.__anext__()
            except StopAsyncIteration:
                return None
            except DeadlineExceeded as exc:
                return exc

        head = await until_disconnect(request, first())
        return _replay(head, chunks)

    async def chunks(self, request_id: str, plan: GenerationPlan, *, stream: bool,
                     client_timeout: float | None = None) -> AsyncIterator[Chunk]:
        """The model's responses, with MindIE's deadlines applied to every wait.

        ``tokenTimeout`` and the client timeout bound each wait in a stream and the
        whole wait otherwise; ``e2eTimeout`` bounds the request from arrival.
        """
        srv = self.settings.server
        if plan.prompt_ids is not None and not all(INT64_MIN <= t <= INT64_MAX for t in plan.prompt_ids):
            # the engine's answer to an id outside the vocabulary; such an id cannot even travel as INT64
            raise generation_error(INVALID_INPUT_IDS)
        start = time.monotonic()
        e2e_deadline = (plan.arrival or start) + srv.e2eTimeout  # from arrival: reading and tokenizing count
        whole = None if stream else start + min(srv.tokenTimeout, client_timeout or srv.tokenTimeout)
        sampling = dict(plan.sampling)
        sampling.pop("timeout", None)  # deadlines are enforced here, per MindIE's rules
        # each generation has its own Triton id (a client may reuse a MindIE id), so a stop
        # reaches exactly the generations running when it was asked for
        triton_id = f"{request_id}#{next(self._generations)}"
        gen = self.triton.generate(triton_id, sampling, prompt_ids=plan.prompt_ids,
                                   prompt_text=plan.prompt_text, stream=stream, outputs=wanted_outputs(plan),
                                   finish_only=FINISH_ONLY)
        self.running[request_id].add(triton_id)
        try:
            while True:
                now = time.monotonic()
                waits = {"server e2eTimeout": e2e_deadline - now}
                if whole is not None:
                    key = "client timeout" if client_timeout and client_timeout <= srv.tokenTimeout \
                        else "server tokenTimeout"
                    waits[key] = whole - now
                else:
                    waits["server tokenTimeout"] = float(srv.tokenTimeout)
                    if client_timeout:
                        waits["client timeout"] = float(client_timeout)
                which = min(waits, key=waits.get)
                try:
                    chunk = await next_within(gen, max(0.0, waits[which]))
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    if stream:  # written into the stream as raw text by guard_stream
                        raise DeadlineExceeded(which) from None
                    raise incomplete_error(f"Engine callback timeout: {which}") from None
                except TritonError as exc:
                    raise to_mindie(exc) from None
                yield chunk
                if chunk.final:
                    return
        finally:
            ids = self.running.get(request_id)
            if ids is not None:
                ids.discard(triton_id)
                if not ids:
                    del self.running[request_id]
            await gen.aclose()


async def until_disconnect(request: Request, work):
    """Run ``work`` (a coroutine) but cancel it if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _replay(head: Chunk | DeadlineExceeded | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    """``head`` (already received), then the rest of the stream; closing this closes ``rest``."""
    try:
        if isinstance(head, DeadlineExceeded):
            raise head
        if head is None:
            return
        yield head
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class SlowReader(Exception):
    """The client stopped reading a stream: a write waited longer than the write timeout."""


class BoundedStreamingResponse(StreamingResponse):
    """An SSE response that gives up on a client that stops reading.

    What a stream holds in memory is bounded by uvicorn's write buffer (it pauses the
    writer at 64 KiB) plus the socket buffers, because events are produced only as they
    are written. A client that stops reading would still keep its generation running and
    pile responses up in Triton; so when one write waits longer than ``write_timeout``
    the Triton call is cancelled (the body iterator is closed) and the connection is
    dropped.
    """

    def __init__(self, events: AsyncIterator[bytes], request_id: str, write_timeout: float):
        # exactly MindIE's header: given as media_type, Starlette would add "; charset=utf-8"
        super().__init__(events, headers={"Content-Type": "text/event-stream"})
        self.request_id = request_id
        self.write_timeout = write_timeout

    async def stream_response(self, send) -> None:
        async def bounded_send(message) -> None:
            try:
                await within(send(message), self.write_timeout)
            except asyncio.TimeoutError:
                log.warning("stream %s: the client read nothing for %.0fs; cancelling it",
                            self.request_id, self.write_timeout)
                raise SlowReader(self.request_id) from None

        try:
            await super().stream_response(bounded_send)
        finally:
            await self.body_iterator.aclose()  # cancels the Triton call at once


def json_response(body: dict) -> Response:
    """MindIE's non-stream answer: compact JSON, ``Connection: close``."""
    return Response(compact(body), media_type="application/json", headers={"Connection": "close"})


async def guard_stream(events: AsyncIterator[bytes], request_id: str) -> AsyncIterator[bytes]:
    """Pass SSE bytes through; a failure after the stream started ends it MindIE's way.

    Timeouts are written as raw text (no ``data:``), other errors as a final error event.
    """
    try:
        async for data in events:
            yield data
    except DeadlineExceeded as exc:
        yield str(exc).encode()
    except MindIEError as exc:
        yield event({"error": exc.message, "error_type": exc.error_type})
    except ClientGone:
        return
    except Exception:
        log.exception("stream %s failed", request_id)
        yield event({"error": "Failed to get engine response.", "error_type": "Incomplete Generation"})
