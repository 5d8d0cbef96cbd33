"""The engine's Triton metrics: what counts as received, failed and finished."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
from llm_engine.sequence import StepOutput

from tests.conftest import ROOT


class _Metric:
    def __init__(self, family):
        self.family = family

    def increment(self, value):
        self.family.total += value

    def set(self, value):
        self.family.total = value

    def observe(self, value):
        self.family.observations.append(value)


class _Family:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    made: dict = {}

    def __init__(self, name, description, kind):
        self.name, self.total, self.observations = name, 0.0, []
        _Family.made[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802
        return _Metric(self)


@pytest.fixture
def metrics(monkeypatch):
    fake = types.ModuleType("triton_python_backend_utils")
    fake.MetricFamily = _Family
    _Family.made = {}
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    spec = importlib.util.spec_from_file_location("triton_metrics_under_test",
                                                  ROOT / "model_repository/llm/1/triton_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EngineMetrics("llm", "m"), _Family.made


def _final(reason="length") -> StepOutput:
    return StepOutput(index=0, text="x", token_ids=[5], finish_reason=reason, prompt_tokens=2, cached_tokens=0,
                      completion_tokens=1, cumulative_logprob=0.0, seed=1, batch_size=[1], queue_wait_us=[3],
                      logprobs=None, final=True)


def test_failed_requests_are_a_subset_of_received_ones(metrics):
    m, families = metrics
    m.on_request(2, request_key=1)
    m.forget(1)  # accepted, then an error: failed
    m.forget(2)  # refused before the engine took it (a prompt over the limit): not received, not failed
    m.on_request(2, request_key=3)
    m.on_output(_final(), 0.0, 3)
    m.forget(3)  # its final went out, then the send failed: it finished, it did not fail
    m.flush()
    total = {name: f.total for name, f in families.items()}
    assert total["llm_request_received_total"] == 2
    assert total["llm_request_failed_total"] == 1
    assert total["llm_request_success_total"] == 1
    assert len(families["llm_e2e_request_latency_seconds"].observations) == 1
    assert not m._received
