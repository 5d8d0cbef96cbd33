"""Schemathesis against the adapter's OpenAPI document: no 5xx for bodies the schema admits
(positive) or violates (negative), and every 4xx in MindIE's error envelope."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.conftest import MODEL_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
EXAMPLES = 40  # per path and mode: about 20 s each on two cores


@pytest.mark.parametrize("path", ["/v1/completions", "/infer"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors(stack, path, mode):
    schema = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    op = schema[path]["POST"]
    strategy = op.as_strategy(generation_mode=getattr(schemathesis.GenerationMode, mode.upper()))
    failures, statuses = [], []

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(case=strategy)
    def run(case):
        if isinstance(case.body, dict):
            case.body.setdefault("model", MODEL_NAME)
            # keep generations short so the fuzz run stays quick
            if path == "/v1/completions":
                case.body["max_tokens"] = 2
            elif isinstance(case.body.get("parameters"), dict):
                case.body["parameters"]["max_new_tokens"] = 2
        response = case.call(timeout=60)
        statuses.append(response.status_code)
        if response.status_code >= 500:
            failures.append((case.body, response.status_code, response.text[:200]))
        elif response.status_code >= 400 and response.status_code != 413:
            body = response.json()
            assert list(body) == ["error", "error_type"], body

    run()
    assert not failures, failures[:3]
    assert len(statuses) >= EXAMPLES // 2, statuses  # cases were generated and sent
    if mode == "negative":
        assert statuses.count(422) >= len(statuses) // 2, statuses  # schema violations are rejected
