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


def _split_inside_character(tokenizer, text):
    """Token ids of ``text`` and a cut that falls between two byte tokens of one character."""
    ids = tokenizer(text).input_ids
    for cut in range(1, len(ids)):
        if tokenizer.decode(ids[:cut]).endswith("\ufffd"):
            return ids, cut
    pytest.skip(f"{text!r} has no byte-level split")


@pytest.mark.parametrize("text", ["你好，世界", "ok 🎉🚀 done"])
def test_prompt_ending_inside_a_character(tokenizer, text):
    """A prompt of ``input_ids`` can end inside a character; the completion that finishes it
    gives that character, with no U+FFFD, and the rest follows as usual."""
    ids, cut = _split_inside_character(tokenizer, text)
    d = IncrementalDetokenizer(tokenizer, ids[:cut])
    out = "".join(d.step(t) for t in ids[cut:]) + d.flush()
    assert "\ufffd" not in out
    done = tokenizer.decode(ids[:cut]).rstrip("\ufffd")  # the prompt's complete characters
    assert done + out == text


def test_prompt_ending_inside_a_character_that_is_never_finished(tokenizer):
    """When the completion does not finish the prompt's character, the prompt's broken
    bytes are not the completion's text: it starts with what it generated."""
    ids, cut = _split_inside_character(tokenizer, "你好")
    more = tokenizer(" and then").input_ids
    d = IncrementalDetokenizer(tokenizer, ids[:cut])
    out = "".join(d.step(t) for t in more) + d.flush()
    assert out == " and then"
