"""Prompt length checks and truncation at enqueue (spec §1.3: L3, L4 and ``truncation``)."""

from __future__ import annotations

import pytest
from llm_engine.admission import EngineLimits, admit
from llm_engine.errors import EnqueueRejected
from llm_engine.params import parse_sampling_parameters
from llm_engine.sequence import Request


def limits(**kw) -> EngineLimits:
    base = dict(max_seq_len=2560, max_input_len=2048, max_iter_times=512, max_position_embeddings=8192,
                truncation=0, default_top_k=1000, vocab_size=49152)
    return EngineLimits(**{**base, **kw})


def admitted(n: int, lim: EngineLimits, **params) -> Request:
    req = Request("r", list(range(1, n + 1)), parse_sampling_parameters(params), emit=lambda o: None)
    admit(req, lim)
    return req


def test_without_truncation_the_limits_reject_with_mindie_messages():
    with pytest.raises(EnqueueRejected, match="cannot be greater than 2048,the input ids length is 2049$"):
        admitted(2049, limits())
    with pytest.raises(EnqueueRejected, match="maxPositionEmbeddings 512,the input ids length is 600$"):
        admitted(600, limits(max_position_embeddings=512, max_input_len=4000, max_seq_len=5000))


@pytest.mark.parametrize("truncation, kept", [(-1, (1, 2048)), (1, (3001 - 2048, 3000))])
def test_truncation_keeps_min_of_max_input_len_and_max_seq_len(truncation, kept):
    req = admitted(3000, limits(truncation=truncation), max_tokens=10)
    assert (req.prompt_ids[0], req.prompt_ids[-1], len(req.prompt_ids)) == (*kept, 2048)
    assert req.max_new_tokens == 10


@pytest.mark.parametrize("truncation", [-1, 1])
@pytest.mark.parametrize("n", [600, 5000])
def test_truncation_also_stays_inside_the_models_positions(truncation, n):
    """max_position_embeddings 512 under maxInputTokenLen 4000: the prompt is cut to 511 so that
    it and a new token have positions (beyond them the RoPE table ends)."""
    lim = limits(max_position_embeddings=512, max_input_len=4000, max_seq_len=5000, truncation=truncation)
    req = admitted(n, lim, max_tokens=10)
    assert len(req.prompt_ids) == 511 and req.max_new_tokens == 1
    assert req.prompt_ids[0] == (1 if truncation < 0 else n - 510)


def test_a_prompt_within_the_limits_is_kept_whole():
    req = admitted(100, limits(truncation=-1, max_position_embeddings=512), max_tokens=1000)
    assert len(req.prompt_ids) == 100 and req.max_new_tokens == 512 - 100
