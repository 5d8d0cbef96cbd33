"""A tiny KV budget through the whole stack: requests queue (or are preempted) and all finish."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import MODEL_NAME, Stack, wait_for, write_settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_kv_exhaustion_queues_instead_of_failing(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDIE_TEST_PORT_BASE", str(int(os.environ.get("MINDIE_TEST_PORT_BASE", "18000")) + 900))
    cfg = write_settings(tmp_path, **{"BackendConfig.ScheduleConfig": {
        "kvCacheBlocks": 8, "cacheBlockSize": 16, "enablePrefixCache": False}})
    stack = Stack(cfg)
    try:
        stack.start()

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
    finally:
        stack.stop()
