"""The sampling_parameters contract: errors name the field."""

import pytest
from llm_engine.errors import InvalidParameter, parse_error
from llm_engine.params import parse_sampling_parameters


@pytest.mark.parametrize("raw, field", [
    ('{"temperature": -1}', "temperature"),
    ('{"top_p": 0}', "top_p"),
    ('{"max_tokens": 0}', "max_tokens"),
    ('{"logprobs": 6}', "logprobs"),
    ('{"n": 2, "best_of": 1, "temperature": 1}', "best_of"),
    ('{"stop": [""]}', "stop"),
    ('{"stop_token_ids": ["a"]}', "stop_token_ids"),
    ('{"ignore_eos": "yes"}', "ignore_eos"),
    ('{"bogus": 1}', "bogus"),
    ('{"n": 2, "temperature": 0}', "temperature"),
    ('not json', "JSON"),
    ('{"temperature": 1' + "0" * 400 + '}', "temperature"),  # beyond any float: not a 500
    ('{"repetition_penalty": 1' + "0" * 400 + '}', "repetition_penalty"),
    ('{"stop": ' + "[" * 100_000 + "]" * 100_000 + '}', "nested too deeply"),
])
def test_errors_name_the_field(raw, field):
    with pytest.raises(InvalidParameter) as exc:
        parse_sampling_parameters(raw)
    assert field in str(exc.value)
    assert parse_error(exc.value.wire()) == (400, str(exc.value))


def test_defaults_and_nulls():
    p = parse_sampling_parameters('{"seed": null, "stop": "x", "n": 2, "temperature": 0.5}')
    assert p.seed is None and p.stop == ["x"] and p.num_sequences == 2
    assert parse_sampling_parameters(None).max_tokens is None


def test_max_n_cap():
    with pytest.raises(InvalidParameter, match="maxN"):
        parse_sampling_parameters('{"n": 5, "temperature": 1}', max_n=4)


def test_the_readme_documents_every_key_with_its_range():
    """The table of sampling_parameters keys is the public contract for direct Triton callers."""
    import re

    from llm_engine.params import _FLOAT_RANGES, _INT_RANGES, SamplingParams

    from tests.conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("`sampling_parameters` keys"):readme.index("| Output | Type | Shape | |")]
    rows = {key: line for line in table.splitlines() if line.startswith("| `")
            for key in re.findall(r"`(\w+)`", line.split("|")[1])}
    assert set(rows) == set(SamplingParams.__dataclass_fields__)

    def lower_bound(name: str) -> tuple[str, float]:
        bracket, value = re.search(r"([\[(])(-?[0-9.e-]+),", rows[name].replace("−", "-")).groups()
        return bracket, float(value)

    for name, (lo, lo_inc, _, _) in _FLOAT_RANGES.items():
        assert lower_bound(name) == ("[" if lo_inc else "(", lo), name
    for name, (lo, _) in _INT_RANGES.items():
        assert lower_bound(name) == ("[", lo), name
