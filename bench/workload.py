"""The workload every system runs: varied ~15-token prompts, greedy, fixed output length."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

_SUBJECTS = ("a lighthouse keeper", "an old robot", "a young baker", "a lost cat", "a retired pilot",
             "a curious child", "a tired doctor", "a street musician")
_TASKS = ("Write a short story about", "Describe a day in the life of", "Write a poem about",
          "Explain the daily routine of")
_PLACES = ("on a quiet island.", "in a busy city.", "in the mountains.", "near the sea.")


def make_prompts(n: int) -> list[str]:
    """``n`` distinct English prompts of roughly 15 tokens, the same list on every call."""
    combos = itertools.product(_TASKS, _SUBJECTS, _PLACES)
    out = [f"{task} {who} who lives {where}" for task, who, where in combos]
    if n > len(out):
        out = [f"{p} (variant {i // len(out)})" for i, p in enumerate(itertools.islice(itertools.cycle(out), n))]
    # interleave so that neighbouring prompts differ in their first words too
    return sorted(out[:n], key=lambda p: hash_text(p))


def hash_text(text: str) -> int:
    """A stable (non-randomised) hash, so prompt order is the same in every process."""
    h = 2166136261
    for ch in text.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h


@dataclass(frozen=True)
class Workload:
    max_tokens: int = 64
    concurrencies: tuple[int, ...] = (1, 8, 32)
    rounds: int = 2  # closed loop: each of the c clients sends this many requests in turn
    repeats: int = 2  # the requests of a level are run in this many parts, systems taking turns (bench.load.drive)
    min_requests: int = 8  # at low concurrency, more rounds so that percentiles have samples
    staggered: tuple[int, ...] = (8,)  # also run these with clients starting apart (bench.load.staggered)
    peer_batch: int = 32  # prompts in the static-batch and continuous-batching peers
    naive_requests: int = 4  # sequential requests for the one-at-a-time peers
    quick: bool = False

    def prompts_for(self, concurrency: int) -> list[str]:
        return make_prompts(max(concurrency * self.rounds, self.min_requests))


FULL = Workload()
QUICK = Workload(max_tokens=8, concurrencies=(1, 4), rounds=1, repeats=1, min_requests=2, staggered=(4,),
                 peer_batch=4, naive_requests=2, quick=True)
