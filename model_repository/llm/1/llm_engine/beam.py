"""Beam search: choosing the next beams from the live beams' log-probabilities.

Pure selection logic; the engine owns the sequences and their KV blocks. Scores are
cumulative log-probabilities, for live beams and finished hypotheses alike: the
request gets "the beams with the highest cumulative log-probability, best first"
(spec §2.3 R2), with no length normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampler import NEG_INF


@dataclass
class Hypothesis:
    output_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float
    finish_reason: str
    top: list = field(default_factory=list)
    text_ends_before_last: bool = True  # with "stop": its last id is the stop token, not text (a whole
    # JSON under response_format stops on its last character instead)


@dataclass
class Candidate:
    parent: int  # index into the live beams
    token: int
    logprob: float
    score: float  # parent's cumulative logprob + logprob


def select(logprobs: torch.Tensor, cumulative: list[float], width: int, stop_ids: set[int]
           ) -> tuple[list[Candidate], list[Candidate]]:
    """Return ``(next live beams, candidates that end on a stop token)``, best first.

    ``logprobs`` is ``[live beams, vocab]``; at most ``width`` live beams are kept and
    only stop candidates that rank above the last kept beam are returned. Tokens at ``-inf``
    (masked by a grammar) are never chosen, so fewer than ``width`` beams may go on.
    """
    k = min(2 * width, logprobs.shape[1])
    scores = logprobs + torch.tensor(cumulative, dtype=logprobs.dtype, device=logprobs.device)[:, None]
    flat_scores, flat_idx = torch.topk(scores.reshape(-1), min(k * logprobs.shape[0], scores.numel()))
    vocab = logprobs.shape[1]
    live: list[Candidate] = []
    ended: list[Candidate] = []
    for score, idx in zip(flat_scores.tolist(), flat_idx.tolist()):
        if score == NEG_INF:
            break  # masked out (structured output), as is everything after it
        parent, token = divmod(idx, vocab)
        cand = Candidate(parent, token, float(logprobs[parent, token]), score)
        if token in stop_ids:
            ended.append(cand)
        else:
            live.append(cand)
            if len(live) == width:
                break
    return live, ended


def ranked(finished: list[Hypothesis], width: int) -> list[Hypothesis]:
    """The ``width`` finished hypotheses with the highest cumulative log-probability, best first."""
    return sorted(finished, key=lambda h: h.cumulative_logprob, reverse=True)[:width]


def is_done(finished: list[Hypothesis], live_best_cumulative: float, width: int) -> bool:
    """Stop once ``width`` hypotheses are finished and no live beam can still beat the worst
    of them: a beam's cumulative log-probability only falls as it grows."""
    if len(finished) < width:
        return False
    return live_best_cumulative <= ranked(finished, width)[-1].cumulative_logprob
