"""A bounded soak through the real stack: mixed and cancelled requests leave no leak behind."""

from __future__ import annotations

import httpx
import pytest

from adapter.launch import child_pids
from bench.soak import report, run
from tests.conftest import MODEL_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_soak_returns_to_baseline(stack):
    pids = [stack.sup.adapter.pid, stack.sup.triton.pid, *child_pids(stack.sup.triton.pid)]
    before, after, stats = run(stack.url, pids, total=400, concurrency=12, seed=7)
    ok = report(before, after, stats)
    assert stats.get("errors", 0) == 0, stats
    assert ok, "file descriptors or /dev/shm did not return to baseline"
    for pid in pids:
        assert after.rss_mib[pid] < before.rss_mib[pid] * 1.25 + 64, (pid, before.rss_mib, after.rss_mib)
    assert stack.engine_metric("llm_num_requests_running") == 0
    r = httpx.post(stack.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
