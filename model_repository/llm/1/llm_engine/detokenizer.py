"""Incremental detokenization that never splits a multi-byte character.

Decoding a token on its own loses word-initial spaces (SentencePiece) and breaks
characters spread over several byte tokens (CJK, emoji). So each step decodes a
short window twice, from ``prefix_offset`` to ``read_offset`` and to the end, and
emits only the difference, holding it back while it ends in U+FFFD.

A prompt given as token ids can end inside a character. Its first completed text is
then taken against the prompt's decoded tail up to where they differ: a generated
byte that finishes the character yields that character, and the prompt's broken
bytes never show as U+FFFD in the completion.
"""

from __future__ import annotations

import os.path

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        tail = list(prompt_ids[-CONTEXT_TOKENS:])
        self.ids = tail
        self.prefix_offset = 0
        self.read_offset = len(tail)
        tail_text = self._decode(tail) if tail else ""
        # The prompt's text when it ends inside a character, until the first text is emitted.
        self._unfinished_prompt = tail_text if tail_text.endswith(REPLACEMENT) else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip,
                                     clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        full = self._decode(self.ids[self.prefix_offset :])
        start = self._start_of_new_text(full)
        if len(full) > start and not full.endswith(REPLACEMENT):
            new = full[start:]
            self._unfinished_prompt = None
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            # keep the window short so each step stays cheap
            if self.prefix_offset > 64:
                self.ids = self.ids[self.prefix_offset :]
                self.read_offset -= self.prefix_offset
                self.prefix_offset = 0
            return new
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD)."""
        full = self._decode(self.ids[self.prefix_offset :])
        start = self._start_of_new_text(full)
        self.prefix_offset = self.read_offset = len(self.ids)
        self._unfinished_prompt = None
        return full[start:]

    def _start_of_new_text(self, full: str) -> int:
        """Where the text not yet emitted starts in ``full`` (the decoded window)."""
        if self._unfinished_prompt is not None:  # the prompt's broken bytes are not emitted
            return len(os.path.commonprefix([self._unfinished_prompt, full]))
        return len(self._decode(self.ids[self.prefix_offset : self.read_offset]))
