"""Iteration-level scheduling: who runs in the next step, and how many tokens each computes.

Each step first gives every running sequence its next decode token, then spends
the rest of the token budget (``maxPrefillTokens``) on prefill: unfinished prompt
chunks first, then newcomers in (priority, arrival) order. A long prompt is split
into chunks, so it never stalls the decodes of everyone else: while any sequence
decodes, a step carries at most ``prefillChunkTokens`` prompt tokens. When the KV cache
runs out, the least urgent, most recent request is preempted: its blocks are
freed and it goes back to the queue to be recomputed later.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass

from .errors import Overloaded
from .kv_cache import BlockManager, OutOfBlocks
from .sequence import Request, Sequence, Status

log = logging.getLogger(__name__)


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int

    @property
    def needs_logits(self) -> bool:
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


@dataclass
class Plan:
    items: list[Scheduled]
    copies: list[tuple[int, int]]

    @property
    def num_sequences(self) -> int:
        return len(self.items)

    @property
    def num_requests(self) -> int:
        """Requests in the step: MindIE's per-token ``batch_size`` (a request's sequences count once)."""
        return len({id(it.seq.request) for it in self.items})


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, max_prefill_batch_size: int,
                 max_prefill_tokens: int, max_waiting: int, prefill_chunk_tokens: int = 0):
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.max_prefill_batch_size = max_prefill_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        # prompt tokens a step may carry while other sequences decode (0: up to max_prefill_tokens)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_waiting = max_waiting
        self._order = itertools.count()
        self.waiting: list[tuple[int, float, int, Request]] = []  # heap
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue -----------------------------------------------------------------
    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise Overloaded(f"the engine queue is full ({self.max_waiting} waiting requests)")
        heapq.heappush(self.waiting, (req.priority, req.arrival, next(self._order), req))

    def requests(self) -> list[Request]:
        return self.running + [w[3] for w in self.waiting]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def remove(self, req: Request) -> None:
        """Forget ``req`` (finished, cancelled or failed) and free its KV blocks."""
        if req in self.running:
            self.running.remove(req)
        else:
            kept = [w for w in self.waiting if w[3] is not req]
            if len(kept) != len(self.waiting):
                self.waiting = kept
                heapq.heapify(self.waiting)
        for seq in req.sequences:
            self.blocks.release(seq.table)

    def release_sequence(self, seq: Sequence) -> None:
        self.blocks.release(seq.table)

    # -- planning --------------------------------------------------------------
    def schedule(self) -> Plan:
        items: list[Scheduled] = []
        copies: list[tuple[int, int]] = []
        budget = self.max_prefill_tokens
        prefills = 0
        running = sorted(self.running, key=lambda r: (r.priority, r.arrival))
        decoding = self.prefill_chunk_tokens and any(
            len(seq.token_ids) - seq.num_computed == 1 for req in running for seq in req.live_sequences())
        chunk = self.prefill_chunk_tokens if decoding else budget  # prompt tokens this step may carry
        for req in running:
            if req not in self.running:  # preempted while making room for a more urgent one
                continue
            for seq in req.live_sequences():
                if self._waits_for_prefix(seq):
                    continue
                todo = len(seq.token_ids) - seq.num_computed
                if todo == 1:
                    if not self._reserve(seq, len(seq.token_ids), copies, items):
                        break
                    items.append(Scheduled(seq, 1))
                    budget -= 1
                elif todo > 1 and min(budget, chunk) > 0 and prefills < self.max_prefill_batch_size:
                    items.append(Scheduled(seq, min(self._prefill_todo(seq), budget, chunk)))
                    budget -= items[-1].num_tokens
                    chunk -= items[-1].num_tokens
                    prefills += 1
        while self.waiting and min(budget, chunk) > 0 and prefills < self.max_prefill_batch_size:
            req = self.waiting[0][3]
            live = req.live_sequences()
            if len(items) + len(live) > self.max_batch_size:
                break
            if not self._admit(req):
                break
            heapq.heappop(self.waiting)
            self.running.append(req)
            for seq in live:
                if min(budget, chunk) <= 0 or prefills >= self.max_prefill_batch_size:
                    break
                if self._waits_for_prefix(seq):
                    continue
                items.append(Scheduled(seq, min(self._prefill_todo(seq), budget, chunk)))
                budget -= items[-1].num_tokens
                chunk -= items[-1].num_tokens
                prefills += 1
        return Plan(items, copies)

    @staticmethod
    def _waits_for_prefix(seq: Sequence) -> bool:
        """Is ``seq`` readmitted beside its request's first sequence, which has not yet computed
        the prompt blocks they share?"""
        if seq.prefix_of is None:
            return False
        if seq.prefix_of.num_computed < seq.num_computed:
            return True
        seq.prefix_of = None
        return False

    @staticmethod
    def _prefill_todo(seq: Sequence) -> int:
        """Tokens ``seq`` has left to prefill; a first sequence that others wait on stops at the
        end of the blocks they share, so that all of a request's sequences reach their logits in
        the same step (beam search scores its beams together)."""
        if seq.share_until > seq.num_computed:
            return seq.share_until - seq.num_computed
        return len(seq.token_ids) - seq.num_computed

    def _admit(self, req: Request) -> bool:
        """Give every live sequence of ``req`` blocks for its tokens, using the prefix cache.

        The sequences of a request readmitted after preemption (n/best_of, beams) share the
        prompt's full blocks, as they did when the prompt was computed once: the first one
        computes them, the others hold their own blocks only for the rest and wait for it.
        Without the sharing such a request could need more blocks than the cache has (its
        ``max_new_tokens`` was sized on the sharing, admission.py) and would block the queue.
        """
        live = req.live_sequences()
        lead, others = live[0], live[1:]
        # whole prompt blocks, short of every sequence's last token (so none is copied on write)
        shared = min(req.prompt_len, *(len(s.token_ids) - 1 for s in live)) // self.blocks.block_size
        need = self.blocks.blocks_needed(len(lead.token_ids)) + sum(
            self.blocks.blocks_needed(len(s.token_ids)) - shared for s in others)
        if need > self.blocks.num_free + self._reusable_hint(lead):
            return False
        done: list[Sequence] = []
        try:
            cached = self.blocks.allocate_prompt(lead.table, lead.token_ids)
            lead.num_computed = cached
            done.append(lead)
            if req.first_scheduled == 0.0:
                req.cached_tokens = min(cached, req.prompt_len)
            lead.share_until = shared * self.blocks.block_size if others else 0
            for seq in others:
                done.append(seq)
                seq.table = self.blocks.share_prefix(lead.table, shared)
                self.blocks.ensure_slots(seq.table, len(seq.token_ids))
                seq.num_computed = shared * self.blocks.block_size
                seq.prefix_of = lead if shared else None
        except OutOfBlocks:
            for seq in done:
                self.blocks.release(seq.table)
                seq.num_computed = 0
                seq.prefix_of, seq.share_until = None, 0
            return False
        for seq in live:
            seq.status = Status.RUNNING
        return True

    def _reusable_hint(self, seq: Sequence) -> int:
        # Cached prefix blocks may sit in the free list; allocate_prompt decides exactly.
        return self.blocks.blocks_needed(len(seq.token_ids)) if self.blocks.enable_prefix_cache else 0

    def _reserve(self, seq: Sequence, num_tokens: int, copies: list, items: list[Scheduled]) -> bool:
        """Make room for ``seq``'s next token, preempting less urgent requests if needed."""
        while True:
            try:
                copies.extend(self.blocks.ensure_slots(seq.table, num_tokens))
                return True
            except OutOfBlocks:
                victim = self._victim()
                if victim is None or victim is seq.request:
                    if victim is seq.request:
                        self._preempt(victim, items)
                    return False
                self._preempt(victim, items)

    def _victim(self) -> Request | None:
        if not self.running:
            return None
        return max(self.running, key=lambda r: (r.priority, r.arrival))

    def _preempt(self, req: Request, items: list[Scheduled]) -> None:
        log.info("preempting request %s (KV cache full); it will be recomputed", req.request_id)
        self.num_preemptions += 1
        self.running.remove(req)
        items[:] = [it for it in items if it.seq.request is not req]
        for seq in req.sequences:
            self.blocks.release(seq.table)
            seq.num_computed = 0
            seq.prefix_of, seq.share_until = None, 0
            if not seq.finished:
                seq.status = Status.WAITING
        heapq.heappush(self.waiting, (req.priority, req.arrival, next(self._order), req))
