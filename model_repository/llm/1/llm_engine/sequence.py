"""Per-request and per-sequence state.

A :class:`Request` owns one or more :class:`Sequence` objects (``n``/``best_of`` or
beams) that share its prompt. Everything the scheduler and the output path need
about a sequence lives here, so nothing else keeps loose per-request dicts.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .detokenizer import IncrementalDetokenizer
from .kv_cache import BlockTable
from .params import SamplingParams
from .stopping import StopChecker

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class StepOutput:
    """One response of one sequence, handed to the request's ``emit`` callback."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "" while running
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cumulative_logprob: float
    seed: int
    batch_size: list[int]
    queue_wait_us: list[int]
    logprobs: list[dict] | None
    final: bool  # the request's last response
    first_token_time: float = 0.0  # time.monotonic() when the sequence's first token was sampled


@dataclass(eq=False)  # identity semantics: sequences are compared with `is`/`in`
class Sequence:
    request: Request
    index: int
    token_ids: list[int]  # prompt + generated
    detok: IncrementalDetokenizer
    stopper: StopChecker
    generator: Optional[torch.Generator]
    matcher: Optional[Any] = None  # an llguidance matcher when the request has a response_format
    seq_id: int = field(default_factory=lambda: next(_ids))
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose KV is in the cache
    # readmitted after preemption beside its request's first sequence: its first tokens' blocks are
    # that sequence's, and it waits until that one has computed them (Scheduler._admit)
    prefix_of: Optional[Sequence] = None
    share_until: int = 0  # ... and the first one computes only up to here until they have started
    status: Status = Status.WAITING
    finish_reason: str = ""
    reported: bool = False  # its finishing output has been emitted
    cumulative_logprob: float = 0.0
    first_token_time: float = 0.0  # time.monotonic() when its first token was sampled
    text: str = ""  # text emitted so far
    pending_text: str = ""  # not yet sent (non-stream mode, or between sends)
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[dict] = field(default_factory=list)
    pending_lens: list[int] = field(default_factory=list)  # each pending step's decoded text length
    token_logprobs: list[float] = field(default_factory=list)  # beam search keeps its own history
    token_tops: list[list] = field(default_factory=list)  # beam search: each token's top alternatives

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.token_ids) - 1 or self.num_computed == 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(eq=False)
class Request:
    """A request as the engine sees it; created by the model from Triton tensors."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[StepOutput], None]
    is_cancelled: Callable[[], bool] = lambda: False
    stream: bool = True
    arrival: float = field(default_factory=time.monotonic)
    seed: int = 0
    max_new_tokens: int = 0
    cached_tokens: int = 0
    sequences: list[Sequence] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    queue_waits_us: list[int] = field(default_factory=list)
    last_progress: float = 0.0  # when its last token was produced
    first_scheduled: float = 0.0
    scheduled_since: float = 0.0  # start of the first step that ran it since its last token (0: none)
    done: bool = False
    hypotheses: list = field(default_factory=list)  # finished beams (beam search only)
    grammar: Optional[str] = None  # the response_format's grammar (structured.grammar_for)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def deadline(self) -> float | None:
        return self.arrival + self.params.timeout if self.params.timeout else None

    def note_scheduled(self, step_start: float) -> None:
        """A step that runs this request starts (a prefill chunk, a decode, a recompute)."""
        if not self.first_scheduled:
            self.first_scheduled = step_start
        if not self.scheduled_since:
            self.scheduled_since = step_start

    def record_token_step(self, batch_size: int, now: float) -> None:
        """Usage of a step that produced this request's next token: one entry per generated
        token (seed A: "the array length is the number of tokens"), so a prompt prefilled in
        chunks or a preempted request's recompute adds none of its own. The entry is the
        step's batch size (requests) and the wait from the request's arrival or previous
        token to the first step that worked towards this one, in µs."""
        start = self.scheduled_since or now
        self.batch_sizes.append(batch_size)
        self.queue_waits_us.append(int(max(0.0, start - (self.last_progress or self.arrival)) * 1e6))
        self.scheduled_since = 0.0
        self.last_progress = now

    def live_sequences(self) -> list[Sequence]:
        return [s for s in self.sequences if not s.finished]
