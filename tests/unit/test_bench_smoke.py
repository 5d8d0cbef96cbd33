"""The bench's pure parts on fake data: statistics, ratios, tables, CSV and plot (no stack, no model)."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import subprocess
import sys

import pytest

from bench.load import closed_loop, drive, staggered
from bench.machine import MachineInfo
from bench.report import checks_table, compare, plot, results_table, write_checks_csv, write_csv
from bench.stack import descendants, write_settings
from bench.stats import RunResult, StreamTrace, from_traces, percentile, ratio
from bench.workload import QUICK, Workload, make_prompts

MACHINE = MachineInfo(cpu_model="Fake CPU", cores=2, torch_threads=2, fp32_gflops=100.0, bf16_gflops=400.0,
                      mem_read_gbs=27.0)
FP32_BYTES = 540_000_000


def fake(system: str, c: int, tps: float, ttft: float, dtype: str = "float32") -> RunResult:
    return RunResult(system=system, concurrency=c, dtype=dtype, requests=c, output_tokens=int(tps * 10),
                     wall_s=10.0, ttft_s=[ttft] * c, itl_s=[0.02, 0.03])


def fake_results() -> list[RunResult]:
    return [
        fake("stack", 1, 40, 0.050), fake("stack", 8, 200, 0.080), fake("stack", 32, 500, 0.200),
        fake("engine alone", 1, 41, 0.049), fake("engine alone", 8, 205, 0.075),
        fake("engine alone", 32, 510, 0.190),
        fake("naive generate", 1, 17, 0.06), fake("static batch", 32, 219, 0.3),
        fake("transformers CB", 32, 98, 1.0), fake("transformers CB", 32, 164, 0.9, "bfloat16"),
        RunResult(system="llama-cpp-python", concurrency=1, dtype="Q4_1", note="not importable"),
        fake("llama-server", 1, 110, 0.04, "Q4_1"), fake("llama-server", 8, 209, 0.17, "Q4_1"),
        fake("llama-server", 32, 230, 0.5, "Q4_1"),
        fake("stack staggered", 8, 150, 0.120), fake("llama-server staggered", 8, 180, 0.1, "Q4_1"),
    ]


def test_percentile_interpolates_and_handles_edges() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_ratio_is_nan_when_undefined() -> None:
    assert ratio(10, 4) == 2.5
    assert math.isnan(ratio(1, 0))
    assert math.isnan(ratio(math.nan, 1))


def test_traces_fold_into_a_result() -> None:
    ok = StreamTrace(sent=0.0, token_times=[0.1, 0.15, 0.25], tokens=3)
    bad = StreamTrace(sent=0.0, error="HTTP 500")
    res = from_traces("stack", 2, "float32", [ok, bad], wall_s=0.5)
    assert (res.requests, res.errors, res.output_tokens) == (1, 1, 3)
    assert res.ttft_s == [pytest.approx(0.1)]
    assert res.itl_s == [pytest.approx(0.05), pytest.approx(0.1)]
    assert res.tok_per_s == pytest.approx(6.0)
    assert res.summary()["ttft_p50_ms"] == 100.0


def test_compare_computes_ratios_and_verdicts() -> None:
    checks = {c.name: c for c in compare(fake_results(), MACHINE, FP32_BYTES)}
    naive = checks["stack@32 / naive generate"]
    assert naive.value == pytest.approx(500 / 17) and naive.ok
    assert checks["stack@32 / static batch"].value == pytest.approx(500 / 219)
    cb = checks["stack@32 / transformers CB float32"]
    assert cb.value == pytest.approx(500 / 98) and cb.ok
    assert checks["stack@32 / transformers CB bfloat16"].ok is None  # other dtype: no verdict
    assert checks["stack@32 / llama-cpp-python (1 stream)"].status == "n/a"
    roof = checks["stack@32 % of float32 matmul roofline"]
    assert roof.value == pytest.approx(100 * 500 * 0.27 / 100.0) and roof.ok
    mem = checks["stack@1 % of memory-bound limit"]
    assert mem.value == pytest.approx(100 * 40 / (27e9 / FP32_BYTES)) and mem.ok
    # the engine's own weight format, when given (GGUF Q4_1 blocks read fewer bytes than the dtype)
    q4 = {c.name: c for c in compare(fake_results(), MACHINE, FP32_BYTES, weight_bytes=135_000_000)}
    assert q4["stack@1 % of memory-bound limit"].value == pytest.approx(100 * 40 / (27e9 / 135e6))
    assert "135 MB" in q4["stack@1 % of memory-bound limit"].note
    assert checks["stack overhead, throughput @32"].value == pytest.approx(100 * (1 - 500 / 510))
    assert checks["stack overhead, p50 TTFT @1"].value == pytest.approx(1.0)
    ttft = checks["stack p50 TTFT @8 / @1"]
    assert ttft.value == pytest.approx(1.6) and ttft.status == "PASS"
    server = checks["stack@32 / llama-server@32"]
    assert server.value == pytest.approx(500 / 230) and server.ok
    assert checks["stack@1 / llama-server@1 (stretch)"].value == pytest.approx(40 / 110)
    reference = checks["llama-server p50 TTFT @8 / @1"]
    assert reference.value == pytest.approx(0.17 / 0.04) and reference.status == "-"
    spread = checks["stack p50 TTFT @8 staggered / @1"]
    assert spread.value == pytest.approx(2.4) and spread.status == "FAIL"
    assert checks["llama-server p50 TTFT @8 staggered / @1"].value == pytest.approx(0.1 / 0.04)


def test_llama_server_is_found_and_started_with_one_slot_per_stream(tmp_path, monkeypatch) -> None:
    from bench.llama_server import CTX_PER_SLOT, find_binary, server_args

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    assert find_binary(str(binary)) == binary
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    assert find_binary() == binary
    with pytest.raises(FileNotFoundError):  # a path given on the command line must be right
        find_binary(str(tmp_path / "missing"))
    args = server_args(binary, tmp_path / "m.gguf", 1234, 32, 2)
    assert args[args.index("-np") + 1] == "32" and args[args.index("-c") + 1] == str(32 * CTX_PER_SLOT)
    assert args[args.index("--port") + 1] == "1234" and args[args.index("-t") + 1] == "2"


def test_the_limits_are_the_higher_of_two_probes() -> None:
    slow = MachineInfo(cpu_model="Fake CPU", cores=2, torch_threads=2, fp32_gflops=120.0, bf16_gflops=213.0,
                       mem_read_gbs=30.0)
    best = MACHINE.best_of(slow)
    assert (best.fp32_gflops, best.bf16_gflops, best.mem_read_gbs) == (120.0, 400.0, 30.0)
    assert best == slow.best_of(MACHINE)


def test_tables_csv_and_plot(tmp_path) -> None:
    results = fake_results()
    checks = compare(results, MACHINE, FP32_BYTES)
    table = results_table(results)
    assert "| stack | float32 | 32 | 500.0 |" in table
    assert "skipped" in table and "not importable" in table
    assert "PASS" in checks_table(checks)
    write_csv(tmp_path / "results.csv", results)
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == len(results) and rows[0]["system"] == "stack" and rows[0]["tok_per_s"] == "40.0"
    write_checks_csv(tmp_path / "checks.csv", checks)
    assert len(list(csv.reader((tmp_path / "checks.csv").open()))) == len(checks) + 1
    plot(tmp_path / "results.png", results, "fake")
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompts_are_distinct_and_stable() -> None:
    ps = make_prompts(64)
    assert len(set(ps)) == 64 and ps == make_prompts(64)
    assert len(set(make_prompts(200))) == 200
    assert len(QUICK.prompts_for(4)) == 4


def test_closed_loop_runs_every_prompt_with_bounded_concurrency() -> None:
    active, peak = 0, 0

    async def one(prompt: str) -> StreamTrace:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.001)
        active -= 1
        return StreamTrace(sent=0.0, token_times=[0.001], tokens=len(prompt))

    traces, wall = asyncio.run(closed_loop(one, ["a", "bb", "ccc", "dddd", "e"], 2))
    assert sorted(t.tokens for t in traces) == [1, 1, 2, 3, 4] and peak == 2 and wall > 0


def test_staggered_clients_start_apart_and_measure_only_requests_sent_after_the_ramp() -> None:
    starts: dict[str, float] = {}

    async def one(prompt: str) -> StreamTrace:
        now = asyncio.get_running_loop().time()
        starts[prompt] = now
        await asyncio.sleep(0.04)
        return StreamTrace(sent=now, token_times=[now + 0.01, now + 0.04], tokens=2)

    lockstep = [StreamTrace(sent=0.0, token_times=[0.01, 0.08])]  # requests took 80 ms
    res = asyncio.run(staggered(one, QUICK, 4, lockstep, "stack", "float32"))
    assert res.system == "stack staggered" and res.concurrency == 4
    prompts = make_prompts(4 * (QUICK.rounds + 1))
    assert len(starts) == len(prompts) and res.requests == 4 * QUICK.rounds
    firsts = sorted(starts[p] for p in prompts[:4])  # each client's first request: 20 ms apart
    gaps = [b - a for a, b in zip(firsts, firsts[1:])]
    assert all(0.015 < g < 0.05 for g in gaps), gaps
    assert "20 ms apart" in res.note


def test_systems_take_turns_and_each_gets_every_prompt_of_a_level() -> None:
    calls: list[tuple[str, str, int]] = []

    def system(name: str):
        async def send(prompt: str, max_tokens: int) -> StreamTrace:
            calls.append((name, prompt, max_tokens))
            await asyncio.sleep(0)
            return StreamTrace(sent=0.0, token_times=[0.01, 0.02], tokens=2)
        return send

    work = Workload(max_tokens=3, concurrencies=(2,), rounds=2, repeats=2, min_requests=4, staggered=(2,))
    results = asyncio.run(drive({"a": system("a"), "b": system("b")}, work, "float32", stagger=("a",)))
    timed = [(n, p) for n, p, m in calls if m == 3]
    level, after = timed[:8], timed[8:]  # 4 prompts each, in 2 parts of 2; then a's staggered run
    for name in "ab":
        assert sorted(p for n, p in level if n == name) == sorted(work.prompts_for(2))
    assert [n for n, _ in level] == ["a", "a", "b", "b", "b", "b", "a", "a"]  # A B B A
    assert {n for n, _ in after} == {"a"}
    names = [(r.system, r.concurrency, r.requests) for r in results]
    assert names == [("a", 2, 4), ("a staggered", 2, 4), ("b", 2, 4)]


def test_the_bench_reads_the_launchers_cpu_split_from_its_log(tmp_path) -> None:
    from adapter.launch import CPU_SPLIT_LOG
    from bench.stack import Stack

    stack = Stack(tmp_path / "stack.log")
    (tmp_path / "stack.log").write_text("INFO [launch] " + CPU_SPLIT_LOG % ([3], [0, 1, 2]) + "\n")
    assert stack.rest_cpus() == (0, 1, 2)
    (tmp_path / "stack.log").write_text("INFO [launch] starting tritonserver\n")
    assert stack.rest_cpus() is None
    stack.tmpdir.cleanup()


def test_settings_copy_moves_every_port(tmp_path) -> None:
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"ServerConfig": {"port": 1025}, "TritonConfig": {"httpPort": 8000}}))
    cfg = write_settings(base, tmp_path / "out.json", [1, 2, 3, 4])
    assert cfg["ServerConfig"]["port"] == 1
    assert (cfg["TritonConfig"]["httpPort"], cfg["TritonConfig"]["grpcPort"],
            cfg["TritonConfig"]["metricsPort"]) == (2, 3, 4)
    assert json.loads((tmp_path / "out.json").read_text()) == cfg


def test_descendants_finds_a_child_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in descendants(os.getpid())
    finally:
        child.kill()
        child.wait()


def _http_response(status: str, body: bytes, content_type: str = "text/event-stream") -> bytes:
    """A whole HTTP/1.1 response that announces keep-alive."""
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nConnection: keep-alive\r\n"
            f"Keep-Alive: timeout=5, max=100\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def _clients_against(responses: list[bytes], close_after_each: bool, keep_alive: bool = True) -> list[StreamTrace]:
    """``bench.load``'s client (``sse_request`` over ``http_client``) sending one request per
    response to a local raw HTTP server, which writes each response in 37-byte pieces (borders
    inside events and lines) and, with ``close_after_each``, then closes its connection."""
    from bench.load import http_client, sse_request

    pending = list(responses)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while pending:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break  # the client closed this connection
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            response = pending.pop(0)
            for i in range(0, len(response), 37):
                writer.write(response[i:i + 37])
                await writer.drain()
            if close_after_each:
                break
        writer.close()

    async def go() -> list[StreamTrace]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        try:
            async with http_client(keep_alive) as client:
                return [await sse_request(client, url, {}) for _ in responses]
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(go())


def test_sse_parser_counts_tokens_not_a_closing_event() -> None:
    """llama-server ends with an empty event carrying the finish reason and usage: not a token.
    Served over real HTTP, in pieces that split events; then a refusal."""
    def chunk(text: str, finish: str | None, usage: dict | None = None) -> str:
        body = {"choices": [{"text": text, "index": 0, "finish_reason": finish}]}
        if usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    stream = (chunk("a", None) + chunk(" b", None) + chunk("", "length", {"completion_tokens": 2})
              + "data: [DONE]\n\n").encode()
    trace, refused = _clients_against([_http_response("200 OK", stream),
                                       _http_response("503 Service Unavailable", b'{"error": "busy"}',
                                                      "application/json")], close_after_each=False)
    assert not trace.error and trace.tokens == 2 and len(trace.token_times) == 2
    assert refused.error.startswith("HTTP 503") and not refused.token_times


def test_clients_without_keep_alive_survive_a_server_that_closes_after_each_stream() -> None:
    """llama-server announces keep-alive but closes the connection after a stream; aiohttp
    would reuse the closed one. ``http_client(keep_alive=False)`` connects per request."""
    body = b'data: {"choices": [{"text": "a", "index": 0, "finish_reason": null}]}\n\ndata: [DONE]\n\n'
    traces = _clients_against([_http_response("200 OK", body)] * 4, close_after_each=True, keep_alive=False)
    assert [(t.error, t.tokens) for t in traces] == [("", 1)] * 4


def test_the_clients_drop_idle_connections_before_the_adapter_closes_them() -> None:
    """A pooled connection kept longer than the adapter's keep-alive can be closed by the
    server just as a client reuses it: seen as "Server disconnected" after the engine
    alone's ~5 s turn at 32 streams."""
    from adapter.__main__ import KEEP_ALIVE_SECONDS
    from bench.load import IDLE_SECONDS

    assert IDLE_SECONDS < KEEP_ALIVE_SECONDS / 2
    body = b'data: {"choices": [{"text": "a", "index": 0, "finish_reason": null}]}\n\ndata: [DONE]\n\n'
    assert [t.tokens for t in _clients_against([_http_response("200 OK", body)] * 2, close_after_each=False)] == [1, 1]


def test_wait_ready_fails_fast_when_the_server_exits(tmp_path) -> None:
    from bench.stack import wait_ready

    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match="exited with 3"):
        wait_ready(proc, "http://127.0.0.1:9/health", 30, "peer", tmp_path / "peer.log")


def test_accelerator_bench_ratios_compare_the_engine_with_each_peer():
    from bench.accelerator import ratios

    results = [fake("engine alone", 1, 50, 0.02), fake("engine alone", 32, 1300, 0.06),
               fake("naive generate", 1, 50, 0.02), fake("transformers CB", 32, 650, 0.06),
               RunResult(system="static batch", concurrency=0, note="failed: boom")]
    assert ratios(results, 32) == [("engine alone @32 / naive generate @1", 26.0),
                                   ("engine alone @32 / transformers CB @32", 2.0)]
    assert ratios(results, 8) == []  # no engine row at that concurrency


def test_accelerator_bench_refuses_to_run_without_an_accelerator():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from bench.accelerator import main

    assert main(["--out", os.devnull]) == 2


@pytest.mark.slow
def test_accelerator_bench_runs_end_to_end_on_cpu(tmp_path):
    """``--quick --device cpu``: the engine and the three transformers peers on the real model."""
    out = tmp_path / "acc"
    proc = subprocess.run([sys.executable, "-m", "bench.accelerator", "--quick", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    systems = {r["system"] for r in summary["results"]}
    assert systems == {"engine alone", "naive generate", "static batch", "transformers CB"}
    assert all(r["tok_per_s"] and not r["errors"] for r in summary["results"])
    assert set(summary["ratios"]) == {f"engine alone @4 / {s}" for s in
                                      ("naive generate @1", "static batch @4", "transformers CB @4")}
    assert (out / "results.png").stat().st_size > 10_000 and (out / "results.csv").exists()
