"""Incremental detokenization against the real tokenizer: CJK, emoji, spaces."""

import pytest
from llm_engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello world, how are you?", "你好，世界！今天天气很好。", "emoji 🎉🚀 test 👍🏽 done",
         "  leading spaces and\ttabs\nnew lines", "naïve café résumé"]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_concatenates_to_full_decode(tokenizer, text):
    ids = tokenizer(text).input_ids
    d = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    pieces = [d.step(t) for t in ids]
    pieces.append(d.flush())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_word_initial_space_after_prompt(tokenizer):
    prompt = tokenizer("The cat").input_ids
    ids = tokenizer(" sat on the mat").input_ids
    d = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(d.step(t) for t in ids) + d.flush() == " sat on the mat"


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    d = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert d.step(eos) == ""
    d2 = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert d2.step(eos) == tokenizer.decode([eos])
