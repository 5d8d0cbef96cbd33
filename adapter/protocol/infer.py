"""``POST /infer``: request validation (spec §3.1–3.4) and body models.

:func:`parse_infer_request` runs the checks in the order of spec §3.3 and raises
the first failure as a 422 :class:`~adapter.errors.MindIEError`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from adapter.errors import validation_error
from adapter.protocol import media
from adapter.protocol.common import (
    FLT_MAX,
    FLT_MAX_TEXT,
    INT32_MAX,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    TEMPERATURE_MIN_INFER,
    TOP_P_MIN,
    UINT64_MAX,
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
    no_default,
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
    "InferInputElement",
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
        text = media.text_for_text_only_model(elements)  # the served model reads text only
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
# The request models document exactly the types and ranges parse_infer_request accepts (null
# is the same as absent, spec §0.1, except for inputs and media values). The route does not
# validate with them: the order and messages are MindIE's, and token limits and media
# sources are only checked above.

PositiveInt32 = Annotated[int, Field(gt=0, le=INT32_MAX)]


class MediaUrl(BaseModel):
    model_config = ConfigDict(extra="allow")

    url: str
    detail: Optional[str] = Field(None, description="Only 'auto' has an effect.")


MediaValue = Union[str, MediaUrl]


class InferInputElement(BaseModel):
    """One element of a multimodal ``inputs`` list (spec §3.4): ``{"type": T, T: value}``.

    This model reads text only: the first element must be text, and media elements
    are validated, then refused with 422.
    """

    model_config = ConfigDict(extra="allow")

    type: Optional[Literal["text", "image_url", "video_url", "audio_url"]] = Field(
        None, description="Inferred from the key present when missing.")
    text: str = Field(None, min_length=1, json_schema_extra=no_default)
    image_url: MediaValue = Field(None, json_schema_extra=no_default)
    video_url: MediaValue = Field(None, json_schema_extra=no_default)
    audio_url: MediaValue = Field(None, json_schema_extra=no_default)


class InferParameters(BaseModel):
    """``parameters`` (spec §3.2). Unknown keys are ignored."""

    model_config = ConfigDict(extra="allow")

    temperature: Optional[Annotated[float, Field(gt=TEMPERATURE_MIN_INFER, le=FLT_MAX)]] = Field(
        None, description="Default 1.0.")
    top_k: Optional[PositiveInt32] = Field(None, description=">= vocab size means vocab size.")
    top_p: Optional[Annotated[float, Field(gt=TOP_P_MIN, lt=1.0)]] = Field(
        None, description="Open interval: 1.0 itself is rejected; absent means no filtering.")
    typical_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = Field(None, description="Validated, no effect.")
    do_sample: Optional[bool] = Field(None, description="false forces greedy decoding.")
    seed: Optional[Annotated[int, Field(gt=0, le=UINT64_MAX)]] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0.0, le=FLT_MAX)]] = Field(None, description="Default 1.0.")
    watermark: Optional[bool] = Field(None, description="Validated, no effect.")
    priority: Optional[Annotated[int, Field(ge=1, le=MAX_PRIORITY)]] = Field(
        None, description="Default 5; 1 is the most urgent.")
    max_new_tokens: Optional[PositiveInt32] = Field(None, description="Default 20; capped by maxIterTimes.")
    timeout: Optional[Annotated[int, Field(gt=0, le=MAX_TIMEOUT)]] = Field(None, description="Seconds, default 600.")
    details: Optional[bool] = Field(None, description="Return the details object.")


def _one_prompt(schema: dict) -> None:
    # inputs, or else a non-null input_id; "inputs" present with a non-null input_id is a conflict
    schema["oneOf"] = [
        {"required": ["inputs"], "properties": {"input_id": {"type": "null"}}},
        {"required": ["input_id"], "not": {"required": ["inputs"]}, "properties": {"input_id": {"type": "array"}}},
    ]


class InferRequest(BaseModel):
    """The ``/infer`` body (spec §3.1): ``inputs`` or ``input_id``. Unknown keys are ignored."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_one_prompt)

    inputs: Union[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)],
                  Annotated[list[InferInputElement], Field(min_length=1)]] = Field(
        None, description="Prompt text, or a list of elements whose first is text.", json_schema_extra=no_default)
    input_id: Optional[Annotated[list[Annotated[int, Field(ge=0, le=MAX_PROMPT_TOKENS)]], Field(min_length=1)]] = (
        Field(None, description="Prompt token ids, instead of inputs."))
    stream: Optional[bool] = Field(None, description="Server-sent events.")
    parameters: Optional[InferParameters] = None


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
