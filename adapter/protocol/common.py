"""Rules shared by ``/v1/completions`` and ``/infer``: one place for each.

* Body parsing (UTF-8, JSON, nesting depth ≤ 10) – spec §1.1.
* JSON type classes and their messages – spec §0.2; ``null`` means absent – §0.1.
* The sampling checks both endpoints share (``temperature``, ``top_k``, ``top_p``,
  ``seed``, ``repetition_penalty``) with the project's bounds (spec §7 D2, D3, D16).
* Tokenisation and the L2 token-count limit – spec §1.3.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_engine.structured import compile_schema
from pydantic import BaseModel, Field

from adapter.errors import MindIEError, validation_error

JSON_PARSE_ERROR = "Failed to parse request context to json"
MAX_JSON_DEPTH = 10
MAX_PROMPT_CHARS = 4 * 1024 * 1024  # L1 (spec §7 D1)
MAX_PROMPT_TOKENS = 1024 * 1024  # L2
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLT_MAX = 3.4028234663852886e38
FLT_MAX_TEXT = "3.40282e+38"
TOP_P_MIN = 1e-6  # spec §7 D3
JSON_SCHEMA_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
TEMPERATURE_MIN_INFER = 1e-6  # spec §7 D16
SAMPLING_OFF_BELOW = 1e-6  # R6: temperature below this means sampling is disabled

Tokenize = Callable[[str], Sequence[int]]

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class GenerationPlan:
    """Everything the route needs to run one validated request."""

    endpoint: str  # "completions" or "infer"
    model: str | None  # the request's model (completions) or None
    prompt_text: str | None  # text to generate from (None if prompt_ids given)
    prompt_ids: list[int] | None  # token ids (completions integer-array prompt, infer input_id)
    stream: bool
    sampling: dict = field(default_factory=dict)  # llm_engine.params.SamplingParams keys
    details: bool = False  # /infer parameters.details
    num_choices: int = 1  # choices the response must contain (spec §2.4)
    logprobs: int | None = None
    arrival: float | None = None  # time.monotonic() at the request's arrival (e2eTimeout counts from it)


class ErrorResponse(BaseModel):
    """Body of every error answer (spec §1.2)."""

    error: str
    error_type: str


class BodyTooLarge(BaseModel):
    """The 413 body, which is not the error envelope (spec §1.1)."""

    message: str = Field(examples=["Request body too large. Maximum allowed size is 40MB."])


def no_default(schema: dict) -> None:
    """``json_schema_extra`` for a key that may be left out but not sent as null."""
    schema.pop("default", None)


# --------------------------------------------------------------------------- parsing


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError("number overflow")
    return value


def _reject_constant(_text: str) -> Any:
    raise ValueError("NaN and Infinity are not JSON")


def _depth_ok(value: Any) -> bool:
    """Objects and arrays nest at most ``MAX_JSON_DEPTH`` deep (the top level is 1). Checked on
    the parsed value, without recursion: a scan of the text for brackets outside strings took
    time quadratic in an unterminated string's escaped quotes (80 KB: 18 s, holding the GIL)."""
    level = [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > MAX_JSON_DEPTH:
                    return False
                level.append((child, depth + 1))
    return True


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def parse_body(raw: bytes) -> dict:
    """Decode the raw body: strict UTF-8, strict JSON, depth ≤ 10, an object at the top.

    Anything else is 422 ``Failed to parse request context to json``.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray, memoryview)) else str(raw)
        data = json.loads(text, parse_float=_finite_float, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise validation_error(JSON_PARSE_ERROR) from None
    if not isinstance(data, dict) or not _depth_ok(data) or _has_lone_surrogate(data):
        raise validation_error(JSON_PARSE_ERROR)
    return data


def json_text(value: Any) -> str:
    """The value as compact JSON text, as MindIE echoes it in ``got {v}``."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ------------------------------------------------------------------ type classes §0.2


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def opt_bool(obj: dict, key: str) -> bool | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        raise validation_error(f"{key} must be boolean type.")
    return value


def opt_number(obj: dict, key: str) -> float | int | None:
    value = obj.get(key)
    if value is not None and not is_number(value):
        raise validation_error(f"{key} must be float type.")
    return value


def opt_int(obj: dict, key: str) -> int | None:
    value = obj.get(key)
    if value is not None and not is_int(value):
        raise validation_error(f"{key} must be integer type.")
    return value


def opt_unsigned(obj: dict, key: str) -> int | None:
    value = obj.get(key)
    if value is not None and not (is_int(value) and value >= 0):
        raise validation_error(f"{key} must be unsigned type.")
    return value


def opt_object(obj: dict, key: str) -> dict | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, dict):
        raise validation_error(f"{key} must be object type.")
    return value


# ------------------------------------------------------------------ shared sampling rules


def check_temperature(obj: dict, *, allow_zero: bool) -> float | None:
    """``/v1/completions``: [0, FLT_MAX]; ``/infer``: (1e-6, FLT_MAX] (D16)."""
    value = opt_number(obj, "temperature")
    if value is None:
        return None
    if allow_zero:
        ok, low = 0.0 <= value <= FLT_MAX, "0.0"
    else:
        ok, low = TEMPERATURE_MIN_INFER < value <= FLT_MAX, "1e-6"
    if not ok:
        raise validation_error(
            f"Parameter temperature must be in ({low},{FLT_MAX_TEXT}], got {json_text(value)}."
        )
    return float(value)


def check_top_k(obj: dict) -> int | None:
    """(0, 2147483647] on both endpoints (D4); the source's message text is kept."""
    value = opt_int(obj, "top_k")
    if value is not None and not 0 < value <= INT32_MAX:
        raise validation_error(f"Parameter top_k must be in -1 || (0,{INT32_MAX}], got {json_text(value)}")
    return value


def clamp_top_k(top_k: int, vocab_size: int) -> int:
    """A ``top_k`` ≥ vocabSize becomes vocabSize (spec §2.2; D5: no other clamp)."""
    return vocab_size if top_k >= vocab_size else top_k


def check_top_p(obj: dict, *, allow_one: bool) -> float | None:
    """(1e-6, 1.0] on ``/v1/completions``; (1e-6, 1.0) on ``/infer`` (D3)."""
    value = opt_number(obj, "top_p")
    if value is None:
        return None
    ok = TOP_P_MIN < value and (value <= 1.0 if allow_one else value < 1.0)
    if not ok:
        raise validation_error(f"Parameter top_p must be in (1e-6,1.0], got {json_text(value)}.")
    return float(value)


def check_seed(obj: dict) -> int | None:
    """(0, 18446744073709551615] (D2)."""
    value = opt_unsigned(obj, "seed")
    if value is not None and not 0 < value <= UINT64_MAX:
        raise validation_error(f"Parameter seed must be in (0, {UINT64_MAX}], got {json_text(value)}.")
    return value


def check_repetition_penalty(obj: dict, *, upper: float, upper_text: str) -> float | None:
    """(0.0, upper]: 2 on ``/v1/completions``, FLT_MAX on ``/infer``."""
    value = opt_number(obj, "repetition_penalty")
    if value is not None and not 0.0 < value <= upper:
        raise validation_error(
            f"Parameter 'repetition_penalty' must be in (0.0, {upper_text}], got {json_text(value)}."
        )
    return None if value is None else float(value)


# ------------------------------------------------------------------ tokens


def tokenize_text(tokenize: Tokenize, text: str) -> list[int]:
    """Run the tokenizer; its failure is a 422 carrying the tokenizer's text (§1.2)."""
    try:
        return list(tokenize(text))
    except MindIEError:
        raise
    except Exception as exc:  # the tokenizer's own error text is the message
        raise validation_error(str(exc) or type(exc).__name__) from None


def check_token_count(count: int, template: str) -> None:
    """L2: 0 < tokens ≤ 1048576; ``template`` has ``{max}`` and ``{n}``."""
    if not 0 < count <= MAX_PROMPT_TOKENS:
        raise validation_error(template.format(max=MAX_PROMPT_TOKENS, n=count))


# ------------------------------------------------------------------ structured output


def check_response_format(body: dict) -> str | None:
    """``response_format`` (spec §2.1, source rules); returns the structured type or None.

    ``{"type": "text"}`` is the same as absent. A schema must also compile into the
    engine's grammar (:func:`llm_engine.structured.compile_schema`), so a 422 comes here and
    not from the engine.
    """
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise validation_error("Parameter response_format must be an object")
    kind = fmt.get("type")
    if kind is None:
        raise validation_error("Parameter response_format must contain 'type' field")
    if not isinstance(kind, str):
        raise validation_error("Parameter response_format.type must be a string")
    if kind not in ("json_object", "json_schema", "text"):
        raise validation_error(
            f"Parameter response_format.type must be 'json_object', 'json_schema' or 'text', got '{kind}'"
        )
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None:
            raise validation_error(
                "Parameter response_format.json_schema is required when type is 'json_schema'"
            )
        if not isinstance(spec, dict):
            raise validation_error("Parameter response_format.json_schema must be an object")
        name = spec.get("name")
        if name is None:
            raise validation_error("Parameter response_format.json_schema.name is required")
        if not isinstance(name, str):
            raise validation_error("Parameter response_format.json_schema.name must be a string")
        if not 1 <= len(name) <= 64:
            raise validation_error("Parameter response_format.json_schema.name must be 1-64 characters")
        schema = spec.get("schema")
        if schema is None:
            raise validation_error(
                "Parameter response_format.json_schema.schema is required when type is 'json_schema'"
            )
        if not isinstance(schema, dict):
            raise validation_error("Parameter response_format.json_schema.schema must be an object")
        _check_schema_types(schema, "schema")
        problem = compile_schema(schema)[1]
        if problem:
            raise validation_error(f"Invalid json_schema: {problem}")
    return kind


def _check_schema_types(schema: dict, path: str) -> None:
    if "type" in schema:
        kind = schema["type"]
        if not isinstance(kind, str):
            raise validation_error(f"Invalid json_schema: 'type' at '{path}' must be a string")
        if kind not in JSON_SCHEMA_TYPES:
            raise validation_error(f"Invalid json_schema: unsupported type '{kind}' at '{path}'")
    if "properties" in schema:
        props = schema["properties"]
        if not isinstance(props, dict):
            raise validation_error(f"Invalid json_schema: 'properties' at '{path}' must be an object")
        for key, sub in props.items():
            if not isinstance(sub, dict):
                raise validation_error(f"Invalid json_schema: property '{key}' at '{path}' must be an object")
            _check_schema_types(sub, f"{path}.properties.{key}")
    if "items" in schema:
        if not isinstance(schema["items"], dict):
            raise validation_error(f"Invalid json_schema: 'items' at '{path}' must be an object")
        _check_schema_types(schema["items"], f"{path}.items")
    if "required" in schema:
        if not isinstance(schema["required"], list):
            raise validation_error(f"Invalid json_schema: 'required' at '{path}' must be an array")
        if not all(isinstance(item, str) for item in schema["required"]):
            raise validation_error(f"Invalid json_schema: elements of 'required' at '{path}' must be strings")
