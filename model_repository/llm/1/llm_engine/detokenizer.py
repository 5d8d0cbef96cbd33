"""Incremental detokenization that never splits a multi-byte character.

Decoding a token on its own loses word-initial spaces (SentencePiece) and breaks
characters spread over several byte tokens (CJK, emoji). So each step decodes a
short window twice, from ``prefix_offset`` to ``read_offset`` and to the end, and
emits only the difference, holding it back while it ends in U+FFFD.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        tail = list(prompt_ids[-CONTEXT_TOKENS:])
        # A prompt tail that ends inside a character would shift offsets; start clean then.
        if tail and self._decode(tail).endswith(REPLACEMENT):
            tail = []
        self.ids = tail
        self.prefix_offset = 0
        self.read_offset = len(tail)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip,
                                     clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            new = full[len(prefix) :]
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
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
