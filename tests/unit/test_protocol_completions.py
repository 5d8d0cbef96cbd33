"""``/v1/completions`` request validation: each rule's rejection, the combination rules and
the order of checks (spec §2.1–2.5, §0, §1.3, §7); what an accepted request becomes is in
test_protocol_completions_accepted.py."""

from __future__ import annotations

import json

import pytest
from llm_engine.config import Settings

from adapter.errors import MindIEError, error_body
from adapter.protocol.completions import (
    GenerationPlan,
    parse_completion_request,
)

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
BASE = {"model": MODEL, "prompt": "hello world"}
SETTINGS = Settings()
PARSE = "Failed to parse request context to json"


def tokenize(text: str) -> list[int]:
    return list(range(len(text.split())))


def parse(body: dict | bytes, *, vocab: int = VOCAB, tok=tokenize) -> GenerationPlan:
    raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    return parse_completion_request(raw, SETTINGS, tok, vocab)


def error_of(body, **kw) -> MindIEError:
    with pytest.raises(MindIEError) as info:
        parse(body, **kw)
    return info.value


def with_(**fields) -> dict:
    return {**BASE, **fields}


# ------------------------------------------------------------------ one bad value per rule

BAD = [
    # §1.1 body
    (b"{", PARSE),
    (b'{"model": "a",}', PARSE),
    (b"\xff\xfe{}", PARSE),
    (b"[]", PARSE),
    (b'"text"', PARSE),
    (b'{"model": NaN}', PARSE),
    (b'{"temperature": 1e400}', PARSE),
    (b'{"prompt": "\\ud800"}', PARSE),
    (b'{"a":' + b"[" * 10 + b"]" * 10 + b"}", PARSE),
    # model
    ({"prompt": "hi"}, "Request contains not model or model null"),
    ({"model": None, "prompt": "hi"}, "Request contains not model or model null"),
    ({"model": 5, "prompt": "hi"}, "Request param model must be string"),
    ({"model": "", "prompt": "hi"}, "Request param model must be not empty"),
    ({"model": "gpt-4", "prompt": "hi"}, "Not found given model, please check modelName in config file."),
    # prompt
    ({"model": MODEL}, "Contains not prompt or prompt null"),
    (with_(prompt=None), "Contains not prompt or prompt null"),
    (with_(prompt=5), "The type of prompt is abnormal,prompt must be str or integer list."),
    (with_(prompt={"a": 1}), "The type of prompt is abnormal,prompt must be str or integer list."),
    (with_(prompt=[]), "Prompt array cannot be empty."),
    (with_(prompt=[1, "a"]), "All elements of the prompt array must be integers."),
    (with_(prompt=[1, True]), "All elements of the prompt array must be integers."),
    (with_(prompt=[1, 2.0]), "All elements of the prompt array must be integers."),
    (
        with_(prompt=""),
        "Length of Prompt text should be greater than 0 and less than or equal to 4194304, but got 0",
    ),
    (
        with_(prompt="   "),
        "Length of Prompt token should be greater than 0 and less than or equal to 1048576, but got 0",
    ),
    (with_(ignore_eos="true"), "ignore_eos must be boolean type."),
    # stop
    (with_(stop=5), "Input validation error: param stop must be string or list[string]"),
    (with_(stop={"a": 1}), "Input validation error: param stop must be string or list[string]"),
    (with_(stop=""), "Input validation error: length of `stop` must be in [1, 32768], but got 0"),
    (
        with_(stop="x" * 32769),
        "Input validation error: length of `stop` must be in [1, 32768], but got 32769",
    ),
    *[
        (
            with_(stop=bad),
            "Input validation error: `stop` must be list[string] if list, and item length in [1, 32768] "
            "with total <= 32768",
        )
        for bad in ([""], ["a", 1], ["a", None], ["x" * 20000, "y" * 20000])
    ],
    (with_(stop="a", include_stop_str_in_output="yes"), "include_stop_str_in_output must be boolean type."),
    (
        with_(stop_token_ids=[1], include_stop_str_in_output=1),
        "include_stop_str_in_output must be boolean type.",
    ),
    (with_(stop_token_ids=5), "Parameter stop_token_ids not array"),
    (with_(stop_token_ids="1,2"), "Parameter stop_token_ids not array"),
    # temperature / top_k / top_p / seed
    (with_(temperature="1"), "temperature must be float type."),
    (with_(temperature=True), "temperature must be float type."),
    (with_(temperature=-0.1), "Parameter temperature must be in (0.0,3.40282e+38], got -0.1."),
    (with_(temperature=3.5e38), "Parameter temperature must be in (0.0,3.40282e+38], got 3.5e+38."),
    (with_(top_k=1.0), "top_k must be integer type."),
    (with_(top_k="5"), "top_k must be integer type."),
    (with_(top_k=0), "Parameter top_k must be in -1 || (0,2147483647], got 0"),
    (with_(top_k=-1), "Parameter top_k must be in -1 || (0,2147483647], got -1"),
    (with_(top_k=2**31), "Parameter top_k must be in -1 || (0,2147483647], got 2147483648"),
    (with_(top_p="0.5"), "top_p must be float type."),
    (with_(top_p=0), "Parameter top_p must be in (1e-6,1.0], got 0."),
    (with_(top_p=1e-6), "Parameter top_p must be in (1e-6,1.0], got 1e-06."),
    (with_(top_p=1.01), "Parameter top_p must be in (1e-6,1.0], got 1.01."),
    (with_(seed=-1), "seed must be unsigned type."),
    (with_(seed=1.0), "seed must be unsigned type."),
    (with_(seed="1"), "seed must be unsigned type."),
    (with_(seed=0), "Parameter seed must be in (0, 18446744073709551615], got 0."),
    (with_(seed=2**64), "Parameter seed must be in (0, 18446744073709551615], got 18446744073709551616."),
    # penalties
    (with_(repetition_penalty="1"), "repetition_penalty must be float type."),
    (with_(repetition_penalty=0), "Parameter 'repetition_penalty' must be in (0.0, 2], got 0."),
    (with_(repetition_penalty=2.01), "Parameter 'repetition_penalty' must be in (0.0, 2], got 2.01."),
    (with_(frequency_penalty=[1]), "frequency_penalty must be float type."),
    (with_(frequency_penalty=-2.1), "Parameter frequency_penalty should be in [-2.0, 2.0], got -2.1."),
    (with_(presence_penalty=False), "presence_penalty must be float type."),
    (with_(presence_penalty=2.5), "Parameter presence_penalty not in [-2.0, 2.0], but got 2.5."),
    (with_(skip_special_tokens=0), "skip_special_tokens must be boolean type."),
    # best_of / n / beam / logprobs / max_tokens / stream
    (with_(best_of=-1), "best_of must be unsigned type."),
    (with_(best_of=2.0), "best_of must be unsigned type."),
    (with_(best_of=0), "Parameter [best_of] should be in [1, 128], got 0."),
    (with_(best_of=129), "Parameter [best_of] should be in [1, 128], got 129."),
    (with_(n="2"), "n must be unsigned type."),
    (with_(n=0), "Parameter [n] should be in [1, 8192], got 0. "),
    (with_(n=8193), "Parameter [n] should be in [1, 8192], got 8193. "),
    (
        with_(n=129, temperature=1),
        "The n parameter (129) exceeds 'maxN' (128). Please reduce n or increase 'maxN' in config.json "
        "of mindie-service.",
    ),
    (with_(use_beam_search="true"), "use_beam_search must be boolean type."),
    (with_(logprobs=True), "logprobs must be unsigned type."),
    (with_(logprobs=-1), "logprobs must be unsigned type."),
    (with_(logprobs=6), "logprobs should be in range [0, 5], got 6."),
    (with_(max_tokens=1.5), "Parameter max_tokens not number_integer"),
    (with_(max_tokens=10.0), "Parameter max_tokens not number_integer"),
    (with_(max_tokens="10"), "Parameter max_tokens not number_integer"),
    (with_(max_tokens=0), "Parameter max_tokens must be (0,2147483647], got 0"),
    (with_(max_tokens=2**31), "Parameter max_tokens must be (0,2147483647], got 2147483648"),
    (with_(stream="false"), "stream must be boolean type."),
    # response_format
    (with_(response_format="json"), "Parameter response_format must be an object"),
    (with_(response_format={}), "Parameter response_format must contain 'type' field"),
    (with_(response_format={"type": 1}), "Parameter response_format.type must be a string"),
    (
        with_(response_format={"type": "xml"}),
        "Parameter response_format.type must be 'json_object', 'json_schema' or 'text', got 'xml'",
    ),
    (
        with_(response_format={"type": "json_schema"}),
        "Parameter response_format.json_schema is required when type is 'json_schema'",
    ),
    (
        with_(response_format={"type": "json_schema", "json_schema": {"name": "", "schema": {}}}),
        "Parameter response_format.json_schema.name must be 1-64 characters",
    ),
    (
        with_(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "x"}}}),
        "Invalid json_schema: unsupported type 'x' at 'schema'",
    ),
    (  # passes the source's type walk, but does not compile
        with_(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/nope"}}}),
        "Invalid json_schema: Pointer '/nope' does not exist",
    ),
]


@pytest.mark.parametrize(("body", "message"), BAD)
def test_rejects_with_exact_message(body, message):
    err = error_of(body)
    assert (err.status, err.message, err.error_type) == (422, message, "Input Validation Error")
    assert list(error_body(err)) == ["error", "error_type"]


@pytest.mark.parametrize("fmt", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
])
def test_structured_formats_reach_the_engine_as_given(fmt):
    assert parse(with_(response_format=fmt)).sampling["response_format"] == fmt


def test_text_format_is_the_same_as_none():
    assert "response_format" not in parse(with_(response_format={"type": "text"})).sampling


def test_nesting_depth_ten_is_accepted():
    nested = {"a": [[[[[[[[1]]]]]]]]}  # object + 8 arrays + the body object = depth 10
    parse(with_(extra=nested))


@pytest.mark.parametrize("body", [
    json.dumps(with_(extra={"a": [[[[[[[[[1]]]]]]]]]})).encode(),  # depth 11
    json.dumps(with_(extra=[{"b": [{"c": [[{"d": [[[1]]]}]]}]}])).encode(),  # 11, objects and arrays
    b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
], ids=["11", "mixed-11", "100000"])
def test_nesting_deeper_than_ten_is_a_parse_error(body):
    assert error_of(body).message == PARSE


def test_an_unterminated_string_of_escaped_quotes_is_rejected_in_linear_time():
    """The depth check once scanned the text with a regex that restarted at every escaped
    quote of an unterminated string: 80 KB held the event loop (and the GIL) for 18 s."""
    import time

    body = b'{"model": "m", "prompt": "' + b'\\"' * 100_000
    started = time.monotonic()
    assert error_of(body).message == PARSE
    assert time.monotonic() - started < 5  # quadratic: minutes


# ------------------------------------------------------------------ combinations R1–R6

COMBINATIONS = [
    (
        with_(best_of=1, n=2, temperature=1.0),
        "Best_of must be greater than or equal to n, but best_of is 1 and n is 2.",
    ),
    (
        with_(stream=True, best_of=3, n=2, temperature=1.0),
        "best_of must be equal to n, but best_of is 3 and n is 2.",
    ),
    (
        with_(stream=True, best_of=2, temperature=1.0),
        "best_of must be equal to n in stream mode, but best_of is 2, n is None.",
    ),
    (
        with_(n=2),
        "Best_of and n shouldn't be greater than 1 when sampling is disabled, but best_of is null and n is 2.",
    ),
    (
        with_(best_of=2, temperature=0),
        "Best_of and n shouldn't be greater than 1 when sampling is disabled, but best_of is 2 and n is null.",
    ),
    (
        with_(best_of=3, n=2, temperature=1e-7),
        "Best_of and n shouldn't be greater than 1 when sampling is disabled, but best_of is 3 and n is 2.",
    ),
    (  # D7: enforced with beam search too
        with_(use_beam_search=True, n=2),
        "Best_of and n shouldn't be greater than 1 when sampling is disabled, but best_of is null and n is 2.",
    ),
    (with_(use_beam_search=True, stop="x"), "use_beam_search cannot be used together with stop"),
    (with_(use_beam_search=True, stop=["x"]), "use_beam_search cannot be used together with stop"),
]


@pytest.mark.parametrize(("body", "message"), COMBINATIONS)
def test_combination_rules(body, message):
    err = error_of(body)
    assert (err.status, err.message) == (422, message)


@pytest.mark.parametrize(
    "body",
    [
        with_(use_beam_search=True, best_of="junk", n=2, temperature=1.0),  # D6: best_of not checked
        with_(use_beam_search=True, best_of=1000, n=2, temperature=1.0),
        with_(use_beam_search=True, stop=[]),  # an empty list is null
        with_(use_beam_search=True, stop=None),
        with_(stream=True, n=2, temperature=0.5),  # R5: n alone is fine
        with_(best_of=3, n=2, temperature=0.5),
        with_(n=1, best_of=1),  # no sampling needed for one sequence
    ],
)
def test_combinations_accepted(body):
    parse(body)


@pytest.mark.parametrize(
    ("fields", "choices"),
    [
        ({}, 1),
        ({"n": 3, "temperature": 1.0}, 3),
        ({"best_of": 4, "n": 2, "temperature": 1.0}, 4),  # non-stream: best_of sequences
        ({"best_of": 3, "temperature": 1.0}, 3),
        ({"stream": True, "n": 3, "best_of": 3, "temperature": 1.0}, 3),
        ({"stream": True, "n": 2, "temperature": 1.0}, 2),
        ({"use_beam_search": True, "n": 3, "best_of": 7, "temperature": 1.0}, 3),
        ({"use_beam_search": True, "stream": True, "n": 2, "temperature": 1.0}, 2),
        ({"use_beam_search": True}, 1),
    ],
)
def test_number_of_choices(fields, choices):
    assert parse(with_(**fields)).num_choices == choices


def test_stop_strings_have_no_count_limit_by_default():
    """The API limits stop strings only by their total length (§2.1, D9)."""
    many = [f"s{i}" for i in range(5000)]
    assert sum(map(len, many)) <= 32768
    assert parse(with_(stop=many)).sampling["stop"] == many


def test_an_operator_can_cap_the_number_of_stop_strings():
    capped = SETTINGS.model_copy(update={"ServerConfig": SETTINGS.server.model_copy(update={"maxStopCount": 64})})
    raw = json.dumps(with_(stop=[str(i) for i in range(65)])).encode()
    with pytest.raises(MindIEError) as info:
        parse_completion_request(raw, capped, tokenize, VOCAB)
    assert info.value.message == "Input validation error: `stop` must contain at most 64 strings, but got 65"
    parse_completion_request(json.dumps(with_(stop=[str(i) for i in range(64)])).encode(), capped, tokenize, VOCAB)


def test_async_scheduling_forbids_multiple_sequences(monkeypatch):
    monkeypatch.setenv("MINDIE_ASYNC_SCHEDULING_ENABLE", "1")
    assert (
        error_of(with_(n=2, temperature=1.0)).message
        == "n must be 1 while MINDIE_ASYNC_SCHEDULING_ENABLE is on"
    )
    assert error_of(with_(use_beam_search=True)).message == (
        "use_beam_search is not supported while MINDIE_ASYNC_SCHEDULING_ENABLE is on"
    )
    parse(with_(n=1))


# ------------------------------------------------------------------ order (§2.5)

ORDER = [
    ({"model": 5, "prompt": 5}, "Request param model must be string"),
    (with_(prompt=[], temperature=-1), "Prompt array cannot be empty."),
    (with_(ignore_eos=1, stop=5), "ignore_eos must be boolean type."),
    (with_(stop=5, temperature=-1), "Input validation error: param stop must be string or list[string]"),
    (
        with_(stop="a", include_stop_str_in_output=1, stop_token_ids=5),
        "include_stop_str_in_output must be boolean type.",
    ),
    (with_(stop_token_ids=5, temperature=-1), "Parameter stop_token_ids not array"),
    (with_(temperature=-1, top_k=0), "Parameter temperature must be in (0.0,3.40282e+38], got -1."),
    (with_(top_k=0, top_p=0), "Parameter top_k must be in -1 || (0,2147483647], got 0"),
    (with_(top_p=0, seed=0), "Parameter top_p must be in (1e-6,1.0], got 0."),
    (with_(seed=0, repetition_penalty=0), "Parameter seed must be in (0, 18446744073709551615], got 0."),
    (
        with_(repetition_penalty=0, frequency_penalty=9),
        "Parameter 'repetition_penalty' must be in (0.0, 2], got 0.",
    ),
    (
        with_(frequency_penalty=9, presence_penalty=9),
        "Parameter frequency_penalty should be in [-2.0, 2.0], got 9.",
    ),
    (
        with_(presence_penalty=9, skip_special_tokens=1),
        "Parameter presence_penalty not in [-2.0, 2.0], but got 9.",
    ),
    (with_(skip_special_tokens=1, best_of=0), "skip_special_tokens must be boolean type."),
    (with_(best_of=0, n=0), "Parameter [best_of] should be in [1, 128], got 0."),
    (with_(n=0, use_beam_search=1), "Parameter [n] should be in [1, 8192], got 0. "),
    (with_(use_beam_search=1, logprobs=9), "use_beam_search must be boolean type."),
    (with_(logprobs=9, max_tokens=0), "logprobs should be in range [0, 5], got 9."),
    (with_(max_tokens=0, stream=1), "Parameter max_tokens must be (0,2147483647], got 0"),
    (with_(stream=1, response_format=1), "stream must be boolean type."),
    (with_(response_format=1, n=2), "Parameter response_format must be an object"),
    (with_(n=2, logprobs=9), "logprobs should be in range [0, 5], got 9."),  # type/range before R6
    (
        with_(use_beam_search=True, n=2, stop="x"),
        "Best_of and n shouldn't be greater than 1 when sampling "
        "is disabled, but best_of is null and n is 2.",
    ),  # R6 before R1
]


@pytest.mark.parametrize(("body", "message"), ORDER)
def test_only_the_first_failure_is_reported(body, message):
    assert error_of(body).message == message


def test_l2_before_temperature_and_tokenizer_error_is_422():
    def too_many(_text):
        return [0] * (1048576 + 1)

    assert error_of(with_(temperature=-1), tok=too_many).message == (
        "Length of Prompt token should be greater than 0 and less than or equal to 1048576, but got 1048577"
    )

    def broken(_text):
        raise ValueError("tokenizer exploded")

    err = error_of(BASE, tok=broken)
    assert (err.status, err.message) == (422, "tokenizer exploded")
