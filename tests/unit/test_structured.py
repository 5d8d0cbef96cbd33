"""Structured output (``response_format``): grammar building, mask unpacking, and the real engine
producing JSON that parses and follows its schema, alone and beside unconstrained requests."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from llm_engine.errors import InvalidParameter
from llm_engine.params import parse_sampling_parameters
from llm_engine.structured import GrammarMatchers, accept, constrain, grammar_for, unpack_bits

from tests.unit.engine_harness import Run, build

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 200}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
PROMPT = "Describe a person as JSON:"


def follows_person(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 20
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 200
    return obj


# -- grammar and mask, no model ------------------------------------------------------------

def test_text_and_absent_formats_have_no_grammar():
    assert grammar_for(None) is None
    assert grammar_for({"type": "text"}) is None
    assert grammar_for({"type": "json_object"})
    assert grammar_for(PERSON_FORMAT)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "xml"}, "response_format"),
    ("json_object", "response_format"),
    ({"type": "json_schema"}, "json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}, "frob"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}, "nope"),
])
def test_bad_formats_are_rejected_naming_the_problem(fmt, words):
    with pytest.raises(InvalidParameter, match="response_format") as err:
        parse_sampling_parameters({"response_format": fmt})
    assert words in str(err.value)


def test_unpack_bits_maps_bit_b_of_word_w_to_token_32w_plus_b():
    words = np.zeros((2, 3), dtype="<i4")  # llguidance's layout: little-endian 32-bit words
    words[0, 0] = 1 << 5
    words[0, 2] = 1 << 1  # token 65
    words[1, 1] = -(2**31)  # the sign bit: token 63
    allowed = unpack_bits(words.view(np.uint8), 70)
    assert allowed.shape == (2, 70)
    assert allowed[0].nonzero().flatten().tolist() == [5, 65]
    assert allowed[1].nonzero().flatten().tolist() == [63]


class ErrsWhileMasking:
    """A matcher that hits a limit while computing its mask: llguidance then allows only EOS."""

    def __init__(self):
        self.failed = False

    def is_error(self):
        return self.failed

    def compute_bitmask(self):
        self.failed = True
        return bytes([0b100] + [0] * 15)  # token 2 only

    def consume_token(self, token):
        return False

    def get_error(self):
        return "lexer error: too many expressions constructed"


def test_a_matcher_failing_while_masking_fails_its_request_instead_of_stopping_it():
    seq = types.SimpleNamespace(matcher=ErrsWhileMasking())
    free = types.SimpleNamespace(matcher=None)
    logits = torch.zeros(2, 128)
    constrain(logits, [free, seq])
    assert torch.isfinite(logits).all()  # unmasked, not EOS-only
    with pytest.raises(ValueError, match="too many expressions"):
        accept(seq, 5)


def test_a_tokenizer_llguidance_cannot_read_refuses_structured_requests_quickly():
    matchers = GrammarMatchers(object(), 128, [2])
    grammar = grammar_for({"type": "json_object"})
    for _ in range(2):  # the failure is remembered, not retried per request
        with pytest.raises(InvalidParameter, match="not available with this model's tokenizer"):
            matchers.matcher(grammar)
    assert matchers.matcher(None) is None


# -- the real engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    eng = build()
    yield eng
    eng.stop()


def test_json_object_is_a_whole_object_and_ends_with_stop(engine):
    run = Run(engine, PROMPT, temperature=0, max_tokens=120, response_format={"type": "json_object"}).wait()
    final = run.finals()[0]
    assert final.finish_reason == "stop", run.text()
    assert isinstance(json.loads(run.text()), dict)


def test_json_schema_is_followed_under_sampling_and_beside_free_requests(engine):
    free = [Run(engine, PROMPT, temperature=0, max_tokens=30, ignore_eos=True) for _ in range(2)]
    runs = [Run(engine, PROMPT, temperature=1.0, seed=s, max_tokens=120, response_format=PERSON_FORMAT)
            for s in range(4)]
    for run in runs:
        run.wait()
        assert run.finals()[0].finish_reason == "stop", run.text()
        follows_person(run.text())
        assert run.text().startswith('{"name":')  # the schema's order, not alphabetical
    alone = Run(engine, PROMPT, temperature=0, max_tokens=30, ignore_eos=True).wait()
    for run in free:  # the masks touch only the constrained rows
        assert run.wait().text() == alone.text()


def test_streamed_pieces_join_to_the_same_json_and_seeds_repeat(engine):
    a = Run(engine, PROMPT, temperature=0.8, seed=7, max_tokens=120, response_format=PERSON_FORMAT).wait()
    b = Run(engine, PROMPT, stream=False, temperature=0.8, seed=7, max_tokens=120,
            response_format=PERSON_FORMAT).wait()
    assert len([o for o in a.outputs if o.text]) > 1
    assert a.text() == b.text()
    follows_person(a.text())


def test_n_and_best_of_each_follow_the_schema(engine):
    run = Run(engine, PROMPT, temperature=1.0, seed=3, n=2, best_of=3, max_tokens=120,
              response_format=PERSON_FORMAT).wait()
    finals = run.finals()
    assert len(finals) == 3
    for index in finals:
        follows_person(run.text(index))


def test_beam_search_follows_the_schema(engine):
    run = Run(engine, PROMPT, use_beam_search=True, n=2, stream=False, max_tokens=120,
              response_format=PERSON_FORMAT).wait()
    assert run.error is None
    finals = run.finals()
    assert len(finals) == 2
    for out in finals.values():
        assert out.finish_reason == "stop"
        follows_person(out.text)


def test_max_tokens_cuts_the_json_with_length(engine):
    run = Run(engine, PROMPT, temperature=0, max_tokens=3, response_format=PERSON_FORMAT).wait()
    assert run.finals()[0].finish_reason == "length"
    assert run.text().startswith("{")


def test_logprobs_are_those_of_the_constrained_distribution(engine):
    run = Run(engine, PROMPT, temperature=0, max_tokens=120, logprobs=3, stream=False,
              response_format=PERSON_FORMAT).wait()
    entries = run.outputs[-1].logprobs
    follows_person(run.text())
    # only one token ('{"') may start this object: it has all the mass, and the masked
    # alternatives are left out rather than reported at -inf (not valid JSON)
    assert entries[0]["token"] == '{"'
    assert entries[0]["logprob"] == pytest.approx(0.0, abs=1e-5)
    assert [t for t, _ in entries[0]["top"]] == ['{"']
    assert all(lp > float("-inf") for e in entries for _, lp in e["top"])


def test_beam_logprobs_leave_masked_alternatives_out(engine):
    run = Run(engine, PROMPT, use_beam_search=True, n=2, stream=False, max_tokens=120, logprobs=3,
              response_format=PERSON_FORMAT).wait()
    for out in run.finals().values():
        assert [t for t, _ in out.logprobs[0]["top"]] == ['{"']
        assert all(lp > float("-inf") for e in out.logprobs for _, lp in e["top"])


def test_a_failing_beam_step_ends_only_its_request_and_frees_its_forks(monkeypatch):
    import llm_engine.beam_steps as beam_steps

    real = beam_steps.accept
    calls = {"n": 0}

    def flaky(seq, token):
        calls["n"] += 1
        if calls["n"] > 6 and seq.index > 0:  # a fork's token, after this step's forks were made
            raise ValueError("boom")
        return real(seq, token)

    eng = build(kvCacheBlocks=64, cacheBlockSize=2, enablePrefixCache=False)
    try:
        monkeypatch.setattr(beam_steps, "accept", flaky)
        failed = Run(eng, PROMPT, use_beam_search=True, n=3, stream=False, max_tokens=120,
                     response_format=PERSON_FORMAT).wait()
        monkeypatch.undo()
        assert failed.error is not None and "boom" in str(failed.error)
        assert eng.blocks.num_free == 64
        after = Run(eng, PROMPT, temperature=0, max_tokens=5).wait()
        assert after.error is None and after.finals()[0].finish_reason == "length"
    finally:
        eng.stop()


def test_beam_search_ends_a_whole_json_with_stop_even_with_ignore_eos(engine):
    run = Run(engine, PROMPT, use_beam_search=True, n=2, stream=False, max_tokens=100, ignore_eos=True,
              skip_special_tokens=False, response_format=PERSON_FORMAT).wait()
    for out in run.finals().values():
        assert out.finish_reason == "stop" and out.completion_tokens < 100
        follows_person(out.text)  # no EOS text after it
        assert out.completion_tokens == len(out.token_ids)
