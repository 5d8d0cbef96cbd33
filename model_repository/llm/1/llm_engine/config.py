"""The one settings file, in MindIE Server's vocabulary.

Both the adapter and the Triton model read the same JSON file (``conf/config.json``
by default, or the path in ``$MINDIE_TRITON_CONFIG``). Its layout follows MindIE's
``config.json``: ``ServerConfig`` for the HTTP plane, ``BackendConfig`` with
``ModelDeployConfig`` (model, lengths) and ``ScheduleConfig`` (batching), plus a
``TritonConfig`` section for this project's Triton wiring.
Unknown keys are ignored so that a MindIE config file can be reused as it is.
Ranges, and the checks between keys, are MindIE's (spec §5); an error names the key.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

log = logging.getLogger(__name__)

CONFIG_ENV = "MINDIE_TRITON_CONFIG"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_NAME = re.compile(r"[A-Za-z0-9._-]{1,256}")  # spec §5


class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ServerSection(_Section):
    """HTTP plane of the adapter (MindIE ``ServerConfig``)."""

    ipAddress: str = "127.0.0.1"
    port: int = Field(1025, ge=1024, le=65535)
    allowAllZeroIpListening: bool = Field(False, description="allow ipAddress 0.0.0.0 / :: (every interface)")
    # MindIE's management plane (health, status) and metrics listener. Unset, they are the
    # business listener (MindIE's defaults are 127.0.0.2, 1026 and 1027): one port serves all.
    managementIpAddress: Optional[str] = None
    managementPort: Optional[int] = Field(None, ge=1024, le=65535)
    metricsPort: Optional[int] = Field(None, ge=1024, le=65535)
    httpsEnabled: bool = False
    tlsCert: str = ""
    tlsPk: str = ""
    tlsCaFile: str = ""
    fullTextEnabled: bool = False
    maxLinkNum: int = Field(1000, ge=1, le=4096)
    tokenTimeout: int = Field(600, ge=1, le=3600)
    e2eTimeout: int = Field(600, ge=1, le=65535)
    maxRequestLength: int = Field(40, ge=1, le=100, description="MiB")
    apiKey: Optional[str] = None
    maxStopCount: int = Field(
        0, ge=0, description="most stop strings in one request; 0: no limit (the API sets none, only the total length)")
    drainTimeout: float = Field(30.0, ge=0, description="seconds in-flight streams get on SIGTERM")
    streamWriteTimeout: float = Field(
        30.0, gt=0, description="seconds one SSE write may wait on a client that stopped reading")

    @field_validator("ipAddress", "managementIpAddress")
    @classmethod
    def _ip(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{info.field_name} must be an IPv4 or IPv6 address, got {value!r}") from None
        return value

    @model_validator(mode="after")
    def _all_zero(self):
        """MindIE listens on every interface only when asked to twice (spec §5)."""
        for name in ("ipAddress", "managementIpAddress"):
            value = getattr(self, name)
            if value is not None and ipaddress.ip_address(value).is_unspecified and not self.allowAllZeroIpListening:
                raise ValueError(f"{name} {value} listens on every interface; set ServerConfig."
                                 "allowAllZeroIpListening to true to allow it")
        return self


class ModelSection(_Section):
    modelName: str = DEFAULT_MODEL_NAME
    modelWeightPath: str = Field(
        "", description="HF checkpoint directory or .gguf file; empty = embedded default"
    )
    backendType: Literal["atb", "ms", "torch"] = "atb"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "npu", "cuda", "cpu"] = "auto"
    cpuThreads: int = Field(
        0, ge=0, description="torch threads on CPU; 0 = $OMP_NUM_THREADS if set, else every core "
                     "with the fused CPU kernels and cores - 1 on the torch path (cores capped by "
                     "the cgroup's CPU limit)")
    cpuAffinity: Literal["auto", "off"] = Field(
        "auto", description="auto (default): on CPU with one model instance and fewer engine threads "
                            "than cores, pin the engine's threads "
                            "to the last cpuThreads cores and tritonserver, the adapter and the stub's "
                            "other threads to the others (see llm_engine/cpu_cores.py); off: let the OS "
                            "place every thread")
    cpuKernels: Literal["auto", "off"] = Field(
        "auto", description="auto (default): on CPU, run each layer's norms, rotary embedding, KV-cache "
                            "write, attention and SiLU product in fused C kernels built with the system "
                            "C compiler at first load (llm_engine/cpu_ops.py), where the model is a "
                            "standard Llama-family one; the torch path is used where they can't be built; "
                            "off: always the torch path")
    cpuLinearWeights: Literal["auto", "dense", "gguf"] = Field(
        "auto", description="gguf: where the model is a GGUF whose layer Linears are Q4_1 (the embedded default "
                            "is), they read those 4-bit blocks with the fused kernels: in bfloat16 on a CPU with "
                            "AVX512-BF16 (csrc/linear_q4.c), or in float32 on one with AVX2, FMA and F16C for "
                            "single rows (one stream) where that measured faster at load, batches keeping the dense "
                            "weights (csrc/linear_q4_avx2.c; a Q8_0 lm_head likewise, csrc/linear_q8_avx2.c); else "
                            "dense with a warning; dense: the weights "
                            "dequantised at load; auto (default): gguf where it applies, except on CPUs with AMX "
                            "in bfloat16 (not measured there), else dense")

    @field_validator("modelName")
    @classmethod
    def _model_name(cls, value: str) -> str:
        if not MODEL_NAME.fullmatch(value):
            raise ValueError(f"modelName must be 1 to 256 characters of A-Z a-z 0-9 . _ -, got {value!r}")
        return value


class ModelDeploySection(_Section):
    maxSeqLen: int = Field(2560, gt=0)
    maxInputTokenLen: int = Field(2048, ge=1, le=4194304)
    truncation: int = Field(0, ge=-1, le=1)
    ModelConfig: list[ModelSection] = Field(default_factory=lambda: [ModelSection()])

    @model_validator(mode="before")
    @classmethod
    def _truncation_bool(cls, data):
        if isinstance(data, dict) and isinstance(data.get("truncation"), bool):
            data = dict(data, truncation=-1 if data["truncation"] else 0)
        return data


class ScheduleSection(_Section):
    maxBatchSize: int = Field(200, ge=1, le=819200)
    maxPrefillBatchSize: int = Field(50, ge=1)
    maxPrefillTokens: int = Field(8192, ge=1)
    prefillChunkTokens: int = Field(
        0, ge=0, description="prompt tokens one engine step may carry while other sequences decode, so that "
                             "a long prompt is prefilled in chunks between their tokens (0 = auto: 256 on CPU, "
                             "where 2000 prompt tokens in one step held 8 decoding streams for 2.3 s; no limit "
                             "but maxPrefillTokens on accelerators)")
    maxIterTimes: int = Field(512, ge=1)
    maxQueueDelayMicroseconds: int = Field(
        500, ge=500, le=1000000,
        description="Triton's dynamic-batching delay for the llm model, applied by the launcher at load "
                    "(MindIE's default is 5000; the engine batches per step itself, so waiting longer only "
                    "delays first tokens)")
    maxN: int = Field(128, ge=1, le=8192)
    cacheBlockSize: int = Field(16, ge=1, le=128)
    kvCacheBlocks: int = Field(0, ge=0, description="0 = size from kvCacheMemoryMiB")
    kvCacheMemoryMiB: int = Field(1024, ge=1)
    maxWaitingRequests: int = Field(2000, ge=1, description="engine queue bound")
    enablePrefixCache: bool = True
    stepTimeout: float = Field(
        600, ge=0, description="seconds one engine step may run before the engine counts as hung: the llm "
                               "stub then exits and is restarted (0 = never)")
    maxFailedSteps: int = Field(
        20, ge=0, description="engine steps failing in a row, none succeeding, before the engine counts as "
                              "broken (a lost device, say): the llm stub then exits and is restarted (0 = never)")

    @model_validator(mode="after")
    def _within_batch(self):
        for key in ("maxPrefillBatchSize", "maxN"):
            if getattr(self, key) > self.maxBatchSize:
                raise ValueError(f"ScheduleConfig.{key} ({getattr(self, key)}) must be <= "
                                 f"ScheduleConfig.maxBatchSize ({self.maxBatchSize})")
        return self


class BackendSection(_Section):
    npuDeviceIds: list[list[int]] = Field(default_factory=lambda: [[0]])
    ModelDeployConfig: ModelDeploySection = Field(default_factory=ModelDeploySection)
    ScheduleConfig: ScheduleSection = Field(default_factory=ScheduleSection)

    @model_validator(mode="after")
    def _lengths(self):
        deploy, sched = self.ModelDeployConfig, self.ScheduleConfig
        if sched.maxIterTimes > deploy.maxSeqLen:
            raise ValueError(f"ScheduleConfig.maxIterTimes ({sched.maxIterTimes}) must be <= "
                             f"ModelDeployConfig.maxSeqLen ({deploy.maxSeqLen})")
        if sched.maxPrefillTokens < deploy.maxInputTokenLen:
            raise ValueError(f"ScheduleConfig.maxPrefillTokens ({sched.maxPrefillTokens}) must be >= "
                             f"ModelDeployConfig.maxInputTokenLen ({deploy.maxInputTokenLen})")
        return self


class TritonSection(_Section):
    """How this project runs tritonserver (not a MindIE section)."""

    modelName: str = "llm"
    httpAddress: str = "127.0.0.1"
    httpPort: int = 8000
    grpcAddress: str = "127.0.0.1"
    grpcPort: int = 8001
    metricsPort: int = 8002
    exitTimeoutSecs: int = 5

    # Where clients reach Triton (an IPv6 address in brackets).
    @property
    def http_url(self) -> str:
        return f"http://{url_host(self.httpAddress)}:{self.httpPort}"

    @property
    def metrics_url(self) -> str:
        return f"http://{url_host(self.httpAddress)}:{self.metricsPort}/metrics"

    @property
    def grpc_target(self) -> str:
        return f"{url_host(self.grpcAddress)}:{self.grpcPort}"


def url_host(address: str) -> str:
    """``address`` as the host part of a URL or gRPC target: IPv6 in brackets."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


class Settings(_Section):
    ServerConfig: ServerSection = Field(default_factory=ServerSection)
    BackendConfig: BackendSection = Field(default_factory=BackendSection)
    TritonConfig: TritonSection = Field(default_factory=TritonSection)

    # Shortcuts for the values everything reads.
    @property
    def server(self) -> ServerSection:
        return self.ServerConfig

    @property
    def model(self) -> ModelSection:
        return self.BackendConfig.ModelDeployConfig.ModelConfig[0]

    @property
    def deploy(self) -> ModelDeploySection:
        return self.BackendConfig.ModelDeployConfig

    @property
    def schedule(self) -> ScheduleSection:
        return self.BackendConfig.ScheduleConfig

    @property
    def triton(self) -> TritonSection:
        return self.TritonConfig


def default_config_path() -> Path:
    """``conf/config.json`` at the repository root (three levels above this package)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "conf" / "config.json"
        if candidate.is_file():
            return candidate
    return here.parents[4] / "conf" / "config.json"


def load_settings(path: str | os.PathLike | None = None) -> Settings:
    """Load the settings file: ``path``, else ``$MINDIE_TRITON_CONFIG``, else the default.

    A missing file gives the documented defaults.
    """
    chosen = path or os.environ.get(CONFIG_ENV) or default_config_path()
    p = Path(chosen)
    if not p.is_file():
        if path or os.environ.get(CONFIG_ENV):
            raise FileNotFoundError(f"settings file not found: {p}")
        return Settings()
    with p.open(encoding="utf-8") as fh:
        data = json.load(fh)
    settings = Settings.model_validate(data)
    unused = unused_keys(data, Settings)
    if unused:  # a MindIE settings file carries many keys this server has no use for; a typo looks the same
        log.warning("settings not used by this server (ignored): %s", ", ".join(unused))
    return settings


def unused_keys(data, model: type[BaseModel], where: str = "") -> list[str]:
    """The keys of ``data`` that ``model`` ignores (``extra="ignore"``), as dotted paths."""
    found = []
    if not isinstance(data, dict):
        return found
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            found.append(f"{where}{key}")
            continue
        ann = field.annotation
        sub = ann.__args__[0] if getattr(ann, "__origin__", None) is list else ann
        if getattr(sub, "__origin__", None) is None and isinstance(sub, type) and issubclass(sub, BaseModel):
            for item in value if isinstance(value, list) else [value]:
                found += unused_keys(item, sub, f"{where}{key}.")
    return found
