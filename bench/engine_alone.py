"""The engine without the stack: ``build_engine`` in this process, driven like the HTTP clients.

Each request is a :class:`llm_engine.sequence.Request` whose ``emit`` callback (run on
the engine thread) hands outputs back to the asyncio loop, so TTFT/ITL are taken at
the same point a streaming client would see them, minus HTTP, the adapter and Triton.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

from bench.load import clients_on, closed_loop, log_result, warm_up
from bench.stats import RunResult, StreamTrace, from_traces
from bench.workload import Workload

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


def run_engine_alone(config_path: Path | None, workload: Workload, dtype: str = "") -> list[RunResult]:
    """Build the engine from the same settings file as the stack and run every concurrency.

    ``dtype`` (the one the stack's engine chose) overrides the file's: ``auto`` is decided
    per process by a short timing, and the overhead comparison needs the same dtype.
    """
    import torch
    from llm_engine.config import load_settings
    from llm_engine.factory import build_engine

    settings = load_settings(config_path)
    if dtype:
        settings.model.dtype = dtype
    threads = torch.get_num_threads()  # build_engine applies cpuThreads; the peers run after us
    engine = build_engine(settings)
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    cores = engine.cores
    log.info("engine alone: %s, %d torch threads, %s", dtype, torch.get_num_threads(),
             f"engine on CPUs {list(cores.engine)}, clients on {list(cores.rest)}" if cores else "unpinned")
    engine.start()
    try:
        with clients_on(cores.rest if cores else None):
            return asyncio.run(_drive(engine, workload, dtype))
    finally:
        engine.stop()
        torch.set_num_threads(threads)


async def _drive(engine, workload: Workload, dtype: str) -> list[RunResult]:
    async def send(prompt: str, max_tokens: int) -> StreamTrace:
        return await engine_request(engine, prompt, max_tokens)

    await warm_up(send, max(workload.concurrencies))

    async def one(prompt: str) -> StreamTrace:
        return await engine_request(engine, prompt, workload.max_tokens)

    results = []
    for c in workload.concurrencies:
        traces, wall = await closed_loop(one, workload.prompts_for(c), c)
        res = from_traces("engine alone", c, dtype, traces, wall)
        log_result(res, traces)
        results.append(res)
    return results
