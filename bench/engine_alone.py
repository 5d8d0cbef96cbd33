"""The engine without the stack: ``build_engine`` in this process, driven like the HTTP clients.

Each request is a :class:`llm_engine.sequence.Request` whose ``emit`` callback (run on
the engine thread) hands outputs back to the asyncio loop, so TTFT/ITL are taken at
the same point a streaming client would see them, minus HTTP, the adapter and Triton.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from bench.load import SendRequest
from bench.stats import StreamTrace

log = logging.getLogger(__name__)


async def engine_request(engine, prompt: str, max_tokens: int) -> StreamTrace:
    from llm_engine.errors import EngineError
    from llm_engine.params import parse_sampling_parameters
    from llm_engine.sequence import Request, StepOutput

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    trace = StreamTrace(sent=time.perf_counter())
    ids = engine.tokenizer(prompt).input_ids
    params = parse_sampling_parameters({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})

    def emit(out: StepOutput | EngineError) -> None:
        stamp = time.perf_counter()
        loop.call_soon_threadsafe(queue.put_nowait, (stamp, out))

    req = Request(request_id=uuid.uuid4().hex, prompt_ids=ids, params=params, emit=emit, stream=True)
    try:
        engine.prepare(req)
        engine.submit(req)
    except EngineError as exc:
        trace.error = str(exc)
        return trace
    while True:
        stamp, out = await queue.get()
        if isinstance(out, EngineError):
            trace.error = str(out)
            return trace
        if out.token_ids or out.final:
            trace.token_times.append(stamp)
        trace.tokens = out.completion_tokens
        if out.final:
            return trace


class EngineAlone(NamedTuple):
    send: SendRequest
    weight_bytes_per_token: int  # what one decode step reads of the weights (the memory-bound limit)


@contextlib.contextmanager
def engine_alone(config_path: Path | None, dtype: str = "") -> Iterator[EngineAlone]:
    """Build the engine from the same settings file as the stack; yield its ``send`` and the
    bytes of weights a token reads in the weight format it loaded.

    ``dtype`` (the one the stack's engine chose) overrides the file's: ``auto`` is decided
    per process by a short timing, and the overhead comparison needs the same dtype. The
    engine thread pins itself as in the stack; torch's thread count is restored on exit
    for the peers that run after.
    """
    import torch
    from llm_engine.config import load_settings
    from llm_engine.factory import build_engine

    settings = load_settings(config_path)
    if dtype:
        settings.model.dtype = dtype
    threads = torch.get_num_threads()
    engine = build_engine(settings)
    cores = engine.cores
    log.info("engine alone: %s, %d torch threads, %s", str(engine.runner.dtype).removeprefix("torch."),
             torch.get_num_threads(), f"on CPUs {list(cores.engine)}" if cores else "unpinned")
    engine.start()

    async def send(prompt: str, max_tokens: int) -> StreamTrace:
        return await engine_request(engine, prompt, max_tokens)

    try:
        yield EngineAlone(send, engine.runner.weight_bytes_per_token())
    finally:
        engine.stop()
        torch.set_num_threads(threads)
