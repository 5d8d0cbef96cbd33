"""``POST /infer``: request validation (spec §3.1–3.4) and body models.

:func:`parse_infer_request` runs the checks in the order of spec §3.3 and raises
the first failure as a 422 :class:`~adapter.errors.MindIEError`.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from adapter.errors import validation_error
from adapter.protocol import media
from adapter.protocol.common import (
    FLT_MAX,
    FLT_MAX_TEXT,
    INT32_MAX,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    ErrorResponse,
    GenerationPlan,
    Tokenize,
    check_repetition_penalty,
    check_seed,
    check_temperature,
    check_token_count,
    check_top_k,
    check_top_p,
    clamp_top_k,
    is_int,
    json_text,
    opt_bool,
    opt_int,
    opt_number,
    opt_unsigned,
    parse_body,
    tokenize_text,
)

__all__ = [
    "ErrorResponse",
    "GenerationPlan",
    "InferDetails",
    "InferParameters",
    "InferRequest",
    "InferResponse",
    "InferStreamEvent",
    "InferToken",
    "parse_infer_request",
]

DEFAULT_MAX_NEW_TOKENS = 20
DEFAULT_TEMPERATURE = 1.0  # seed B: a fixed 1.0 here (/v1/completions leaves it to the model)
DEFAULT_PRIORITY = 5
MAX_PRIORITY = 5
DEFAULT_TIMEOUT = 600
MAX_TIMEOUT = 3600  # spec §7 D17
L2_MESSAGE = "Inputs token length must be in (0, {max}], but got {n}"


def parse_infer_request(
    raw: bytes,
    settings: Any,
    tokenize: Tokenize,
    vocab_size: int,
    *,
    resolver: media.Resolver | None = None,
) -> GenerationPlan:
    """Validate an ``/infer`` body and resolve it into a :class:`GenerationPlan`.

    ``resolver`` (host -> addresses) replaces DNS for media URLs, e.g. in tests.
    """
    body = parse_body(raw)
    prompt_text, prompt_ids = _check_inputs(body, tokenize, resolver)
    params = body.get("parameters")
    if params is None:
        params = {}
    elif not isinstance(params, dict):
        raise validation_error("parameters must be object type.")
    temperature = check_temperature(params, allow_zero=False)
    top_k = check_top_k(params)
    top_p = check_top_p(params, allow_one=False)
    typical_p = opt_number(params, "typical_p")  # validated, no effect
    if typical_p is not None and not 0.0 < typical_p <= 1.0:
        raise validation_error(f"Parameter typical_p must be in (0.0,1.0], got {json_text(typical_p)}.")
    do_sample = opt_bool(params, "do_sample")
    seed = check_seed(params)
    repetition_penalty = check_repetition_penalty(params, upper=FLT_MAX, upper_text=FLT_MAX_TEXT)
    opt_bool(params, "watermark")  # validated, no effect
    priority = opt_unsigned(params, "priority")
    if priority is not None and not 1 <= priority <= MAX_PRIORITY:
        raise validation_error(f"Parameter priority must be in [1,{MAX_PRIORITY}], got {priority}.")
    max_new_tokens = opt_int(params, "max_new_tokens")
    if max_new_tokens is not None and not 0 < max_new_tokens <= INT32_MAX:
        raise validation_error(
            f"Parameter max_new_tokens must be in (0,{INT32_MAX}], got {json_text(max_new_tokens)}."
        )
    timeout = opt_unsigned(params, "timeout")
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT:
        raise validation_error(
            f"Parameter timeout must be strictly positive and small than {MAX_TIMEOUT} seconds, "
            f"got {json_text(timeout)}."
        )
    details = bool(opt_bool(params, "details"))
    stream = bool(opt_bool(body, "stream"))

    max_iter = settings.schedule.maxIterTimes
    sampling: dict[str, Any] = {"max_tokens": min(max_new_tokens or DEFAULT_MAX_NEW_TOKENS, max_iter)}
    optional = {
        "temperature": DEFAULT_TEMPERATURE if temperature is None else temperature,
        "top_k": None if top_k is None else clamp_top_k(top_k, vocab_size),
        "top_p": top_p,
        "repetition_penalty": repetition_penalty,
        "do_sample": do_sample,
        "seed": seed,
    }
    sampling.update({k: v for k, v in optional.items() if v is not None})
    sampling["priority"] = DEFAULT_PRIORITY if priority is None else priority
    sampling["timeout"] = DEFAULT_TIMEOUT if timeout is None else timeout
    return GenerationPlan(
        endpoint="infer",
        model=None,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        stream=stream,
        sampling=sampling,
        details=details,
        num_choices=1,
        logprobs=None,
    )


def _check_inputs(
    body: dict, tokenize: Tokenize, resolver: media.Resolver | None
) -> tuple[str | None, list[int] | None]:
    """``inputs``/``input_id``: shape, L1, tokenise or handle media, L2 (spec §3.3 step 1)."""
    has_inputs = "inputs" in body
    input_id = body.get("input_id")
    if has_inputs and input_id is not None:
        raise validation_error("Input conflict.")
    if has_inputs:
        return _check_text_inputs(body["inputs"], tokenize, resolver), None
    if input_id is not None:
        return None, _check_input_id(input_id)
    raise validation_error("Not found inputs.")


def _check_text_inputs(inputs: Any, tokenize: Tokenize, resolver: media.Resolver | None) -> str:
    if inputs is None:
        raise validation_error("Inputs must not be null")
    if isinstance(inputs, str):
        _check_length(len(inputs))
        text = inputs
    elif isinstance(inputs, list):
        if not inputs:
            raise validation_error("Inputs arr is empty")
        media.check_structure(inputs)
        _check_length(len(json.dumps(inputs, ensure_ascii=False, separators=(",", ":"))))
        elements = media.validate_elements(inputs, resolver=resolver)
        # the served model reads text only: media get a clear 422 once they pass validation
        text = media.text_for_text_only_model(elements, reject_media=True)
    else:
        raise validation_error("The type of inputs is abnormal")
    check_token_count(len(tokenize_text(tokenize, text)), L2_MESSAGE)
    return text


def _check_length(length: int) -> None:
    """L1 on the string, or on the list's compact JSON text."""
    if not 0 < length <= MAX_PROMPT_CHARS:
        raise validation_error(
            "Inputs must be necessary and data type must be string and length in "
            f"(0, {MAX_PROMPT_CHARS}], but the length of inputs is {length}"
        )


def _check_input_id(input_id: Any) -> list[int]:
    if not isinstance(input_id, list):
        raise validation_error("Parameter input_id must be an array")
    if not input_id:
        raise validation_error("Input_id should not be empty")
    for token in input_id:
        if not is_int(token):
            raise validation_error("Parameter input_id must be integer")
        if not 0 <= token <= MAX_PROMPT_TOKENS:
            raise validation_error("Data element in param input_id is invalid")
    check_token_count(len(input_id), L2_MESSAGE)
    return list(input_id)


# --------------------------------------------------------------------------- body models


def _loose(description: str, schema: dict | None = None) -> Any:
    return Field(None, description=description, json_schema_extra=schema)


class InferParameters(BaseModel):
    """Documents ``parameters``; it never rejects anything (validation is above)."""

    model_config = ConfigDict(extra="allow")

    temperature: Any = _loose("(1e-6, 3.40282e+38], default 1.0.", {"type": "number"})
    top_k: Any = _loose("(0, 2147483647]; >= vocab size means vocab size.", {"type": "integer"})
    top_p: Any = _loose("(1e-6, 1.0) open; 1.0 itself is rejected.", {"type": "number"})
    max_new_tokens: Any = _loose("(0, 2147483647], default 20.", {"type": "integer"})
    do_sample: Any = _loose("false forces greedy decoding.", {"type": "boolean"})
    seed: Any = _loose("(0, 18446744073709551615].", {"type": "integer"})
    repetition_penalty: Any = _loose("> 0.0, default 1.0.", {"type": "number"})
    details: Any = _loose("Return the details object.", {"type": "boolean"})
    typical_p: Any = _loose("(0.0, 1.0]; validated, no effect.", {"type": "number"})
    watermark: Any = _loose("Validated, no effect.", {"type": "boolean"})
    priority: Any = _loose("[1, 5], default 5; 1 is the most urgent.", {"type": "integer"})
    timeout: Any = _loose("(0, 3600] seconds, default 600.", {"type": "integer"})


class InferRequest(BaseModel):
    """Documents the ``/infer`` body; it never rejects anything."""

    model_config = ConfigDict(extra="allow")

    inputs: Any = _loose(
        "Prompt text, or a list of {type, text|image_url|video_url|audio_url} elements.",
        {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    )
    input_id: Any = _loose(
        "Prompt token ids, instead of inputs.", {"type": "array", "items": {"type": "integer"}}
    )
    stream: Any = _loose("Server-sent events.", {"type": "boolean"})
    parameters: Optional[Union[InferParameters, Any]] = Field(None, description="Sampling parameters.")


class InferDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int


class InferResponse(BaseModel):
    generated_text: str
    details: Optional[InferDetails] = None


class InferToken(BaseModel):
    id: list[int]
    text: Optional[str] = None


class InferStreamEvent(BaseModel):
    """One SSE event; ``generated_text``/``details`` only in the final one."""

    prefill_time: Optional[float] = None
    decode_time: Optional[float] = None
    generated_text: Optional[str] = None
    details: Optional[InferDetails] = None
    token: InferToken = Field(default_factory=lambda: InferToken(id=[]))
