"""Which ``llm`` outputs the adapter asks Triton for, and which of them only at a sequence's end."""

from __future__ import annotations

import pytest
from llm_engine.contract import OUTPUT_NAMES

from adapter.protocol.common import GenerationPlan
from adapter.service import FINISH_ONLY, wanted_outputs


@pytest.mark.parametrize("endpoint, sampling, logprobs, extra, absent", [
    ("completions", {}, None, {"batch_size", "queue_wait_us"}, {"index", "logprobs", "token_ids"}),
    ("completions", {"n": 2}, None, {"index", "cumulative_logprob"}, {"logprobs"}),
    ("completions", {"best_of": 3, "n": 1}, None, {"index", "cumulative_logprob"}, set()),
    ("completions", {"use_beam_search": True}, None, {"index", "cumulative_logprob"}, set()),
    ("completions", {"logprobs": 2}, 2, {"logprobs"}, {"index"}),
    ("infer", {}, None, {"token_ids", "seed"}, {"index", "logprobs", "batch_size"}),
])
def test_a_request_asks_triton_only_for_the_outputs_its_answer_uses(endpoint, sampling, logprobs, extra, absent):
    plan = GenerationPlan(endpoint=endpoint, model=None, prompt_text="hi", prompt_ids=None, stream=True,
                          sampling=sampling, logprobs=logprobs)
    names = wanted_outputs(plan)
    assert {"text_output", "finish_reason", "completion_tokens"} | extra <= set(names)
    assert not absent & set(names)
    assert set(names) <= OUTPUT_NAMES and len(names) == len(set(names))


def test_what_a_streamed_token_is_built_from_is_never_left_for_the_finish():
    """The outputs the adapter lets the model send only when a sequence ends: totals and
    per-request values, never the text, ids, index or logprobs a streamed event is built from."""
    assert set(FINISH_ONLY) <= OUTPUT_NAMES
    assert not {"text_output", "token_ids", "index", "logprobs"} & set(FINISH_ONLY)
