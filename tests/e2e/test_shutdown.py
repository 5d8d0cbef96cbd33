"""Stopping the stack after traffic: tritonserver unloads the model and exits on its own."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import MODEL_NAME, Stack, write_settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_model_is_unloaded_after_finished_requests(tmp_path, monkeypatch, caplog):
    """The adapter used to drop each finished request's gRPC stream, which cancelled it as
    Triton completed it. An RPC cancelled at that moment waited for ever and kept the model
    referenced: about one shutdown in five after a single request waited out the whole exit
    timeout with the model UNLOADING, never finalised it, and orphaned the stub."""
    monkeypatch.setenv("MINDIE_TEST_PORT_BASE", str(int(os.environ.get("MINDIE_TEST_PORT_BASE", "18000")) + 600))
    exit_timeout = 15
    stack = Stack(write_settings(tmp_path, TritonConfig={"exitTimeoutSecs": exit_timeout}))
    try:
        stack.start()

        def call(i: int) -> int:
            if i % 3 == 0:
                return httpx.post(stack.url + "/infer", json={"inputs": f"Question {i}", "parameters": {
                    "max_new_tokens": 4}}, timeout=120).status_code
            body = {"model": MODEL_NAME, "prompt": f"Request {i}", "max_tokens": 4, "stream": i % 2 == 0}
            return httpx.post(stack.url + "/v1/completions", json=body, timeout=120).status_code

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(call, range(24))) == [200] * 24
        time.sleep(1)  # the finished streams end on their own (the adapter reads them to their end)
        caplog.set_level(logging.INFO, logger="launch")
        started = time.monotonic()
        stack.stop()
        took = time.monotonic() - started
    finally:
        stack.stop()
    assert stack.sup.triton.returncode == 0  # 1 after "Exit timeout expired"
    assert not [r for r in caplog.records if "orphaned" in r.getMessage()]
    assert took < exit_timeout
