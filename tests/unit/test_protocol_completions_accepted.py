"""``/v1/completions``: what an accepted request becomes (defaults, the mapping to the
engine's sampling parameters, character counts) and the body models (spec §2.1–2.5, §0.3).
The rejections are in test_protocol_completions.py, whose helpers these tests share."""

from __future__ import annotations

import json

import pytest
from llm_engine.params import parse_sampling_parameters

from adapter.protocol.completions import (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    GenerationPlan,
)
from tests.unit.test_protocol_completions import (
    BASE,
    MODEL,
    SETTINGS,
    VOCAB,
    error_of,
    parse,
    with_,
)

# ------------------------------------------------------------------ defaults and mapping


def test_defaults():
    plan = parse(BASE)
    assert plan == GenerationPlan(
        endpoint="completions",
        model=MODEL,
        prompt_text="hello world",
        prompt_ids=None,
        stream=False,
        sampling={"max_tokens": SETTINGS.schedule.maxIterTimes},
        details=False,
        num_choices=1,
        logprobs=None,
    )


OPTIONAL_FIELDS = [
    "use_beam_search", "best_of", "n", "logprobs", "max_tokens", "seed", "stop", "stop_token_ids",
    "include_stop_str_in_output", "stream", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "temperature", "top_p", "top_k", "ignore_eos", "skip_special_tokens", "response_format",
]  # fmt: skip


def test_null_means_absent():
    assert parse(with_(**dict.fromkeys(OPTIONAL_FIELDS))) == parse(BASE)


def test_full_mapping_matches_engine_contract():
    plan = parse(
        with_(
            temperature=0.7, top_k=50, top_p=0.9, seed=2**64 - 1, repetition_penalty=1.1,
            presence_penalty=-0.5, frequency_penalty=0.5, stop=["</s>", "\n\n"], stop_token_ids=[7, 3, 7, -1, 2**31, "a"],
            include_stop_str_in_output=True, ignore_eos=True, skip_special_tokens=False, logprobs=2,
            n=2, best_of=3, use_beam_search=False, max_tokens=16, stream=False,
        )
    )  # fmt: skip
    assert plan.sampling == {
        "max_tokens": 16,
        "temperature": 0.7,
        "top_k": 50,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
        "presence_penalty": -0.5,
        "frequency_penalty": 0.5,
        "seed": 2**64 - 1,
        "stop": ["</s>", "\n\n"],
        "stop_token_ids": [3, 7],
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "logprobs": 2,
        "n": 2,
        "best_of": 3,
        "use_beam_search": False,
    }
    assert (plan.num_choices, plan.logprobs) == (3, 2)
    parse_sampling_parameters(json.dumps(plan.sampling), max_n=SETTINGS.schedule.maxN)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"use_beam_search": True, "n": 4, "best_of": "x", "temperature": 1},
        {"stream": True, "n": 2, "best_of": 2, "temperature": 0.5, "logprobs": 0},
        {"prompt": [1, 2, 3], "top_k": 10**9, "stop": "x"},
        {"temperature": 0},
    ],
)
def test_sampling_is_accepted_by_engine(fields):
    parse_sampling_parameters(json.dumps(parse(with_(**fields)).sampling), max_n=SETTINGS.schedule.maxN)


def test_include_stop_str_ignored_without_stop():
    for fields in ({}, {"stop": None}, {"stop": []}, {"stop_token_ids": []}):
        plan = parse(with_(include_stop_str_in_output="not even checked", **fields))
        assert "include_stop_str_in_output" not in plan.sampling


@pytest.mark.parametrize(("value", "expected"), [(10, 10), (512, 512), (100000, 512), (2**31 - 1, 512)])
def test_max_tokens_is_capped_by_max_iter_times(value, expected):
    assert parse(with_(max_tokens=value)).sampling["max_tokens"] == expected


@pytest.mark.parametrize(
    ("top_k", "vocab", "expected"),
    [(100, VOCAB, 100), (VOCAB, VOCAB, VOCAB), (VOCAB + 1, VOCAB, VOCAB), (5, 0, 0)],
)
def test_top_k_clamped_to_vocab_size(top_k, vocab, expected):
    assert parse(with_(top_k=top_k), vocab=vocab).sampling["top_k"] == expected


def test_temperature_zero_is_kept_and_absent_is_omitted():
    assert parse(with_(temperature=0)).sampling["temperature"] == 0.0
    assert "temperature" not in parse(BASE).sampling


def test_stop_string_becomes_list_and_stays_plain():
    assert parse(with_(stop=".*")).sampling["stop"] == [".*"]


def test_token_id_prompt():
    plan = parse(with_(prompt=[5, 6, 7]))
    assert (plan.prompt_text, plan.prompt_ids) == (None, [5, 6, 7])
    err = error_of(with_(prompt=[1] * (1048576 + 1)))
    assert err.message.endswith("but got 1048577")


# ------------------------------------------------------------------ unicode lengths (§0.3)


def test_prompt_length_counts_characters():
    parse(with_(prompt="中" * 4194304))
    assert error_of(with_(prompt="😀" * 4194305)).message == (
        "Length of Prompt text should be greater than 0 and less than or equal to 4194304, but got 4194305"
    )


def test_stop_length_counts_characters():
    assert parse(with_(stop="😀" * 32768)).sampling["stop"] == ["😀" * 32768]
    assert parse(with_(stop=["😀" * 16384, "é" * 16384])).sampling["stop"][1] == "é" * 16384


# ------------------------------------------------------------------ models


def test_request_model_documents_types_and_ranges():
    """The model was a loose, accept-anything document; it now states the real types and ranges
    for the OpenAPI document (tests/unit/test_openapi.py checks it against the BAD table). The
    route still validates with parse_completion_request, for MindIE's order and messages."""
    schema = CompletionRequest.model_json_schema()
    assert {"model", "prompt", "stop", "top_k"} <= set(schema["properties"])
    assert schema["required"] == ["model", "prompt"] and schema["additionalProperties"] is True
    assert schema["properties"]["model"] == {"description": "A configured modelName.", "minLength": 1,
                                             "title": "Model", "type": "string"}
    assert schema["properties"]["top_p"]["anyOf"][0] == {"exclusiveMinimum": 1e-6, "maximum": 1.0, "type": "number"}
    CompletionRequest.model_validate({**BASE, "unknown": 1})


def test_response_models_key_order():
    body = {
        "id": "endpoint_common_1",
        "object": "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {"index": 0, "text": "x", "logprobs": None, "stop_reason": None, "finish_reason": "length"}
        ],
        "usage": {
            "prompt_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens": 1,
            "total_tokens": 2,
            "batch_size": [1],
            "queue_wait_time": [5],
        },
    }
    dumped = CompletionResponse.model_validate(body).model_dump(exclude_none=True)
    assert list(dumped) == list(body)
    assert list(dumped["usage"]) == list(body["usage"])
    assert list(dumped["choices"][0]) == ["index", "text", "finish_reason"]
    event = CompletionStreamResponse.model_validate({**body, "usage": None})
    assert event.usage is None
