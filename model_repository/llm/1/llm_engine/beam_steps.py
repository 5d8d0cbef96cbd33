"""Beam-search requests in the engine's step: score the live beams, fork, retire and emit.

The pure selection rules are in :mod:`.beam`; this module owns what beams do to the
engine's sequences and KV blocks (a fork shares the parent's blocks copy-on-write).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from . import beam as beam_search
from . import contract
from .errors import EngineError
from .outputs import logprob_entry
from .sampler import alternatives
from .sequence import Request, Sequence, Status, StepOutput
from .structured import accept

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)


class BeamSteps:
    def __init__(self, engine: Engine):
        self.engine = engine

    def advance(self, seqs: list[Sequence], logprobs: torch.Tensor) -> None:
        """One step for every beam-search request: ``logprobs`` has a row per live beam."""
        by_req: dict[int, list[int]] = {}
        for row, seq in enumerate(seqs):
            by_req.setdefault(id(seq.request), []).append(row)
        for rows in by_req.values():
            req = seqs[rows[0]].request
            if req.done:
                continue
            try:
                self._step(req, [seqs[r] for r in rows], logprobs[rows])
            except Exception as exc:  # a bug in one request's beams ends only that request
                log.exception("beam search step of request %s failed", req.request_id)
                self.engine._fail(req, EngineError(f"generation failed: {exc}"))

    def _step(self, req: Request, beams: list[Sequence], logprobs: torch.Tensor) -> None:
        width = req.params.n
        for beam in beams:
            self.engine.blocks.register_prompt_blocks(beam.table, beam.token_ids,
                                                      min(beam.num_computed, req.prompt_len))
        stop_ids = beams[0].stopper.stop_ids | beams[0].stopper.eos_ids
        live, ended = beam_search.select(logprobs, [b.cumulative_logprob for b in beams], width, stop_ids)
        tops = _alternatives(logprobs, req.params.logprobs or 0)
        for c in ended:
            parent = beams[c.parent]
            req.hypotheses.append(beam_search.Hypothesis(
                parent.output_ids + [c.token], parent.token_logprobs + [c.logprob], c.score,
                contract.FINISH_STOP, top=parent.token_tops + [tops[c.parent]]))
        targets: list[Sequence] = []
        used: set[int] = set()
        for c in live:  # fork every extra child before any parent takes its own token
            parent = beams[c.parent]
            if id(parent) in used:
                targets.append(self._fork(parent))
            else:
                used.add(id(parent))
                targets.append(parent)
        for beam in beams:
            if id(beam) not in used:
                self._retire(beam)
        # the forks join the request now, so that its removal frees their blocks whatever follows
        req.sequences = [s for s in req.sequences if not s.finished] + [t for t in targets
                                                                          if t not in req.sequences]
        for seq, c in zip(targets, live):
            whole = seq.matcher is not None and accept(seq, c.token)  # the JSON is complete
            seq.token_ids.append(c.token)
            seq.token_logprobs.append(c.logprob)
            seq.token_tops.append(tops[c.parent])
            seq.cumulative_logprob = c.score
            if whole:  # a finished hypothesis now, as on EOS, also with ignore_eos or at max_tokens
                req.hypotheses.append(beam_search.Hypothesis(
                    seq.output_ids, list(seq.token_logprobs), c.score, contract.FINISH_STOP,
                    top=list(seq.token_tops), text_ends_before_last=False))
                self._retire(seq)
        targets = [t for t in targets if not t.finished]
        out_of_room = bool(targets) and targets[0].num_generated >= req.max_new_tokens
        best = max((t.cumulative_logprob for t in targets), default=float("-inf"))
        if out_of_room or not targets or beam_search.is_done(req.hypotheses, best, width):
            if out_of_room or len(req.hypotheses) < width:
                for t in targets:
                    req.hypotheses.append(beam_search.Hypothesis(
                        t.output_ids, t.token_logprobs, t.cumulative_logprob, contract.FINISH_LENGTH,
                        top=list(t.token_tops)))
            for t in targets:
                self._retire(t)
            self._emit(req)

    def finish(self, req: Request, reason: str) -> None:
        """End a beam search early (cancelled or stopped): the live beams join the finished
        hypotheses, ending with ``reason``, and the best ``n`` go out as for a search that
        ran to its end, each with its text so far."""
        for beam in req.sequences:
            if not beam.finished:
                req.hypotheses.append(beam_search.Hypothesis(
                    beam.output_ids, list(beam.token_logprobs), beam.cumulative_logprob, reason,
                    top=list(beam.token_tops), text_ends_before_last=False))
                self._retire(beam)
        self._emit(req)

    def _fork(self, parent: Sequence) -> Sequence:
        req = parent.request
        child = self.engine._new_sequence(req, len(req.sequences), list(parent.token_ids), parent=parent)
        child.table = self.engine.blocks.fork(parent.table)
        child.num_computed = parent.num_computed
        child.status = Status.RUNNING
        child.cumulative_logprob = parent.cumulative_logprob
        child.token_logprobs = list(parent.token_logprobs)
        child.token_tops = list(parent.token_tops)
        return child

    def _retire(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        seq.reported = True
        self.engine.scheduler.release_sequence(seq)

    def _emit(self, req: Request) -> None:
        ranked = beam_search.ranked(req.hypotheses, req.params.n)
        self.engine.scheduler.remove(req)
        req.done = True
        skip = req.params.skip_special_tokens
        outputs = []
        for i, h in enumerate(ranked):
            ids = h.output_ids
            text_ids = ids[:-1] if h.finish_reason == contract.FINISH_STOP and h.text_ends_before_last else ids
            entries = None
            if req.params.logprobs is not None:
                tops = h.top or [[] for _ in ids]
                entries = [logprob_entry(self.engine.token_text, t, lp, top, skip)
                           for t, lp, top in zip(ids, h.logprobs, tops)]
            outputs.append(StepOutput(
                index=i, text=self.engine.tokenizer.decode(text_ids, skip_special_tokens=skip), token_ids=list(ids),
                finish_reason=h.finish_reason, prompt_tokens=req.prompt_len, cached_tokens=req.cached_tokens,
                completion_tokens=len(ids), cumulative_logprob=h.cumulative_logprob, seed=req.seed,
                batch_size=list(req.batch_sizes), queue_wait_us=list(req.queue_waits_us), logprobs=entries,
                final=i == len(ranked) - 1))
        for out in outputs:
            req.emit(out)


def _alternatives(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each beam's ``k`` most likely next tokens and their logprobs, best first (empty lists
    when ``k`` is 0): the ``top_logprobs`` of the token its children take at this position."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = torch.topk(logprobs.float(), min(k, logprobs.shape[-1]), dim=-1)
    return [alternatives(row_ids, row_values) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
