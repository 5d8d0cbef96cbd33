"""llm_unary's handling of Triton's request timeout, with a stand-in for pb_utils: the
deadline runs from the request's arrival, so time spent waiting for a worker counts."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types

import numpy as np
import pytest

from tests.conftest import ROOT


@pytest.fixture
def unary(monkeypatch):
    fake = types.ModuleType("triton_python_backend_utils")
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name, array):
            self._name, self.array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self.array

    class TritonError:
        INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = "INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED"

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.output_tensors, self.error = list(output_tensors), error

    def no_bls(**kwargs):
        raise AssertionError("no BLS call may start once the deadline has passed")

    fake.Tensor, fake.TritonError, fake.InferenceResponse, fake.InferenceRequest = (
        Tensor, TritonError, InferenceResponse, no_bls)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    spec = importlib.util.spec_from_file_location("llm_unary_under_test",
                                                  ROOT / "model_repository/llm_unary/1/model.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module, fake


def job(module, fake, params: dict, timeout_s: float):
    raw = json.dumps(params).encode()
    keep, planned = module._plan(raw, int(timeout_s * 1e6))
    inputs = [fake.Tensor("text_input", np.array([[b"Hi"]], dtype=np.object_)),
              fake.Tensor("sampling_parameters", np.array([[raw]], dtype=np.object_))]
    return module._Job(request_id="r", inputs=inputs, wanted=set(), keep=keep, params=planned,
                       deadline=time.monotonic() + timeout_s)


def sent_params(inputs) -> dict:
    (tensor,) = [t for t in inputs if t.name() == "sampling_parameters"]
    return json.loads(tensor.as_numpy().reshape(-1)[0])


def test_the_engine_gets_what_is_left_of_the_timeout_when_the_call_starts(unary):
    module, fake = unary
    j = job(module, fake, {"max_tokens": 5}, timeout_s=2.0)
    time.sleep(0.3)  # waiting for a worker
    params = sent_params(j.call_inputs())
    assert params["max_tokens"] == 5 and 1.0 < params["timeout"] <= 1.7


def test_a_request_whose_timeout_ran_out_in_the_queue_ends_without_reaching_the_engine(unary):
    module, fake = unary
    j = job(module, fake, {}, timeout_s=0.05)
    time.sleep(0.1)
    assert j.call_inputs() is None
    model = module.TritonPythonModel.__new__(module.TritonPythonModel)
    model._llm_ready = True
    sender = types.SimpleNamespace(is_cancelled=lambda: False)
    response = model._generate(j, sender)
    assert response.error.message == "[504] Engine callback timeout: client timeout"
    assert response.error.code == fake.TritonError.UNAVAILABLE


def test_a_timeout_in_the_parameters_or_none_at_all_is_forwarded_as_it_came(unary):
    module, fake = unary
    assert module._plan(json.dumps({"timeout": 3}).encode(), 500_000) == (None, None)
    assert module._plan(json.dumps({"max_tokens": 3}).encode(), 0) == (None, None)
    j = job(module, fake, {"timeout": 3}, timeout_s=0.0)
    assert j.call_inputs() is j.inputs


def test_unparsable_parameters_are_left_to_llm(unary):
    module, _ = unary
    assert module._plan(b"{not json", 500_000) == (None, None)
    assert module._plan(b"[" * 100_000, 500_000) == (None, None)  # RecursionError, not a crash
    assert module._plan(json.dumps({"n": 2, "best_of": 4}).encode(), 0) == (2, None)
