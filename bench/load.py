"""Closed-loop streaming clients: ``c`` concurrent clients, each sending its requests in turn.

Used for the stack (SSE over HTTP with httpx) and for the engine alone (in-process
``Engine.submit`` with an emit callback): both produce :class:`StreamTrace` records.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable

import httpx

from bench.stats import STAGGERED, RunResult, StreamTrace, from_traces
from bench.workload import Workload, make_prompts

log = logging.getLogger(__name__)

OneRequest = Callable[[str], Awaitable[StreamTrace]]
SendRequest = Callable[[str, int], Awaitable[StreamTrace]]


@contextlib.contextmanager
def clients_on(cpus: tuple[int, ...] | None):
    """Run this thread (the bench's asyncio clients) on ``cpus`` within the block.

    With the engine pinned (``ModelConfig.cpuAffinity``), the clients stay off its cores
    like the rest of the stack, as remote clients would; ``None`` changes nothing.
    """
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def warm_up(send: SendRequest, concurrency: int) -> None:
    """One request, then a burst of ``concurrency`` requests that end one after another.

    Request ``i`` of the burst asks for ``i + 1`` tokens, so the decode batch passes
    through every size from ``concurrency`` down to 1 once before anything is timed
    (kernels are prepared per shape on first use). Raises if any warm-up request fails.
    """
    first = await send("Hello, warm-up.", 4)
    burst = await asyncio.gather(*(send(f"Warm-up {i}: {p}", i + 1)
                                   for i, p in enumerate(make_prompts(concurrency))))
    failed = [t.error for t in [first, *burst] if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} warm-up request(s) failed, e.g. {failed[0]}")


async def closed_loop(one: OneRequest, prompts: list[str], concurrency: int, stagger_s: float = 0.0,
                      unmeasured_per_client: int = 0) -> tuple[list[StreamTrace], float]:
    """Run ``prompts`` through ``concurrency`` clients; return the traces and the wall time.

    With ``stagger_s``, client ``i`` starts ``i * stagger_s / concurrency`` later, and the
    first ``unmeasured_per_client`` requests of each client are sent but not returned
    (they arrive while the other clients are still starting).
    """
    queues = [prompts[i::concurrency] for i in range(concurrency)]
    traces: list[StreamTrace] = []

    async def client(i: int, mine: list[str]) -> None:
        if stagger_s:
            await asyncio.sleep(i * stagger_s / concurrency)
        for k, prompt in enumerate(mine):
            trace = await one(prompt)
            if k >= unmeasured_per_client:
                traces.append(trace)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i, q) for i, q in enumerate(queues)))
    return traces, time.perf_counter() - t0


async def staggered(one: OneRequest, workload: Workload, concurrency: int, lockstep: list[StreamTrace],
                    system: str, dtype: str) -> RunResult:
    """TTFT of newcomers that arrive while the other clients decode.

    In the closed loop every client asks for the same number of tokens, so all of them
    finish in the same step and send their next request together: each round is a burst
    of prefills. Here client ``i`` starts ``i / c`` of a request's duration (the mean of
    the ``lockstep`` run) after client 0, and only requests sent after every client has
    started are measured: each one arrives while the other ``c - 1`` decode.
    """
    done = [t.token_times[-1] - t.sent for t in lockstep if t.token_times and not t.error]
    period = sum(done) / len(done) if done else 1.0
    prompts = make_prompts(concurrency * (workload.rounds + 1))
    traces, wall = await closed_loop(one, prompts, concurrency, stagger_s=period, unmeasured_per_client=1)
    res = from_traces(f"{system} {STAGGERED}", concurrency, dtype, traces, wall)
    res.note = f"clients start {1e3 * period / concurrency:.0f} ms apart; for TTFT (tok/s includes the ramp)"
    log_result(res, traces)
    return res


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}


async def sse_request(client: httpx.AsyncClient, url: str, body: dict) -> StreamTrace:
    """One streaming ``/v1/completions`` call; a token arrival is an event that carries a choice.

    A closing event with no text and a finish reason (llama-server sends one after the
    last token; the stack puts the finish reason on the last token's event) is not a token.
    """
    trace = StreamTrace(sent=time.perf_counter())
    events = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                trace.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return trace
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if "error" in msg:
                    trace.error = str(msg["error"])
                    return trace
                choices = msg.get("choices") or []
                usage = msg.get("usage")
                if usage:
                    trace.tokens = int(usage.get("completion_tokens", 0))
                if any(c.get("text") or not c.get("finish_reason") for c in choices):
                    trace.token_times.append(now)
                    events += 1
    except (httpx.HTTPError, ValueError) as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
        return trace
    trace.tokens = trace.tokens or events
    return trace


async def drive_stack(base_url: str, model: str, workload: Workload, dtype: str) -> list[RunResult]:
    """The stack at each concurrency of ``workload``, after a warm-up (see :func:`warm_up`)."""
    return await drive_completions(base_url, model, workload, "stack", dtype)


async def drive_completions(base_url: str, model: str, workload: Workload, system: str,
                            dtype: str) -> list[RunResult]:
    """Any streaming ``/v1/completions`` server at each concurrency of ``workload``, after a warm-up."""
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def send(prompt: str, max_tokens: int) -> StreamTrace:
            return await sse_request(client, url, completion_body(model, prompt, max_tokens))

        await warm_up(send, max(workload.concurrencies))

        async def one(prompt: str) -> StreamTrace:
            return await send(prompt, workload.max_tokens)

        for c in workload.concurrencies:
            traces, wall = await closed_loop(one, workload.prompts_for(c), c)
            res = from_traces(system, c, dtype, traces, wall)
            log_result(res, traces)
            results.append(res)
            if c in workload.staggered:
                results.append(await staggered(one, workload, c, traces, system, dtype))
    return results


def log_result(res: RunResult, traces: list[StreamTrace]) -> None:
    summary = res.summary()
    log.info("%s c=%d: %s tok/s, TTFT p50 %s ms, ITL p50 %s ms, %d errors", res.system, res.concurrency,
             summary["tok_per_s"], summary["ttft_p50_ms"], summary["itl_p50_ms"], res.errors)
    for t in traces:
        if t.error:
            log.warning("%s c=%d request failed: %s", res.system, res.concurrency, t.error)
