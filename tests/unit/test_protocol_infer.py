"""``/infer`` request validation (spec §3.1–3.4, §0, §1.3, §7)."""

from __future__ import annotations

import json

import pytest
from llm_engine.config import Settings
from llm_engine.params import parse_sampling_parameters

from adapter.errors import MindIEError
from adapter.protocol.infer import (
    GenerationPlan,
    InferRequest,
    InferResponse,
    InferStreamEvent,
    parse_infer_request,
)

VOCAB = 49152
BASE = {"inputs": "My name is Olivier and I"}
SETTINGS = Settings()
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="


def tokenize(text: str) -> list[int]:
    return list(range(len(text.split())))


def no_dns(host: str) -> list[str]:
    raise AssertionError(f"unexpected DNS lookup of {host}")


def parse(body: dict | bytes, *, tok=tokenize, resolver=no_dns) -> GenerationPlan:
    raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    return parse_infer_request(raw, SETTINGS, tok, VOCAB, resolver=resolver)


def error_of(body, **kw) -> MindIEError:
    with pytest.raises(MindIEError) as info:
        parse(body, **kw)
    return info.value


def params(**fields) -> dict:
    return {**BASE, "parameters": fields}


L1 = "Inputs must be necessary and data type must be string and length in (0, 4194304], but the length of inputs is {}"
FLT = "3.40282e+38"

BAD = [
    (b"{", "Failed to parse request context to json"),
    (b"\xc3\x28", "Failed to parse request context to json"),
    (b'{"inputs": "a", "x": ' + b"[" * 10 + b"]" * 10 + b"}", "Failed to parse request context to json"),
    # inputs / input_id
    ({}, "Not found inputs."),
    ({"input_id": None}, "Not found inputs."),
    ({"stream": True}, "Not found inputs."),
    ({"inputs": "a", "input_id": [1]}, "Input conflict."),
    ({"inputs": None, "input_id": [1]}, "Input conflict."),
    ({"inputs": None}, "Inputs must not be null"),
    ({"inputs": 5}, "The type of inputs is abnormal"),
    ({"inputs": {"text": "a"}}, "The type of inputs is abnormal"),
    ({"inputs": []}, "Inputs arr is empty"),
    ({"inputs": ""}, L1.format(0)),
    ({"inputs": "   "}, "Inputs token length must be in (0, 1048576], but got 0"),
    ({"input_id": 5}, "Parameter input_id must be an array"),
    ({"input_id": "1 2"}, "Parameter input_id must be an array"),
    ({"input_id": []}, "Input_id should not be empty"),
    ({"input_id": [1, "2"]}, "Parameter input_id must be integer"),
    ({"input_id": [1, 2.0]}, "Parameter input_id must be integer"),
    ({"input_id": [True]}, "Parameter input_id must be integer"),
    ({"input_id": [-1]}, "Data element in param input_id is invalid"),
    ({"input_id": [1048577]}, "Data element in param input_id is invalid"),
    # list inputs: shape
    ({"inputs": [{"type": "text", "text": 5}]}, "Request param text must be string"),
    (
        {"inputs": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": None}]},
        "Request param image_url null",
    ),
    ({"inputs": [{"text": "a"}, {"video_url": None}]}, "Request param video_url null"),
    ({"inputs": [{"text": "a"}, {"audio_url": None}]}, "Request param audio_url null"),
    (
        {"inputs": [{"type": "text", "text": "a"}] + [{"type": "image_url", "image_url": PNG}] * 21},
        "The number of multimodal url should be no more than 20",
    ),
    ({"inputs": [{"type": "gif_url", "gif_url": "x"}]}, "Input type gif_url does not match the mm type."),
    ({"inputs": ["hello"]}, "The input type of 'str' is invalid, it should be a List[Dict]."),
    (
        {"inputs": [{"type": "image_url", "image_url": PNG}, {"type": "text", "text": "a"}]},
        "The first element of inputs must be a text element for a text-only model, got image_url",
    ),
    ({"inputs": [{"type": "text", "text": ""}]}, "Request param text must be not empty"),
    # parameters
    ({**BASE, "parameters": 5}, "parameters must be object type."),
    ({**BASE, "parameters": [1]}, "parameters must be object type."),
    (params(temperature="1"), "temperature must be float type."),
    (params(temperature=0), f"Parameter temperature must be in (1e-6,{FLT}], got 0."),
    (params(temperature=1e-6), f"Parameter temperature must be in (1e-6,{FLT}], got 1e-06."),
    (params(temperature=4e38), f"Parameter temperature must be in (1e-6,{FLT}], got 4e+38."),
    (params(top_k=2.0), "top_k must be integer type."),
    (params(top_k=0), "Parameter top_k must be in -1 || (0,2147483647], got 0"),
    (params(top_k=-1), "Parameter top_k must be in -1 || (0,2147483647], got -1"),
    (params(top_p=1.0), "Parameter top_p must be in (1e-6,1.0], got 1.0."),
    (params(top_p=1), "Parameter top_p must be in (1e-6,1.0], got 1."),
    (params(top_p=0.0), "Parameter top_p must be in (1e-6,1.0], got 0.0."),
    (params(top_p="x"), "top_p must be float type."),
    (params(typical_p="x"), "typical_p must be float type."),
    (params(typical_p=0), "Parameter typical_p must be in (0.0,1.0], got 0."),
    (params(typical_p=1.5), "Parameter typical_p must be in (0.0,1.0], got 1.5."),
    (params(do_sample="false"), "do_sample must be boolean type."),
    (params(seed=0), "Parameter seed must be in (0, 18446744073709551615], got 0."),
    (params(seed=-3), "seed must be unsigned type."),
    (params(repetition_penalty=0), f"Parameter 'repetition_penalty' must be in (0.0, {FLT}], got 0."),
    (params(repetition_penalty=-1.5), f"Parameter 'repetition_penalty' must be in (0.0, {FLT}], got -1.5."),
    (params(watermark=1), "watermark must be boolean type."),
    (params(priority=0), "Parameter priority must be in [1,5], got 0."),
    (params(priority=6), "Parameter priority must be in [1,5], got 6."),
    (params(priority=-1), "priority must be unsigned type."),
    (params(priority=1.0), "priority must be unsigned type."),
    (params(max_new_tokens=1.5), "max_new_tokens must be integer type."),
    (params(max_new_tokens="20"), "max_new_tokens must be integer type."),
    (params(max_new_tokens=0), "Parameter max_new_tokens must be in (0,2147483647], got 0."),
    (params(max_new_tokens=2**31), "Parameter max_new_tokens must be in (0,2147483647], got 2147483648."),
    (params(timeout=0), "Parameter timeout must be strictly positive and small than 3600 seconds, got 0."),
    (
        params(timeout=3601),
        "Parameter timeout must be strictly positive and small than 3600 seconds, got 3601.",
    ),
    (params(timeout=-1), "timeout must be unsigned type."),
    (params(timeout=1.5), "timeout must be unsigned type."),
    (params(details="yes"), "details must be boolean type."),
    ({**BASE, "stream": "true"}, "stream must be boolean type."),
]


@pytest.mark.parametrize(("body", "message"), BAD)
def test_rejects_with_exact_message(body, message):
    err = error_of(body)
    assert (err.status, err.message, err.error_type) == (422, message, "Input Validation Error")


TOO_LONG_WITH_MEDIA = [{"text": "a" * 4194304}, {"image_url": "http://evil.example/a.png"}]
ORDER = [
    ({"inputs": 5, "parameters": 5}, "The type of inputs is abnormal"),
    ({"inputs": "a", "parameters": 5, "stream": 1}, "parameters must be object type."),
    (params(temperature=0, top_k=0), f"Parameter temperature must be in (1e-6,{FLT}], got 0."),
    (params(top_k=0, top_p=1.0), "Parameter top_k must be in -1 || (0,2147483647], got 0"),
    (params(top_p=1.0, typical_p=0), "Parameter top_p must be in (1e-6,1.0], got 1.0."),
    (params(typical_p=0, do_sample=1), "Parameter typical_p must be in (0.0,1.0], got 0."),
    (params(do_sample=1, seed=0), "do_sample must be boolean type."),
    (params(seed=0, repetition_penalty=0), "Parameter seed must be in (0, 18446744073709551615], got 0."),
    (
        params(repetition_penalty=0, watermark=1),
        f"Parameter 'repetition_penalty' must be in (0.0, {FLT}], got 0.",
    ),
    (params(watermark=1, priority=0), "watermark must be boolean type."),
    (params(priority=0, max_new_tokens=0), "Parameter priority must be in [1,5], got 0."),
    (params(max_new_tokens=0, timeout=0), "Parameter max_new_tokens must be in (0,2147483647], got 0."),
    (
        params(timeout=0, details=1),
        "Parameter timeout must be strictly positive and small than 3600 seconds, got 0.",
    ),
    ({**params(details=1), "stream": 1}, "details must be boolean type."),
    # shape (incl. the 20-media cap) before L1 before media sources
    (
        {"inputs": [{"text": "a" * 4194304}] + [{"image_url": PNG}] * 21},
        "The number of multimodal url should be no more than 20",
    ),
    ({"inputs": TOO_LONG_WITH_MEDIA}, L1.format(len(json.dumps(TOO_LONG_WITH_MEDIA, separators=(",", ":"))))),
]


@pytest.mark.parametrize(("body", "message"), ORDER)
def test_only_the_first_failure_is_reported(body, message):
    assert error_of(body).message == message


def test_l2_and_tokenizer_errors():
    assert error_of(params(temperature=0), tok=lambda _t: [1] * 1048577).message == (
        "Inputs token length must be in (0, 1048576], but got 1048577"
    )

    def broken(_text):
        raise RuntimeError("IbisTokenizer encode error: boom")

    err = error_of(BASE, tok=broken)
    assert (err.status, err.message) == (422, "IbisTokenizer encode error: boom")
    assert (
        error_of({"input_id": [1] * 1048577}).message
        == "Inputs token length must be in (0, 1048576], but got 1048577"
    )


# ------------------------------------------------------------------ defaults, mapping


def test_defaults():
    # temperature: seed B fixes /infer's default at 1.0, so it is sent; /v1/completions leaves it
    # unset for the model's generation_config.json default (spec §2.1)
    assert parse(BASE) == GenerationPlan(
        endpoint="infer",
        model=None,
        prompt_text=BASE["inputs"],
        prompt_ids=None,
        stream=False,
        sampling={"max_tokens": 20, "temperature": 1.0, "priority": 5, "timeout": 600},
        details=False,
        num_choices=1,
        logprobs=None,
    )


def test_null_means_absent():
    keys = [
        "temperature", "top_k", "top_p", "max_new_tokens", "do_sample", "seed", "repetition_penalty",
        "details", "typical_p", "watermark", "priority", "timeout",
    ]  # fmt: skip
    assert parse({**params(**dict.fromkeys(keys)), "stream": None}) == parse(BASE)
    assert parse({**BASE, "parameters": None}) == parse(BASE)
    assert parse({**BASE, "input_id": None}) == parse(BASE)


def test_seed_b_example_maps_to_engine_parameters():
    body = {
        "inputs": "My name is Olivier and I",
        "stream": False,
        "parameters": {
            "temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20, "do_sample": True,
            "seed": None, "repetition_penalty": 1.03, "details": True, "typical_p": 0.5,
            "watermark": False, "priority": 5, "timeout": 10,
        },
    }  # fmt: skip
    plan = parse(body)
    assert plan.details is True and plan.stream is False
    assert plan.sampling == {
        "max_tokens": 20,
        "temperature": 0.5,
        "top_k": 10,
        "top_p": 0.95,
        "repetition_penalty": 1.03,
        "do_sample": True,
        "priority": 5,
        "timeout": 10,
    }
    parse_sampling_parameters(json.dumps(plan.sampling))


def test_do_sample_false_and_greedy_defaults():
    plan = parse(params(do_sample=False, seed=7, repetition_penalty=3.0, priority=1, timeout=3600))
    assert plan.sampling["do_sample"] is False
    assert (plan.sampling["seed"], plan.sampling["repetition_penalty"]) == (7, 3.0)
    assert (plan.sampling["priority"], plan.sampling["timeout"]) == (1, 3600)
    parse_sampling_parameters(json.dumps(plan.sampling))


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 20), (5, 5), (512, 512), (513, 512), (2**31 - 1, 512)]
)
def test_max_new_tokens_resolution(value, expected):
    assert parse(params(max_new_tokens=value)).sampling["max_tokens"] == expected


@pytest.mark.parametrize(
    ("top_k", "expected"), [(1, 1), (VOCAB - 1, VOCAB - 1), (VOCAB, VOCAB), (2**31 - 1, VOCAB)]
)
def test_top_k_clamp(top_k, expected):
    assert parse(params(top_k=top_k)).sampling["top_k"] == expected


def test_input_id_and_stream_and_details():
    plan = parse({"input_id": [0, 5, 1048576], "stream": True, "parameters": {"details": True}})
    assert (plan.prompt_text, plan.prompt_ids, plan.stream, plan.details) == (
        None,
        [0, 5, 1048576],
        True,
        True,
    )


def test_unicode_length_counts_characters():
    assert parse({"inputs": "😀" * 4194304}).prompt_text is not None
    assert error_of({"inputs": "中" * 4194305}).message == L1.format(4194305)


def test_list_inputs_l1_uses_compact_json():
    overhead = len(json.dumps([{"type": "text", "text": ""}], separators=(",", ":")))
    parse({"inputs": [{"type": "text", "text": "中" * (4194304 - overhead)}]})
    assert error_of({"inputs": [{"type": "text", "text": "中" * (4194305 - overhead)}]}).message == L1.format(
        4194305
    )


def test_text_only_model_uses_the_first_text_and_ignores_valid_media():
    assert parse({"inputs": [{"type": "text", "text": "describe"}]}).prompt_text == "describe"
    assert parse({"inputs": [{"text": "typeless"}]}).prompt_text == "typeless"  # D20
    body = {
        "inputs": [
            {"type": "text", "text": "describe"},
            {"type": "image_url", "image_url": PNG},
        ]
    }
    assert parse(body).prompt_text == "describe"  # spec §3.4: validated, then ignored


def test_media_urls_are_validated_for_text_only_models(monkeypatch):
    monkeypatch.delenv("ALLOWED_MEDIA_DOMAINS_ENV", raising=False)
    body = {
        "inputs": [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": "https://cdn.example.com/x.png"},
        ]
    }
    assert error_of(body).message.startswith("The media URL domain is not allowed")
    monkeypatch.setenv("ALLOWED_MEDIA_DOMAINS_ENV", "cdn.example.com")
    assert "disallowed address 10.0.0.5" in error_of(body, resolver=lambda h: ["10.0.0.5"]).message
    # a valid public, whitelisted URL passes the media rules and is ignored by the text-only model
    assert parse(body, resolver=lambda h: ["93.184.216.34"]).prompt_text == "a"


# ------------------------------------------------------------------ models


def test_request_model_documents_types_and_ranges():
    """The model was a loose, accept-anything document; it now states the real types and ranges
    for the OpenAPI document (tests/unit/test_openapi.py checks it against the BAD table). The
    route still validates with parse_infer_request, for MindIE's order and messages."""
    schema = InferRequest.model_json_schema()
    assert set(schema["properties"]) == {"inputs", "input_id", "stream", "parameters"}
    assert "default" not in schema["properties"]["inputs"]  # may be left out, but not null
    params = schema["$defs"]["InferParameters"]["properties"]
    assert params["top_p"]["anyOf"][0] == {"exclusiveMaximum": 1.0, "exclusiveMinimum": 1e-6, "type": "number"}
    InferRequest.model_validate({"inputs": "a", "parameters": {"top_k": 5}, "unknown": 1})


def test_response_models():
    body = {
        "generated_text": "am a",
        "details": {"finish_reason": "length", "generated_tokens": 2, "seed": 846930886},
    }
    assert InferResponse.model_validate(body).model_dump() == body
    final = {
        "prefill_time": None,
        "decode_time": 16.8,
        "generated_text": "am a cat",
        "details": {"finish_reason": "length", "generated_tokens": 3, "seed": 1234},
        "token": {"id": [6635], "text": None},
    }
    assert list(InferStreamEvent.model_validate(final).model_dump()) == list(final)
