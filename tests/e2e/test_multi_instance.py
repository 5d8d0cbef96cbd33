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

from tests.conftest import MODEL_NAME, ROOT, Stack, write_settings

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
        per_instance = {}
        for line in httpx.get(stack.metrics_url).text.splitlines():
            if line.startswith("llm_generation_tokens_total{"):
                instance = re.search(r'instance="([^"]+)"', line).group(1)
                per_instance[instance] = float(line.rsplit(" ", 1)[1])
        assert len(per_instance) == 2, per_instance
        assert all(v > 0 for v in per_instance.values()), per_instance
    finally:
        stack.stop()
        shutil.rmtree(tmp_path / "model_repository", ignore_errors=True)
