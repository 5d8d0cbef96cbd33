"""Settings checks of spec §5: ranges and the checks between keys, with errors that name the key."""

from __future__ import annotations

import json

import pytest
from llm_engine.config import Settings, load_settings
from pydantic import ValidationError

from tests.conftest import ROOT, write_settings

SHIPPED = [ROOT / "conf" / "config.json", ROOT / "docker" / "config.container.json",
           ROOT / "deploy" / "k8s" / "base" / "config.json"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_configs_pass(path):
    load_settings(path)


@pytest.mark.parametrize("overrides", [
    {},  # the e2e stack
    {"BackendConfig.ScheduleConfig": {"kvCacheBlocks": 8, "cacheBlockSize": 16, "enablePrefixCache": False}},
    {"BackendConfig.ScheduleConfig": {"kvCacheMemoryMiB": 128}},
])
def test_test_configs_pass(tmp_path, overrides):
    load_settings(write_settings(tmp_path, **overrides))


def settings(**sections) -> dict:
    data = json.loads((ROOT / "conf" / "config.json").read_text())
    for path, values in sections.items():
        target = data
        for key in path.split("."):
            target = target[key] if not key.isdigit() else target[int(key)]
        target.update(values)
    return data


DEPLOY, SCHED = "BackendConfig.ModelDeployConfig", "BackendConfig.ScheduleConfig"
MODEL = "BackendConfig.ModelDeployConfig.ModelConfig.0"

BAD = [
    ({SCHED: {"maxIterTimes": 3000}}, "ScheduleConfig.maxIterTimes (3000) must be <= ModelDeployConfig.maxSeqLen (2560)"),
    ({DEPLOY: {"maxSeqLen": 100}}, "ScheduleConfig.maxIterTimes (512) must be <= ModelDeployConfig.maxSeqLen (100)"),
    ({SCHED: {"maxPrefillBatchSize": 201}},
     "ScheduleConfig.maxPrefillBatchSize (201) must be <= ScheduleConfig.maxBatchSize (200)"),
    ({SCHED: {"maxBatchSize": 100, "maxN": 128, "maxPrefillBatchSize": 50}},
     "ScheduleConfig.maxN (128) must be <= ScheduleConfig.maxBatchSize (100)"),
    ({SCHED: {"maxPrefillTokens": 1024}},
     "ScheduleConfig.maxPrefillTokens (1024) must be >= ModelDeployConfig.maxInputTokenLen (2048)"),
    ({DEPLOY: {"maxInputTokenLen": 9000}},
     "ScheduleConfig.maxPrefillTokens (8192) must be >= ModelDeployConfig.maxInputTokenLen (9000)"),
    ({MODEL: {"modelName": "my model"}}, "modelName must be 1 to 256 characters of A-Z a-z 0-9 . _ -, got 'my model'"),
    ({MODEL: {"modelName": ""}}, "modelName must be 1 to 256 characters"),
    ({MODEL: {"modelName": "m/../x"}}, "modelName must be 1 to 256 characters"),
    ({MODEL: {"modelName": "x" * 257}}, "modelName must be 1 to 256 characters"),
    ({"ServerConfig": {"port": 1023}}, "ServerConfig.port"),
    ({"ServerConfig": {"port": 65536}}, "ServerConfig.port"),
    ({"ServerConfig": {"ipAddress": "localhost"}}, "ipAddress must be an IPv4 or IPv6 address, got 'localhost'"),
    ({SCHED: {"maxQueueDelayMicroseconds": 499}}, "ScheduleConfig.maxQueueDelayMicroseconds"),
]


@pytest.mark.parametrize("sections, message", BAD)
def test_a_bad_value_is_named(sections, message):
    with pytest.raises(ValidationError) as info:
        Settings.model_validate(settings(**sections))
    assert message in str(info.value)
    key = message.split(" ")[0].split(".")[-1]
    assert key in str(info.value)


@pytest.mark.parametrize("sections", [
    {SCHED: {"maxIterTimes": 2560}},  # the bounds themselves are allowed
    {SCHED: {"maxPrefillBatchSize": 200, "maxN": 200}},
    {SCHED: {"maxPrefillTokens": 2048}},
    {MODEL: {"modelName": "Qwen2.5-7B_instruct.v1"}},
    {MODEL: {"modelName": "x" * 256}},
    {"ServerConfig": {"port": 1024, "ipAddress": "::1"}},
    {"ServerConfig": {"port": 65535, "ipAddress": "0.0.0.0", "allowAllZeroIpListening": True}},
])
def test_edge_values_pass(sections):
    Settings.model_validate(settings(**sections))


def test_the_defaults_pass():
    Settings()


def test_keys_this_server_does_not_use_are_named_at_load(tmp_path, caplog):
    """A MindIE settings file carries keys this server has no use for; a typo looks the same."""
    data = json.loads((ROOT / "conf" / "config.json").read_text())
    data["ServerConfig"]["inferMode"] = "standard"
    data["ServerConfig"]["maxLinkNumm"] = 5  # a typo
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["worldSize"] = 1
    data["LogConfig"] = {"logLevel": "Info"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        load_settings(path)
    line = next(r.getMessage() for r in caplog.records if "not used by this server" in r.getMessage())
    for key in ("ServerConfig.inferMode", "ServerConfig.maxLinkNumm",
                "BackendConfig.ModelDeployConfig.ModelConfig.worldSize", "LogConfig"):
        assert key in line
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_settings(ROOT / "conf" / "config.json")  # the shipped file: every key is used
    assert not [r for r in caplog.records if "not used" in r.getMessage()]


@pytest.mark.parametrize("server", [{"ipAddress": "0.0.0.0"}, {"ipAddress": "::"},
                                    {"managementIpAddress": "0.0.0.0", "managementPort": 1026}])
def test_every_interface_needs_allow_all_zero_ip_listening(server):
    """Spec §5: MindIE refuses 0.0.0.0 unless allowAllZeroIpListening is set."""
    with pytest.raises(ValidationError, match="allowAllZeroIpListening"):
        Settings.model_validate({"ServerConfig": server})
    Settings.model_validate({"ServerConfig": dict(server, allowAllZeroIpListening=True)})
