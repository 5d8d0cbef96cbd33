"""The two config.pbtxt files against the documented tensor contract (llm_engine.contract), and
the llm config the launcher loads (config.pbtxt plus ScheduleConfig.maxQueueDelayMicroseconds)."""

from __future__ import annotations

import re

import pytest
from llm_engine import contract

from tests.conftest import ROOT

TRITON_TYPE = {"BYTES": "TYPE_STRING", "INT64": "TYPE_INT64", "BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32",
               "FP32": "TYPE_FP32", "UINT64": "TYPE_UINT64"}


def _tensors(model: str, section: str) -> dict[str, str]:
    text = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
    block = re.search(rf"^{section} \[(.*?)^\]", text, re.S | re.M).group(1)
    return {m.group(1): m.group(0) for m in re.finditer(r'\{\s*name:\s*"(\w+)".*?\}', block, re.S)}


def _field(entry: str, name: str) -> str:
    return re.search(rf"{name}:\s*([^,}}]+?)\s*[,}}]", entry).group(1).strip()


@pytest.mark.parametrize("section, tensors", [("input", contract.INPUTS), ("output", contract.OUTPUTS)])
def test_llm_config_matches_the_contract(section, tensors):
    entries = _tensors("llm", section)
    assert list(entries) == [t.name for t in tensors]
    for t in tensors:
        entry = entries[t.name]
        assert _field(entry, "data_type") == TRITON_TYPE[t.dtype], t.name
        dims = [int(d) for d in re.search(r"dims:\s*\[([^\]]*)\]", entry).group(1).split(",")]
        assert tuple(dims) == t.shape, t.name
        assert ("optional: true" in entry) == t.optional, t.name


@pytest.mark.parametrize("model", ["llm", "llm_unary"])
def test_variable_length_inputs_batch_raggedly(model):
    """Without allow_ragged_batch, Triton's dynamic batcher hands out one prompt length per
    cycle, and a burst of new requests reached the engine in 0.5 s steps."""
    for name, entry in _tensors(model, "input").items():
        if "-1" in re.search(r"dims:\s*\[([^\]]*)\]", entry).group(1):
            assert "allow_ragged_batch: true" in entry, f"{model}.{name}"


def test_the_loaded_llm_config_is_config_pbtxt_with_the_settings_delay():
    from google.protobuf import json_format, text_format
    from llm_engine.config import Settings
    from tritonclient.grpc import model_config_pb2

    from adapter.tritonserver import llm_config

    settings = Settings()
    settings.schedule.maxQueueDelayMicroseconds = 1234
    loaded = llm_config(ROOT / "model_repository" / "llm", settings)
    assert loaded["dynamic_batching"]["max_queue_delay_microseconds"] == "1234"  # int64: a JSON string
    pbtxt = text_format.Parse((ROOT / "model_repository" / "llm" / "config.pbtxt").read_text(),
                              model_config_pb2.ModelConfig())
    assert pbtxt.dynamic_batching.max_queue_delay_microseconds == 500
    pbtxt.dynamic_batching.max_queue_delay_microseconds = 1234
    assert loaded == json_format.MessageToDict(pbtxt, preserving_proto_field_name=True)  # nothing else changes


def test_triton_loads_llm_itself_and_every_other_model_at_start(tmp_path):
    from llm_engine.config import Settings

    from adapter.tritonserver import TritonPaths, triton_command

    cmd = triton_command(TritonPaths(tmp_path / "tritonserver", tmp_path, []), Settings(),
                         ROOT / "model_repository", admin_key="k")
    assert "--model-control-mode=explicit" in cmd
    assert [c for c in cmd if c.startswith("--load-model")] == ["--load-model=llm_unary"]
    assert "--http-restricted-api=model-repository,shared-memory,logging,trace,statistics:mindie-admin-key=k" in cmd
