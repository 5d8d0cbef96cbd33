"""Stop conditions: EOS and stop token ids, and stop strings matched across token boundaries.

Stop strings are matched literally, never as patterns. Text that could be the start
of a stop string is held back, so a stream never shows a partial stop string that
later matches.

The API sets no limit on the number of stop strings, only on their total length
(32768 characters), so the work per token must not grow with their number: the
strings are indexed once per request (:class:`StopStrings`) by length, and for the
hold-back by their prefixes (short strings) or their first character (long ones).
"""

from __future__ import annotations

from functools import lru_cache

PREFIX_INDEX_LIMIT = 64  # the prefixes of stop strings up to this long are indexed; longer ones are scanned


class StopStrings:
    """A request's stop strings, indexed for matching at the end of growing text."""

    def __init__(self, stop: tuple[str, ...]):
        self.strings = tuple(dict.fromkeys(s for s in stop if s))  # unique, in the request's order
        self.rank = {s: i for i, s in enumerate(self.strings)}  # equal starts: the earlier string wins
        by_length: dict[int, set[str]] = {}
        for s in self.strings:
            by_length.setdefault(len(s), set()).add(s)
        self.by_length = sorted(by_length.items())
        short = [s for s in self.strings if len(s) <= PREFIX_INDEX_LIMIT]
        self.prefixes = {s[:n] for s in short for n in range(1, len(s))}  # proper prefixes
        self.longest_prefix = max((len(p) for p in self.prefixes), default=0)
        self.long_by_first: dict[str, list[str]] = {}  # at most 32768 / 65 of them
        for s in self.strings:
            if len(s) > PREFIX_INDEX_LIMIT:
                self.long_by_first.setdefault(s[0], []).append(s)
        self.longest = max(map(len, self.strings), default=0)

    def earliest_match(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The match that starts first among those that end after ``text[:new_from]``
        (``None`` if there is none). The text before ``new_from`` was searched already."""
        best: tuple[int, int, str] | None = None  # (start, rank, string)
        for end in range(max(new_from, 0) + 1, len(text) + 1):
            for length, strings in self.by_length:
                if length > end:
                    break
                candidate = text[end - length:end]
                if candidate in strings:
                    key = (end - length, self.rank[candidate], candidate)
                    if best is None or key < best:
                        best = key
        return None if best is None else (best[0], best[2])

    def hold_back(self, text: str) -> int:
        """How many characters at the end of ``text`` could begin a stop string: the longest
        end of ``text`` that is a proper prefix of one."""
        for start in range(max(0, len(text) - self.longest + 1), len(text)):  # longest first
            n = len(text) - start
            if n <= self.longest_prefix and text[start:] in self.prefixes:
                return n
            for s in self.long_by_first.get(text[start], ()):
                if n < len(s) and s.startswith(text[start:]):
                    return n
        return 0


@lru_cache(maxsize=8)  # a request's n sequences (and its forks) share one index
def stop_strings(stop: tuple[str, ...]) -> StopStrings:
    return StopStrings(stop)


class StopChecker:
    def __init__(self, stop: list[str], stop_token_ids: list[int], eos_token_ids: list[int],
                 ignore_eos: bool, include_stop_str_in_output: bool):
        self.strings = stop_strings(tuple(stop)) if any(stop) else None
        self.stop_ids = set(stop_token_ids)
        self.eos_ids = set() if ignore_eos else set(eos_token_ids)
        self.include = include_stop_str_in_output
        self.buffer = ""

    @property
    def holding(self) -> bool:
        """Is text held back, as the possible start of a stop string?"""
        return bool(self.buffer)

    def is_stop_token(self, token_id: int) -> bool:
        return token_id in self.stop_ids or token_id in self.eos_ids

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return ``(text safe to emit, matched a stop string)``."""
        if self.strings is None:
            return text, False
        searched = len(self.buffer)  # held text never contains a whole stop string
        self.buffer += text
        match = self.strings.earliest_match(self.buffer, searched)
        if match is not None:
            start, stop = match
            out = self.buffer[:start + len(stop) if self.include else start]
            self.buffer = ""
            return out, True
        cut = len(self.buffer) - self.strings.hold_back(self.buffer)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out
