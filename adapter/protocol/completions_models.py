"""``POST /v1/completions``: the body models and the limits they document (spec §2.1–2.5).

The request model documents exactly the types and ranges
:func:`~adapter.protocol.completions.parse_completion_request` accepts (null is the same
as absent, spec §0.1). The route does not validate with it: the order and messages are
MindIE's, and combination rules and token limits are only checked there.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from adapter.protocol.common import FLT_MAX, INT32_MAX, MAX_PROMPT_CHARS, TOP_P_MIN, UINT64_MAX

MAX_STOP_TOTAL = 32768
MAX_BEST_OF = 128
MAX_N = 8192
MAX_LOGPROBS = 5

Prompt = Union[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)],
               Annotated[list[int], Field(min_length=1)]]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_TOTAL)]


class JsonSchemaFormat(BaseModel):
    """The schema that the output must follow. Other keys (``strict``, ``description``) are ignored."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON Schema (draft 2020-12 keywords); "
                                    "422 if it does not compile")


class ResponseFormat(BaseModel):
    """Structured output: ``text`` (the same as absent), any JSON object, or JSON following a schema.

    The output is constrained token by token; it ends with ``stop`` once the JSON is whole, or
    ``length`` (cut JSON) if ``max_tokens`` comes first.
    """

    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"]},
    })

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="Required when type is json_schema.")


class CompletionRequest(BaseModel):
    """The ``/v1/completions`` body (spec §2.1). Unknown keys are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="A configured modelName.")
    prompt: Prompt = Field(description="Prompt text (at most 4194304 characters and 1048576 tokens), "
                                       "or a non-empty array of token ids.")
    use_beam_search: Optional[bool] = Field(None, description="Beam search (default false).")
    best_of: Optional[Annotated[int, Field(ge=1, le=MAX_BEST_OF)]] = Field(
        None, description="Sequences generated without beam search; capped by maxN.")
    n: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = Field(None, description="Choices; capped by maxN.")
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = Field(
        None, description="Top alternatives per token.")
    max_tokens: Optional[Annotated[int, Field(gt=0, le=INT32_MAX)]] = Field(
        None, description="Default and cap: maxIterTimes.")
    seed: Optional[Annotated[int, Field(gt=0, le=UINT64_MAX)]] = None
    stop: Optional[Union[StopString, list[StopString]]] = Field(
        None, description="Plain stop string(s), at most 32768 characters in all (and maxStopCount "
        "strings when the operator sets it).")
    stop_token_ids: Optional[list[int]] = Field(
        None, description="Stop token ids; items that are not int32 ids are ignored.")
    include_stop_str_in_output: Optional[bool] = Field(
        None, description="Keep the matched stop string; ignored without stop or stop_token_ids.")
    stream: Optional[bool] = Field(None, description="Server-sent events.")
    repetition_penalty: Optional[Annotated[float, Field(gt=0.0, le=2.0)]] = Field(None, description="Default 1.0.")
    presence_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = Field(None, description="Default 0.0.")
    frequency_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = Field(None, description="Default 0.0.")
    temperature: Optional[Annotated[float, Field(ge=0.0, le=FLT_MAX)]] = Field(
        None, description="0 = greedy; default: the model's generation_config.json, else 1.0.")
    top_p: Optional[Annotated[float, Field(gt=TOP_P_MIN, le=1.0)]] = Field(None, description="Default 1.0.")
    top_k: Optional[Annotated[int, Field(gt=0, le=INT32_MAX)]] = Field(
        None, description=">= vocab size means vocab size; default: the model's.")
    ignore_eos: Optional[bool] = Field(None, description="Keep generating past EOS.")
    skip_special_tokens: Optional[bool] = Field(None, description="Drop special tokens from text (default true).")
    response_format: Optional[ResponseFormat] = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[Optional[float]]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    stop_reason: Optional[str] = None
    finish_reason: Optional[str] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens: int
    completion_tokens_details: Optional[CompletionTokensDetails] = None
    total_tokens: int
    batch_size: list[int] = Field(default_factory=list)
    queue_wait_time: list[int] = Field(default_factory=list, description="µs per iteration")


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class CompletionStreamResponse(BaseModel):
    """One SSE event; ``usage`` only in the event where a choice finishes."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[CompletionUsage] = None
