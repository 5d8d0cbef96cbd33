"""``POST /v1/completions``: request validation (spec §2.1–2.5); the body models are in
:mod:`adapter.protocol.completions_models`.

:func:`parse_completion_request` runs the checks in the order of spec §2.5 and
raises the first failure as a 422 :class:`~adapter.errors.MindIEError`.
"""

from __future__ import annotations

import os
from typing import Any

from adapter.errors import validation_error
from adapter.protocol.common import (
    INT32_MAX,
    MAX_PROMPT_CHARS,
    SAMPLING_OFF_BELOW,
    ErrorResponse,
    GenerationPlan,
    Tokenize,
    check_repetition_penalty,
    check_response_format,
    check_seed,
    check_temperature,
    check_token_count,
    check_top_k,
    check_top_p,
    clamp_top_k,
    is_int,
    json_text,
    opt_bool,
    opt_number,
    opt_unsigned,
    parse_body,
    tokenize_text,
)
from adapter.protocol.completions_models import (
    MAX_BEST_OF,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_TOTAL,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    CompletionUsage,
)

__all__ = [
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "CompletionUsage",
    "ErrorResponse",
    "GenerationPlan",
    "parse_completion_request",
]

ASYNC_SCHEDULING_ENV = "MINDIE_ASYNC_SCHEDULING_ENABLE"
L2_MESSAGE = "Length of Prompt token should be greater than 0 and less than or equal to {max}, but got {n}"


def parse_completion_request(
    raw: bytes, settings: Any, tokenize: Tokenize, vocab_size: int
) -> GenerationPlan:
    """Validate a ``/v1/completions`` body and resolve it into a :class:`GenerationPlan`."""
    body = parse_body(raw)
    model = _check_model(body, settings)
    prompt_text, prompt_ids = _check_prompt(body, tokenize)
    ignore_eos = opt_bool(body, "ignore_eos")
    stop = _check_stop(body, settings.server.maxStopCount)
    # R7: ignored (not even type-checked) unless stop/stop_token_ids is given (null and [] are not).
    stop_ids_given = body.get("stop_token_ids") not in (None, [])
    include_stop = opt_bool(body, "include_stop_str_in_output") if (stop or stop_ids_given) else None
    stop_token_ids = _check_stop_token_ids_type(body)
    temperature = check_temperature(body, allow_zero=True)
    top_k = check_top_k(body)
    top_p = check_top_p(body, allow_one=True)
    seed = check_seed(body)
    repetition_penalty = check_repetition_penalty(body, upper=2.0, upper_text="2")
    frequency_penalty = _check_penalty(
        body, "frequency_penalty", "Parameter frequency_penalty should be in [-2.0, 2.0], got {v}."
    )
    presence_penalty = _check_penalty(
        body, "presence_penalty", "Parameter presence_penalty not in [-2.0, 2.0], but got {v}."
    )
    skip_special_tokens = opt_bool(body, "skip_special_tokens")
    max_n = settings.schedule.maxN
    # D6: with beam search best_of is ignored without any check.
    best_of = (
        None if body.get("use_beam_search") is True else _check_count(body, "best_of", MAX_BEST_OF, max_n)
    )
    n = _check_count(body, "n", MAX_N, max_n)
    beam = bool(opt_bool(body, "use_beam_search"))
    logprobs = opt_unsigned(body, "logprobs")
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise validation_error(f"logprobs should be in range [0, {MAX_LOGPROBS}], got {json_text(logprobs)}.")
    max_tokens = _check_max_tokens(body)
    stream = bool(opt_bool(body, "stream"))
    structured = check_response_format(body)
    num_choices = _check_choice_rules(beam, stream, best_of, n, temperature)
    _check_restrictions(beam, stop, n, best_of)

    sampling: dict[str, Any] = {
        "max_tokens": min(max_tokens or settings.schedule.maxIterTimes, settings.schedule.maxIterTimes)
    }
    optional = {
        "temperature": temperature,
        "top_k": None if top_k is None else clamp_top_k(top_k, vocab_size),
        "top_p": top_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "seed": seed,
        "stop": stop or None,
        "stop_token_ids": stop_token_ids or None,
        "include_stop_str_in_output": True if include_stop else None,
        "ignore_eos": True if ignore_eos else None,
        "skip_special_tokens": False if skip_special_tokens is False else None,
        "logprobs": logprobs,
        "n": n,
        "best_of": best_of,
        "use_beam_search": body.get("use_beam_search"),
        "response_format": body["response_format"] if structured else None,
    }
    sampling.update({k: v for k, v in optional.items() if v is not None})
    return GenerationPlan(
        endpoint="completions",
        model=model,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        stream=stream,
        sampling=sampling,
        details=False,
        num_choices=num_choices,
        logprobs=logprobs,
    )


# --------------------------------------------------------------------------- field checks


def _check_model(body: dict, settings: Any) -> str:
    model = body.get("model")
    if model is None:
        raise validation_error("Request contains not model or model null")
    if not isinstance(model, str):
        raise validation_error("Request param model must be string")
    if not model:
        raise validation_error("Request param model must be not empty")
    if model not in {m.modelName for m in settings.deploy.ModelConfig}:
        raise validation_error("Not found given model, please check modelName in config file.")
    return model


def _check_prompt(body: dict, tokenize: Tokenize) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if prompt is None:
        raise validation_error("Contains not prompt or prompt null")
    if isinstance(prompt, str):
        if not 0 < len(prompt) <= MAX_PROMPT_CHARS:
            raise validation_error(
                "Length of Prompt text should be greater than 0 and less than or equal to "
                f"{MAX_PROMPT_CHARS}, but got {len(prompt)}"
            )
        check_token_count(len(tokenize_text(tokenize, prompt)), L2_MESSAGE)
        return prompt, None
    if isinstance(prompt, list):
        if not prompt:
            raise validation_error("Prompt array cannot be empty.")
        if not all(is_int(t) for t in prompt):
            raise validation_error("All elements of the prompt array must be integers.")
        check_token_count(len(prompt), L2_MESSAGE)
        return None, list(prompt)
    raise validation_error("The type of prompt is abnormal,prompt must be str or integer list.")


def _check_stop(body: dict, max_count: int) -> list[str]:
    """Plain strings (never regexes); ``[]`` is the same as ``null``."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        if not 1 <= len(stop) <= MAX_STOP_TOTAL:
            raise validation_error(
                f"Input validation error: length of `stop` must be in [1, {MAX_STOP_TOTAL}], but got {len(stop)}"
            )
        return [stop]
    if not isinstance(stop, list):
        raise validation_error("Input validation error: param stop must be string or list[string]")
    if not all(isinstance(s, str) and s for s in stop) or sum(len(s) for s in stop) > MAX_STOP_TOTAL:
        raise validation_error(
            "Input validation error: `stop` must be list[string] if list, and item length in "
            f"[1, {MAX_STOP_TOTAL}] with total <= {MAX_STOP_TOTAL}"
        )
    if max_count and len(stop) > max_count:  # an operator's cap (maxStopCount); none by default
        raise validation_error(
            f"Input validation error: `stop` must contain at most {max_count} strings, but got {len(stop)}"
        )
    return list(stop)


def _check_stop_token_ids_type(body: dict) -> list[int]:
    """Only the array type is checked; non-int32 items are dropped (D10), duplicates removed."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list):
        raise validation_error("Parameter stop_token_ids not array")
    return sorted({t for t in ids if is_int(t) and 0 <= t <= INT32_MAX})


def _check_penalty(body: dict, key: str, template: str) -> float | None:
    """``frequency_penalty`` / ``presence_penalty``: [-2.0, 2.0]."""
    value = opt_number(body, key)
    if value is None:
        return None
    if not -2.0 <= value <= 2.0:
        raise validation_error(template.format(v=json_text(value)))
    return float(value)


def _check_count(body: dict, key: str, upper: int, max_n: int) -> int | None:
    """``best_of`` [1, 128] / ``n`` [1, 8192], then the deployment cap ``maxN`` (D13)."""
    value = opt_unsigned(body, key)
    if value is None:
        return None
    if not 1 <= value <= upper:
        tail = " " if key == "n" else ""
        raise validation_error(f"Parameter [{key}] should be in [1, {upper}], got {json_text(value)}.{tail}")
    if value > max_n:
        raise validation_error(
            f"The {key} parameter ({value}) exceeds 'maxN' ({max_n}). "
            f"Please reduce {key} or increase 'maxN' in config.json of mindie-service."
        )
    return value


def _check_max_tokens(body: dict) -> int | None:
    value = body.get("max_tokens")
    if value is None:
        return None
    if not is_int(value):
        raise validation_error("Parameter max_tokens not number_integer")
    if not 0 < value <= INT32_MAX:
        raise validation_error(f"Parameter max_tokens must be (0,{INT32_MAX}], got {json_text(value)}")
    return value


# --------------------------------------------------------------------------- combinations


def _check_choice_rules(
    beam: bool, stream: bool, best_of: int | None, n: int | None, temperature: float | None
) -> int:
    """R3–R6; returns the number of choices the response carries (spec §2.4)."""
    if beam:
        choices = n or 1
    elif not stream:
        if best_of is not None and n is not None and best_of < n:
            raise validation_error(
                f"Best_of must be greater than or equal to n, but best_of is {best_of} and n is {n}."
            )
        choices = best_of if best_of is not None else (n or 1)
    else:
        if best_of is not None and n is not None and best_of != n:
            raise validation_error(f"best_of must be equal to n, but best_of is {best_of} and n is {n}.")
        if best_of is not None and n is None:
            raise validation_error(
                f"best_of must be equal to n in stream mode, but best_of is {best_of}, n is None."
            )
        choices = n or 1
    # R6 (D7: also under beam search); an absent temperature counts as 0.
    if choices > 1 and (temperature is None or temperature < SAMPLING_OFF_BELOW):
        shown_best_of = "null" if best_of is None else best_of
        shown_n = "null" if n is None else n
        raise validation_error(
            "Best_of and n shouldn't be greater than 1 when sampling is disabled, "
            f"but best_of is {shown_best_of} and n is {shown_n}."
        )
    return choices


def _check_restrictions(
    beam: bool, stop: list[str], n: int | None, best_of: int | None) -> None:
    """R1 and the deployment restrictions this project can meet (spec §2.1)."""
    if beam and stop:
        raise validation_error("use_beam_search cannot be used together with stop")
    if os.environ.get(ASYNC_SCHEDULING_ENV) == "1":
        if beam:
            raise validation_error(
                "use_beam_search is not supported while MINDIE_ASYNC_SCHEDULING_ENABLE is on"
            )
        if (n or 1) != 1:
            raise validation_error("n must be 1 while MINDIE_ASYNC_SCHEDULING_ENABLE is on")
        if (best_of or 1) != 1:
            raise validation_error("best_of must be 1 while MINDIE_ASYNC_SCHEDULING_ENABLE is on")
