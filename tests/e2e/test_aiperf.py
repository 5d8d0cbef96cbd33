"""NVIDIA's aiperf, unmodified, profiles streaming /v1/completions through the whole stack.

aiperf needs numpy 2 and pulls uvloop, so it lives in its own venv (``.venv-aiperf``,
created on first use; ``MINDIE_AIPERF_VENV`` overrides the path), as bench/README.md says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MODEL_NAME, ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
AIPERF_VERSION = "0.13.0"
VENV = Path(os.environ.get("MINDIE_AIPERF_VENV", ROOT / ".venv-aiperf"))


@pytest.fixture(scope="module")
def aiperf() -> Path:
    binary = VENV / "bin" / "aiperf"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"],
                       check=True, timeout=1200)
    return binary


def test_aiperf_profiles_streaming_completions(stack, aiperf, tmp_path):
    from llm_engine.weights import resolve_model_dir

    out = tmp_path / "aiperf"
    cmd = [str(aiperf), "profile", "--model", MODEL_NAME, "--url", stack.url, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", str(resolve_model_dir("")), "--concurrency", "2", "--request-count", "6",
           "--prompt-input-tokens-mean", "24", "--prompt-output-tokens-mean", "12",
           "--extra-inputs", "ignore_eos:true", "--output-artifact-dir", str(out), "--ui-type", "none"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == 6
    assert not result.get("error_summary"), result["error_summary"]
    assert 0 < result["time_to_first_token"]["p50"] < result["request_latency"]["p50"]
    assert result["inter_token_latency"]["p50"] > 0
    assert 10 <= result["output_sequence_length"]["avg"] <= 13  # aiperf re-tokenizes the text it got
