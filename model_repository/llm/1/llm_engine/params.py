"""``sampling_parameters``: the per-request generation controls and their validation.

This is the engine's contract for any Triton client. The HTTP adapter applies
MindIE's own rules and messages first; these checks guard direct callers and
name the offending field in every error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import InvalidParameter
from .structured import STRUCTURED_TYPES, grammar_for

UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1


@dataclass
class SamplingParams:
    max_tokens: Optional[int] = None  # None: maxIterTimes
    temperature: Optional[float] = None  # 0 = greedy; None: the model's default (generation_config, else 1.0)
    top_k: Optional[int] = None  # None: the model's default (generation_config, config.json, else 1000)
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    do_sample: Optional[bool] = None  # False forces greedy
    seed: Optional[int] = None  # None: drawn by the engine and reported
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: Optional[int] = None  # top alternatives per token, 0..5
    n: int = 1
    best_of: Optional[int] = None  # sequences generated; >= n
    use_beam_search: bool = False
    priority: int = 5  # 1 = most urgent
    timeout: Optional[float] = None  # seconds from arrival
    response_format: Optional[dict] = None  # {"type": "text" | "json_object" | "json_schema", ...}

    @property
    def greedy(self) -> bool:
        """Whether sampling is off. An unset temperature counts as sampling here: the engine
        fills the model's default in (:func:`llm_engine.admission.fill_defaults`) and checks again."""
        return (self.temperature is not None and self.temperature < 1e-6) or self.do_sample is False

    @property
    def structured(self) -> bool:
        """Whether ``response_format`` constrains the output (json_object or json_schema)."""
        return (self.response_format or {}).get("type") in STRUCTURED_TYPES

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs: beams, or best_of, else n."""
        if self.use_beam_search:
            return self.n
        return max(self.n, self.best_of or 0)


_BOOL = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "use_beam_search")
_FLOAT_RANGES = {
    # name: (low, low_inclusive, high, high_inclusive)
    "temperature": (0.0, True, math.inf, False),
    "top_p": (1e-6, False, 1.0, True),
    "repetition_penalty": (0.0, False, math.inf, False),
    "presence_penalty": (-2.0, True, 2.0, True),
    "frequency_penalty": (-2.0, True, 2.0, True),
    "timeout": (0.0, False, 65535.0, True),
}
_INT_RANGES = {
    "max_tokens": (1, INT32_MAX),
    "top_k": (0, INT32_MAX),  # 0 = disabled (whole vocabulary)
    "seed": (0, UINT64_MAX),
    "logprobs": (0, 5),
    "n": (1, 8192),
    "best_of": (1, 8192),
    "priority": (1, 5),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_sampling_parameters(raw: str | bytes | dict | None, max_n: int = 128) -> SamplingParams:
    """Parse and validate the JSON ``sampling_parameters`` input.

    Unknown keys are rejected so that typos do not silently change behaviour.
    """
    if raw is None or raw == b"" or raw == "":
        data: dict = {}
    elif isinstance(raw, dict):
        data = raw
    else:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidParameter(f"sampling_parameters is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidParameter("sampling_parameters is nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidParameter("sampling_parameters must be a JSON object")
    known = SamplingParams.__dataclass_fields__
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise InvalidParameter(f"sampling_parameters has unknown field(s): {', '.join(unknown)}")
    values = {k: v for k, v in data.items() if v is not None}
    for name, value in values.items():
        _check(name, value)
    params = SamplingParams(**values)
    if params.stop and isinstance(params.stop, str):
        params.stop = [params.stop]
    if params.best_of is not None and params.best_of < params.n and not params.use_beam_search:
        raise InvalidParameter(f"best_of must be >= n, got best_of={params.best_of} and n={params.n}")
    if params.num_sequences > max_n:
        raise InvalidParameter(f"n/best_of must be <= {max_n} (maxN), got {params.num_sequences}")
    if params.num_sequences > 1 and params.greedy and not params.use_beam_search:
        raise InvalidParameter("n/best_of > 1 needs temperature > 0")
    if params.use_beam_search and params.stop:
        raise InvalidParameter("use_beam_search cannot be used together with stop")
    return params


def _check(name: str, value: Any) -> None:
    if name in _BOOL or name == "do_sample":
        if not isinstance(value, bool):
            raise InvalidParameter(f"{name} must be a boolean, got {value!r}")
    elif name in _FLOAT_RANGES:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InvalidParameter(f"{name} must be a number, got {value!r}")
        try:
            float(value)
        except OverflowError:  # an integer beyond any float
            raise InvalidParameter(f"{name} must be a finite number, got an integer of {len(str(value))} digits") from None
        lo, lo_inc, hi, hi_inc = _FLOAT_RANGES[name]
        ok = (value >= lo if lo_inc else value > lo) and (value <= hi if hi_inc else value < hi)
        if not ok or math.isnan(value):
            lb, hb = "[" if lo_inc else "(", "]" if hi_inc else ")"
            raise InvalidParameter(f"{name} must be in {lb}{lo}, {hi}{hb}, got {value!r}")
    elif name in _INT_RANGES:
        if not _is_int(value):
            raise InvalidParameter(f"{name} must be an integer, got {value!r}")
        lo, hi = _INT_RANGES[name]
        if not lo <= value <= hi:
            raise InvalidParameter(f"{name} must be in [{lo}, {hi}], got {value!r}")
    elif name == "stop":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise InvalidParameter("stop must be a non-empty string or a list of non-empty strings")
        if sum(len(s) for s in items) > 32768:
            raise InvalidParameter("stop must total at most 32768 characters")
    elif name == "response_format":
        grammar_for(value)  # raises InvalidParameter for a malformed format or schema
    elif name == "stop_token_ids":
        if not isinstance(value, list) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in value):
            raise InvalidParameter("stop_token_ids must be a list of int32 token ids")
