"""Stop conditions: EOS and stop token ids, and stop strings matched across token boundaries.

Stop strings are matched literally (``str.find``), never as patterns. Text that
could be the start of a stop string is held back, so a stream never shows a
partial stop string that later matches.
"""

from __future__ import annotations

PRECISE_HOLD_LIMIT = 64  # longer stop strings hold back len-1 characters outright


class StopChecker:
    def __init__(self, stop: list[str], stop_token_ids: list[int], eos_token_ids: list[int],
                 ignore_eos: bool, include_stop_str_in_output: bool):
        self.stop = [s for s in stop if s]
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
        if not self.stop:
            return text, False
        self.buffer += text
        best = -1
        best_stop = ""
        for s in self.stop:
            pos = self.buffer.find(s)
            if pos != -1 and (best == -1 or pos < best):
                best, best_stop = pos, s
        if best != -1:
            end = best + len(best_stop) if self.include else best
            out = self.buffer[:end]
            self.buffer = ""
            return out, True
        hold = self._hold_back()
        cut = len(self.buffer) - hold
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False

    def _hold_back(self) -> int:
        hold = 0
        buf = self.buffer
        for s in self.stop:
            if len(s) > PRECISE_HOLD_LIMIT:
                hold = max(hold, min(len(s) - 1, len(buf)))
                continue
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        return hold

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out
