"""A tiny KV budget through the whole stack: requests queue (or are preempted) and all finish."""

from __future__ import annotations

import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import MODEL_NAME, Stack, wait_for, write_settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def small_kv(tmp_path_factory):
    """8 KV blocks of 16 tokens: two or three short sequences at most."""
    port_base = int(os.environ.get("MINDIE_TEST_PORT_BASE", "18000"))
    os.environ["MINDIE_TEST_PORT_BASE"] = str(port_base + 900)
    try:
        cfg = write_settings(tmp_path_factory.mktemp("small_kv"), **{"BackendConfig.ScheduleConfig": {
            "kvCacheBlocks": 8, "cacheBlockSize": 16, "enablePrefixCache": False}})
    finally:
        os.environ["MINDIE_TEST_PORT_BASE"] = str(port_base)
    stack = Stack(cfg)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def test_kv_exhaustion_queues_instead_of_failing(small_kv):
    stack = small_kv

    def call(i):
        return httpx.post(stack.url + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": f"Request number {i} asks for a story about the sea",
            "max_tokens": 40, "temperature": 0, "ignore_eos": True}, timeout=300)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(call, range(6)))
    assert [r.status_code for r in results] == [200] * 6
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in results)
    # 8 blocks of 16 tokens cannot hold six 52-token sequences: some had to wait or be preempted
    assert stack.engine_metric("llm_preemptions_total") > 0
    # gauges are pushed to Triton a few times a second, so the last one may lag the responses
    assert wait_for(lambda: stack.engine_metric("llm_kv_cache_usage_perc") == 0, timeout=10)


def test_clients_that_hang_up_while_queued_are_dropped(small_kv):
    """Six 100-token streams on a cache that holds one of them at full length; all six clients
    hang up at once. Each request ends, and the ones still queued end cancelled, not run. One
    that was running may finish first: a 100-token request takes ~0.5 s here, about as long as
    the hang-up takes to be seen (the engine got fast enough that one did)."""
    stack = small_kv
    before = stack.engine_metric("llm_request_cancelled_total")
    succeeded = stack.engine_metric("llm_request_success_total")
    host, port = stack.url.removeprefix("http://").split(":")
    socks = []
    try:
        for i in range(6):
            body = json.dumps({"model": MODEL_NAME, "prompt": f"Story {i} about the sea", "max_tokens": 100,
                               "ignore_eos": True, "stream": True}).encode()
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(s)
        assert wait_for(lambda: stack.engine_metric("llm_num_requests_waiting") >= 1, timeout=30)
    finally:
        for s in socks:
            s.close()

    def ended() -> tuple[float, float]:
        return (stack.engine_metric("llm_request_cancelled_total") - before,
                stack.engine_metric("llm_request_success_total") - succeeded)

    assert wait_for(lambda: sum(ended()) >= 6, timeout=15), ended()
    cancelled, finished = ended()
    assert cancelled >= 4 and finished <= 2, (cancelled, finished)
    assert wait_for(lambda: stack.engine_metric("llm_num_requests_waiting") == 0
                    and stack.engine_metric("llm_num_requests_running") == 0
                    and stack.engine_metric("llm_kv_cache_usage_perc") == 0, timeout=10)


def test_a_prompt_larger_than_the_kv_cache_is_refused_and_the_rest_still_run(small_kv):
    """8 blocks of 16 tokens hold 128: a longer prompt could never be scheduled, so it is
    refused at once (424, as for maxInputTokenLen) instead of waiting at the queue's head."""
    stack = small_kv
    r = httpx.post(stack.url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": "the sea " * 100, "max_tokens": 4}, timeout=30)
    assert r.status_code == 424, r.text
    assert "Failed to enqueue inferRequest" in r.json()["error"] and "cannot be greater than 127" in r.json()["error"]
    r = httpx.post(stack.url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": "the sea " * 40, "max_tokens": 500, "temperature": 0, "ignore_eos": True},
        timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 128
