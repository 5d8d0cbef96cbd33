"""Closed-loop streaming clients: ``c`` concurrent clients, each sending its requests in turn.

Used for the stack (SSE over HTTP with aiohttp) and for the engine alone (in-process
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

import aiohttp

from bench.cpu import CpuMeter, shares
from bench.stats import ENGINE, STACK, STAGGERED, RunResult, StreamTrace, from_traces
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


async def sse_request(client: aiohttp.ClientSession, url: str, body: dict) -> StreamTrace:
    """One streaming ``/v1/completions`` call; a token arrival is an event that carries a choice.

    A closing event with no text and a finish reason (llama-server sends one after the
    last token; the stack puts the finish reason on the last token's event) is not a token.
    """
    trace = StreamTrace(sent=time.perf_counter())
    events = 0
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                trace.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return trace
            async for line in resp.content:  # one line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
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
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
        return trace
    trace.tokens = trace.tokens or events
    return trace


IDLE_SECONDS = 2.0  # how long the clients keep an idle connection (see http_client)


def http_client(keep_alive: bool = True) -> aiohttp.ClientSession:
    """The clients' HTTP session: aiohttp, whose C parser took 0.09-0.14 ms of CPU per streamed
    token where httpx took 0.16-0.23 (32 and 8 streams, measured on the 2-core EPYC): on a
    machine the clients share with the stack, that CPU is taken from the engine's cores.

    ``keep_alive=False``: a new connection per request, for a server that closes its
    connection after a stream while announcing keep-alive (llama-server does): aiohttp then
    reuses the closed one and fails the next request ("Can not write request body", every
    other request of one client), where httpx noticed and reconnected.

    Idle connections are dropped after :data:`IDLE_SECONDS`, before the adapter's server
    closes them (uvicorn's keep-alive, 5 s): with aiohttp's 15 s, the stack's 32 pooled
    connections sat idle through the engine alone's ~5 s turn and were closed by the server
    just as the next turn reused them ("Server disconnected", "Can not write request body")."""
    idle = {"keepalive_timeout": IDLE_SECONDS} if keep_alive else {"force_close": True}
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, **idle),
                                 timeout=aiohttp.ClientTimeout(total=600.0))


def completions_sender(client: aiohttp.ClientSession, base_url: str, model: str) -> SendRequest:
    """``send(prompt, max_tokens)`` as one streaming ``/v1/completions`` call."""
    url = f"{base_url}/v1/completions"

    async def send(prompt: str, max_tokens: int) -> StreamTrace:
        return await sse_request(client, url, completion_body(model, prompt, max_tokens))
    return send


async def drive_completions(base_url: str, model: str, workload: Workload, system: str,
                            dtype: str, keep_alive: bool = True) -> list[RunResult]:
    """Any streaming ``/v1/completions`` server, as :func:`drive` runs it (with its staggered run)."""
    async with http_client(keep_alive) as client:
        return await drive({system: completions_sender(client, base_url, model)}, workload, dtype,
                           stagger=(system,))


async def drive_stack_and_engine(base_url: str, model: str, engine_send: SendRequest, workload: Workload,
                                 dtype: str, meter: CpuMeter | None = None) -> list[RunResult]:
    """The stack and the engine alone, taking turns (see :func:`drive`); the stack also staggered,
    and its processes' CPU read by ``meter`` around its turns."""
    async with http_client() as client:
        systems = {STACK: completions_sender(client, base_url, model), ENGINE: engine_send}
        return await drive(systems, workload, dtype, stagger=(STACK,), meters={STACK: meter} if meter else None)


async def drive(systems: dict[str, SendRequest], workload: Workload, dtype: str,
                stagger: tuple[str, ...] = (), meters: dict[str, CpuMeter] | None = None) -> list[RunResult]:
    """Every system at each concurrency of ``workload``, after a warm-up each (:func:`warm_up`).

    The prompts of a level are split into ``workload.repeats`` parts, and the systems take
    turns over them in A B B A order, so that a machine whose speed drifts within minutes
    shifts every system alike; each system's parts are pooled into one result. Systems
    named in ``stagger`` also get the staggered run at ``workload.staggered`` levels. A
    system with a meter in ``meters`` gets its processes' CPU over its turns in ``RunResult.cpu``.
    """
    meters = meters or {}
    for send in systems.values():
        await warm_up(send, max(workload.concurrencies))
    results = []
    for c in workload.concurrencies:
        prompts = workload.prompts_for(c)
        pooled: dict[str, tuple[list[StreamTrace], float]] = {name: ([], 0.0) for name in systems}
        cpu: dict[str, dict[str, float]] = {name: {} for name in systems}
        for part in range(workload.repeats):
            order = list(systems) if part % 2 == 0 else list(reversed(systems))
            for name in order:
                meter = meters.get(name)
                before = meter.read() if meter else None
                traces, wall = await closed_loop(_one(systems[name], workload.max_tokens),
                                                 prompts[part::workload.repeats], c)
                if meter:
                    for group, s in meter.spent(before, meter.read()).items():
                        cpu[name][group] = cpu[name].get(group, 0.0) + s
                pooled[name] = (pooled[name][0] + traces, pooled[name][1] + wall)
        for name, (traces, wall) in pooled.items():
            res = from_traces(name, c, dtype, traces, wall)
            if cpu[name]:
                res.cpu = shares(cpu[name], wall, res.output_tokens)
            log_result(res, traces)
            results.append(res)
            if name in stagger and c in workload.staggered:
                results.append(await staggered(_one(systems[name], workload.max_tokens), workload, c, traces,
                                               name, dtype))
    return results


def _one(send: SendRequest, max_tokens: int) -> OneRequest:
    async def one(prompt: str) -> StreamTrace:
        return await send(prompt, max_tokens)
    return one


def log_result(res: RunResult, traces: list[StreamTrace]) -> None:
    summary = res.summary()
    log.info("%s c=%d: %s tok/s, TTFT p50 %s ms, ITL p50 %s ms, %d errors", res.system, res.concurrency,
             summary["tok_per_s"], summary["ttft_p50_ms"], summary["itl_p50_ms"], res.errors)
    for t in traces:
        if t.error:
            log.warning("%s c=%d request failed: %s", res.system, res.concurrency, t.error)
