"""Sampling defaults from the checkpoint (spec §2.1, §2.2): what ``model_limits`` reads, and how
the engine fills a request's unset ``top_k`` and ``temperature`` in."""

from __future__ import annotations

import json

import pytest
from llm_engine.admission import EngineLimits, admit, fill_defaults
from llm_engine.errors import EnqueueRejected, InvalidParameter
from llm_engine.params import parse_sampling_parameters
from llm_engine.sequence import Request
from llm_engine.weights import model_limits


def checkpoint(tmp_path, config: dict, generation: dict | None = None):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "max_position_embeddings": 64, **config}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


@pytest.mark.parametrize("config, generation, top_k", [
    ({"top_k": 50}, {"top_k": 40}, 40),  # generation_config.json wins
    ({"top_k": 50}, {"temperature": 0.7}, 50),  # then config.json
    ({"top_k": 50}, None, 50),
    ({"top_k": 50}, {"top_k": None}, 50),  # null is unset
    ({}, {"top_k": 0}, 1000),  # 0 is unset too
    ({}, {}, 1000),  # then 1000
    ({}, None, 1000),
])
def test_top_k_default_order(tmp_path, config, generation, top_k):
    assert model_limits(checkpoint(tmp_path, config, generation))["default_top_k"] == top_k


@pytest.mark.parametrize("generation, temperature", [
    ({"temperature": 0.6}, 0.6),
    ({"temperature": 0}, 0.0),
    ({"temperature": None}, 1.0),
    ({"temperature": "hot"}, 1.0),
    ({"temperature": -1}, 1.0),
    ({}, 1.0),
    (None, 1.0),
])
def test_temperature_default_comes_from_generation_config(tmp_path, generation, temperature):
    assert model_limits(checkpoint(tmp_path, {"temperature": 0.1}, generation))["default_temperature"] == temperature


def test_the_default_model_has_no_sampling_defaults(model_dir):
    """SmolLM2's GGUF carries none, so MindIE's fallbacks apply (environment.md)."""
    limits = model_limits(model_dir)
    assert (limits["default_top_k"], limits["default_temperature"]) == (1000, 1.0)


def limits(**kw) -> EngineLimits:
    base = dict(max_seq_len=2560, max_input_len=2048, max_iter_times=512, max_position_embeddings=8192,
                truncation=0, default_top_k=1000, vocab_size=49152)
    return EngineLimits(**{**base, **kw})


def test_unset_parameters_get_the_model_defaults():
    p = parse_sampling_parameters("{}")
    assert (p.temperature, p.top_k) == (None, None)  # "unset" reaches the engine
    fill_defaults(p, limits(default_top_k=40, default_temperature=0.6))
    assert (p.temperature, p.top_k) == (0.6, 40)
    assert not p.greedy


def test_request_values_win_over_the_model_defaults():
    p = parse_sampling_parameters('{"temperature": 0, "top_k": 5}')
    fill_defaults(p, limits(default_top_k=40, default_temperature=0.6))
    assert (p.temperature, p.top_k) == (0, 5) and p.greedy


def test_a_greedy_default_with_several_sequences_is_rejected():
    p = parse_sampling_parameters('{"n": 2}')  # accepted: the default temperature is not known yet
    with pytest.raises(InvalidParameter, match="temperature"):
        fill_defaults(p, limits(default_temperature=0.0))
    fill_defaults(parse_sampling_parameters('{"n": 2}'), limits())  # 1.0: fine


def _request(n_prompt: int, **params) -> Request:
    return Request("r", list(range(1, n_prompt + 1)), parse_sampling_parameters(params), lambda out: None)


def test_a_small_kv_cache_caps_new_tokens_so_a_request_always_fits_alone():
    lim = limits(kv_blocks=8, kv_block_size=16)  # 128 tokens in all
    req = _request(50, max_tokens=500)
    admit(req, lim)
    assert req.max_new_tokens == 128 - 50
    # two sequences share the prompt's 3 full blocks and each needs its own partial one
    req = _request(50, max_tokens=500, n=2, temperature=1.0)
    admit(req, lim)
    assert req.max_new_tokens == (8 - 3) // 2 * 16 - 2
    assert 3 + 2 * -(-(2 + req.max_new_tokens) // 16) <= 8


def test_a_prompt_larger_than_the_kv_cache_is_rejected_at_once():
    lim = limits(kv_blocks=8, kv_block_size=16)
    admit(_request(127), lim)  # one new token still fits
    with pytest.raises(EnqueueRejected, match="cannot be greater than 127,the input ids length is 128"):
        admit(_request(128), lim)
    with pytest.raises(EnqueueRejected, match="cannot be greater than 111,"):
        admit(_request(120, n=2, temperature=1.0), lim)


def test_a_kv_cache_larger_than_max_seq_len_changes_nothing():
    req = _request(50, max_tokens=5000)
    admit(req, limits(kv_blocks=10_000, kv_block_size=16))
    assert req.max_new_tokens == 512
