"""Two CPU instances of the llm model: requests are spread over both engines."""

from __future__ import annotations

import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_NAME, ROOT, Stack, wait_for, write_settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_two_instances_share_the_load(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDIE_TEST_PORT_BASE", str(int(os.environ.get("MINDIE_TEST_PORT_BASE", "18000")) + 700))
    repo = tmp_path / "model_repository" / "llm"
    repo.mkdir(parents=True)
    (repo / "1").symlink_to(ROOT / "model_repository" / "llm" / "1")
    config = (ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    config, n = re.subn(r"instance_group \[.*?\]", "instance_group [ { count: 2, kind: KIND_CPU } ]", config)
    assert n == 1
    (repo / "config.pbtxt").write_text(config)
    (tmp_path / "model_repository" / "llm_unary").symlink_to(ROOT / "model_repository" / "llm_unary")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # EXECUTION_ENV_PATH is ../../.venv from the model
    cfg = write_settings(tmp_path, **{"BackendConfig.ScheduleConfig": {"kvCacheMemoryMiB": 128}})
    stack = Stack(cfg)
    stack.sup.model_repository = tmp_path / "model_repository"
    try:
        stack.start()

        def call(i):
            return httpx.post(stack.url + "/v1/completions", json={
                "model": MODEL_NAME, "prompt": f"Request {i}", "max_tokens": 8, "ignore_eos": True}, timeout=120)

        with ThreadPoolExecutor(8) as pool:
            assert all(r.status_code == 200 for r in pool.map(call, range(16)))
        # each engine pushes its counters a few times a second, so the last ones may lag the responses
        per_instance = {}

        def every_token_counted() -> bool:
            per_instance.clear()
            for line in httpx.get(stack.metrics_url).text.splitlines():
                if line.startswith("llm_generation_tokens_total{"):
                    instance = re.search(r'instance="([^"]+)"', line).group(1)
                    per_instance[instance] = float(line.rsplit(" ", 1)[1])
            return sum(per_instance.values()) == 16 * 8

        assert wait_for(every_token_counted, timeout=5), per_instance
        assert len(per_instance) == 2, per_instance
        assert all(v > 0 for v in per_instance.values()), per_instance
        # two engines would share the pinned cores: the launcher leaves every thread unpinned
        assert stack.sup.cores is None
        everything = os.sched_getaffinity(0)
        for pid in (stack.sup.triton.pid, *stack.sup.stubs):
            assert os.sched_getaffinity(pid) == everything
        _unary_cancel_reaches_whichever_instance_runs_it(stack)
    finally:
        stack.stop()
        shutil.rmtree(tmp_path / "model_repository", ignore_errors=True)


def _unary_cancel_reaches_whichever_instance_runs_it(stack) -> None:
    """Every instance sees llm_unary's cancel flag, whichever runs the call."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    def inputs(i):
        text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[f"Essay {i} about the sea"]], dtype=object))
        params = grpcclient.InferInput("sampling_parameters", [1, 1], "BYTES")
        params.set_data_from_numpy(np.array([['{"max_tokens": 2000, "ignore_eos": true}']], dtype=object))
        return [text, params]

    client = grpcclient.InferenceServerClient(stack.grpc_url)
    before = stack.engine_metric("llm_request_cancelled_total")
    done: queue.Queue = queue.Queue()
    calls = [client.async_infer("llm_unary", inputs(i), callback=lambda result, error: done.put(error)) for i in range(6)]
    assert wait_for(lambda: stack.engine_metric("llm_num_requests_running") == 6, timeout=30), \
        stack.engine_metric("llm_num_requests_running")
    for call in calls:
        call.cancel()
    assert all(done.get(timeout=10) is not None for _ in calls)
    assert wait_for(lambda: stack.engine_metric("llm_request_cancelled_total") >= before + 6, timeout=15), \
        (before, stack.engine_metric("llm_request_cancelled_total"))
    assert wait_for(lambda: stack.engine_metric("llm_num_requests_running") == 0, timeout=5)
