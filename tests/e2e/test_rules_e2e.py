"""Every validation rule of both endpoints through the real stack, table-driven from the unit
tests' case tables: 422, MindIE's envelope, the exact message, which names the field, and the
next (good) request succeeds."""

from __future__ import annotations

import json

import pytest

from tests.unit import test_protocol_completions as completions_cases
from tests.unit import test_protocol_infer as infer_cases

pytestmark = pytest.mark.e2e

# The unit tables run with a word-splitting stand-in tokenizer: the token-count rule (L2)
# depends on it, so those rows are left to the unit tests (test_stream_start.py covers the
# real tokenizer's limits at enqueue).
TOKENIZER_DEPENDENT = ("Length of Prompt token", "Inputs token length")
# MindIE's own wording that names no single field (spec §2.5, §3.3).
NAMES_NO_FIELD = ("Failed to parse request context to json", "Input conflict.",
                  "The input type of 'str' is invalid", "The number of multimodal url")
GOOD = {"/v1/completions": {"model": completions_cases.MODEL, "prompt": "Hi", "max_tokens": 1},
        "/infer": {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}}


def keys(value) -> set[str]:
    """Every key in a body, nested ones included: the fields the bad value can be in."""
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in keys(v)}
    return set()


def offending(body, base: dict) -> set[str]:
    if not isinstance(body, dict):
        return set()
    changed = {k: v for k, v in body.items() if base.get(k, object()) != v or k not in base}
    missing = set(base) - set(body)
    return keys(changed) | missing


def table(path: str, rows, base: dict):
    return [pytest.param(path, body, message, offending(body, base), id=f"{path}:{i}:{message[:50]}")
            for i, (body, message) in enumerate(rows) if not message.startswith(TOKENIZER_DEPENDENT)]


CASES = (table("/v1/completions", completions_cases.BAD + completions_cases.COMBINATIONS + completions_cases.ORDER,
               completions_cases.BASE)
         + table("/infer", infer_cases.BAD + infer_cases.ORDER, infer_cases.BASE))


def test_the_table_covers_every_rule():
    assert len(CASES) > 200


@pytest.mark.parametrize("path, body, message, fields", CASES)
def test_rule_through_the_stack_then_a_good_request(client, path, body, message, fields):
    raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.content.startswith(b'{"error":') and list(r.json()) == ["error", "error_type"]
    assert r.json() == {"error": message, "error_type": "Input Validation Error"}
    if not message.startswith(NAMES_NO_FIELD):
        named = [f for f in fields if f.lower() in message.lower()]
        assert named, f"{message!r} names none of {sorted(fields)}"
    assert client.post(path, json=GOOD[path]).status_code == 200
