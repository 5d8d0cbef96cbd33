"""The OpenAPI document: every ``$ref`` resolves, no untyped catch-all, and the request schemas
reject what the real validation rejects (the unit tests' case tables, reused)."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator
from llm_engine.config import Settings

from adapter.app import create_app
from tests.unit import test_protocol_completions as completions_cases
from tests.unit import test_protocol_completions_accepted as completions_accepted
from tests.unit import test_protocol_infer as infer_cases


@pytest.fixture(scope="module")
def doc() -> dict:
    return create_app(Settings(), tokenizer=object()).openapi()


def walk(node, path=""):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{path}/{i}")


def resolve(doc: dict, ref: str):
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def test_every_ref_resolves(doc):
    refs = [(path, node["$ref"]) for path, node in walk(doc) if isinstance(node, dict) and "$ref" in node]
    assert len(refs) > 20
    for path, ref in refs:
        assert ref.startswith("#/components/schemas/"), (path, ref)
        resolve(doc, ref)
    assert not [path for path, _ in walk(doc) if path.endswith("/$defs")]


@pytest.mark.parametrize("path, status, media, schema", [
    ("/v1/completions", "200", "application/json", "CompletionResponse"),
    ("/v1/completions", "200", "text/event-stream", "CompletionStreamResponse"),
    ("/infer", "200", "application/json", "InferResponse"),
    ("/infer", "200", "text/event-stream", "InferStreamEvent"),
    *[(p, s, "application/json", "ErrorResponse") for p in ("/v1/completions", "/infer")
      for s in ("422", "424", "500", "503")],
    ("/infer", "413", "application/json", "BodyTooLarge"),
])
def test_routes_declare_their_responses(doc, path, status, media, schema):
    content = doc["paths"][path]["post"]["responses"][status]["content"]
    assert content[media]["schema"] == {"$ref": f"#/components/schemas/{schema}"}


REQUEST_SCHEMAS = ["CompletionRequest", "ResponseFormat", "JsonSchemaFormat", "InferRequest", "InferParameters", "InferInputElement",
                   "MediaUrl"]


@pytest.mark.parametrize("name", REQUEST_SCHEMAS)
def test_request_schemas_have_no_untyped_catch_all(doc, name):
    schema = doc["components"]["schemas"][name]
    for path, node in walk(schema["properties"]):
        if path.count("/") == 1:  # a property's own schema
            assert node.get("type") or node.get("anyOf") or node.get("$ref"), (name, path)
        for option in node.get("anyOf", []) if isinstance(node, dict) else []:
            assert option, f"{name}{path}: an empty schema accepts anything"
        if isinstance(node, dict) and "items" in node:
            assert node["items"], f"{name}{path}: untyped items"


def validator(doc: dict, name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


# What the schema cannot say: token counts, the deployment's maxN, the total
# length of the stop strings, media sources and the text-only model's first-element rule.
NOT_EXPRESSIBLE = ("Length of Prompt token", "Inputs token length", "exceeds 'maxN'",
                   "with total <= 32768", "The first element of inputs",
                   "The number of multimodal url", "Invalid json_schema")  # the rules of the user's own schema


def integral_float(value) -> bool:
    """MindIE rejects 5.0 where an integer is due (§0.2); JSON Schema's integer type accepts it."""
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(integral_float(v) for v in value.values())
    if isinstance(value, list):
        return any(integral_float(v) for v in value)
    return False


def cases(module, endpoint):
    """The unit table's JSON bodies whose rule the schema can express."""
    return [pytest.param(endpoint, body, message, id=f"{endpoint}:{message[:60]}")
            for body, message in module.BAD
            if isinstance(body, dict) and not integral_float(body)
            and not any(part in message for part in NOT_EXPRESSIBLE)]


REJECTED = cases(completions_cases, "CompletionRequest") + cases(infer_cases, "InferRequest")


def test_most_rules_are_in_the_schema():
    assert len(REJECTED) > 100


@pytest.mark.parametrize("endpoint, body, message", REJECTED)
def test_the_schema_rejects_what_validation_rejects(doc, endpoint, body, message):
    assert not validator(doc, endpoint).is_valid(body), (body, message)


@pytest.mark.parametrize("endpoint, body", [
    ("CompletionRequest", completions_cases.BASE),
    ("CompletionRequest", dict(completions_cases.BASE, prompt=[1, 2], temperature=0, top_p=1.0, top_k=5, seed=2**64 - 1,
                               stop=["a", "b"], stop_token_ids=[7], include_stop_str_in_output=True, n=2,
                               best_of=3, logprobs=5, max_tokens=2**31 - 1, repetition_penalty=2,
                               presence_penalty=-2, frequency_penalty=2, ignore_eos=False, stream=False,
                               skip_special_tokens=True, response_format={"type": "text"}, unknown=1)),
    ("CompletionRequest", dict(completions_cases.BASE, **dict.fromkeys(completions_accepted.OPTIONAL_FIELDS))),
    ("CompletionRequest", dict(completions_cases.BASE, response_format={"type": "json_object"})),
    ("CompletionRequest", dict(completions_cases.BASE, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {"type": "object"}}})),
    ("InferRequest", infer_cases.BASE),
    ("InferRequest", {"input_id": [0, 1048576]}),
    ("InferRequest", {"inputs": "x", "input_id": None, "stream": None, "parameters": None}),
    ("InferRequest", {"inputs": [{"type": "text", "text": "Hello"}, {"image_url": {"url": "x.png"}}]}),
    ("InferRequest", {"inputs": "x", "parameters": {"temperature": 0.5, "top_k": 10, "top_p": 0.95,
                                                    "max_new_tokens": 20, "do_sample": True, "seed": None,
                                                    "repetition_penalty": 1.03, "details": True, "typical_p": 0.5,
                                                    "watermark": False, "priority": 5, "timeout": 10}}),
])
def test_the_schema_accepts_what_validation_accepts(doc, endpoint, body):
    errors = [e.message for e in validator(doc, endpoint).iter_errors(body)]
    assert not errors, errors
