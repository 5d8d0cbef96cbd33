"""Batched sampling with per-row settings: penalties, temperature, top-k, top-p, seeds, logprobs.

Every control is applied to the whole batch with tensor ops. Only the final draw
loops over the sampled rows, because each row owns a ``torch.Generator`` so that a
seeded request gives the same text whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")
FLOAT32_MAX = 3.4028234663852886e38  # logits are float32: larger values become inf, and inf NaN
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def alternatives(ids: list[int], values: list[float]) -> list[tuple[int, float]]:
    """``(token, logprob)`` pairs, best first, less those a grammar masked out (``-inf`` is
    not valid JSON, and no token there could have been chosen)."""
    return [(t, v) for t, v in zip(ids, values) if v != NEG_INF]


@dataclass
class RowSpec:
    """Sampling settings of one logits row."""

    temperature: float
    top_k: int  # 0 or >= vocab: disabled
    top_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    generator: torch.Generator | None  # None: greedy
    logprobs: int | None
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]  # chosen token's logprob (after penalties, before temperature)
    top: list[list[tuple[int, float]] | None]  # top alternatives for rows that asked


def apply_penalties(logits: torch.Tensor, rows: list[RowSpec]) -> None:
    """Repetition (prompt + output, HF style) and presence/frequency (output, OpenAI style)."""
    idx = [i for i, r in enumerate(rows)
           if r.repetition_penalty != 1.0 or r.presence_penalty or r.frequency_penalty]
    if not idx:
        return
    vocab = logits.shape[1]
    dev = logits.device
    for i in idx:  # rare: only rows that asked for penalties
        r = rows[i]
        out = torch.tensor(r.output_ids, dtype=torch.long, device=dev)
        counts = torch.zeros(vocab, device=dev).index_add_(0, out, torch.ones_like(out, dtype=torch.float))
        if r.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            seen[torch.tensor(r.prompt_ids + r.output_ids, dtype=torch.long, device=dev)] = True
            row = logits[i]
            penalty = min(max(r.repetition_penalty, FLOAT32_TINY), FLOAT32_MAX)  # any value > 0 is valid
            penalised = torch.where(row > 0, (row / penalty).clamp(max=FLOAT32_MAX), row * penalty)
            logits[i] = torch.where(seen, penalised, row)
        logits[i] -= r.frequency_penalty * counts + r.presence_penalty * (counts > 0).float()


RowStats = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def sample(logits: torch.Tensor, rows: list[RowSpec], row_stats: RowStats | None = None) -> SampleResult:
    """Pick one token per row of ``logits`` ``[R, V]`` (float32).

    A logprob is a logit less its row's logsumexp. ``row_stats(logits)``, where given (the
    fused CPU kernel), returns each row's first argmax and logsumexp in one pass without a
    ``[R, V]`` result; otherwise one ``log_softmax`` gives every logprob at once.
    """
    apply_penalties(logits, rows)
    if row_stats is not None:
        tokens, lse = row_stats(logits)
        scores, offset = logits, lse[:, None]
    else:
        scores = torch.log_softmax(logits, dim=-1)  # one pass; cheaper than logsumexp + subtract
        tokens, offset = greedy_tokens(scores), None
    sampled = [i for i, r in enumerate(rows) if r.generator is not None]
    if sampled:
        tokens[sampled] = _draw(logits[sampled], [rows[i] for i in sampled]).to(tokens.device)
    chosen = scores.gather(1, tokens[:, None])
    chosen = (chosen if offset is None else chosen - offset)[:, 0].tolist()
    top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.logprobs]
    if want:
        k = max(rows[i].logprobs for i in want)
        vals, ids = torch.topk(scores[want], k, dim=-1)
        vals = (vals if offset is None else vals - offset[want]).tolist()
        ids = ids.tolist()
        for j, i in enumerate(want):
            n = rows[i].logprobs
            top[i] = alternatives(ids[j][:n], vals[j][:n])
    return SampleResult(tokens.tolist(), chosen, top)


def greedy_tokens(scores: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``torch.argmax(scores, dim=-1)`` (first index of each row's maximum), by blocks.

    On CPU, ``argmax`` over a 49k vocabulary runs at ~1 GB/s (2.5 ms for 32 rows), while
    ``amax`` is vectorized (0.1 ms). So: each block's maximum, the first block holding the
    row's maximum, then ``argmax`` inside that block only. Same result, ties included.
    """
    rows, vocab = scores.shape
    blocks = vocab // chunk
    if blocks < 2:
        return torch.argmax(scores, dim=-1)
    head = scores[:, : blocks * chunk].view(rows, blocks, chunk)
    block_max = head.amax(dim=-1)  # [R, blocks]
    best = torch.argmax(block_max, dim=-1)  # first block with the maximum
    inside = head[torch.arange(rows, device=scores.device), best]  # [R, chunk]
    tokens = best * chunk + torch.argmax(inside, dim=-1)
    if blocks * chunk < vocab:  # the tail wins only if strictly larger (earlier index wins ties)
        tail_max, tail_arg = scores[:, blocks * chunk :].max(dim=-1)
        head_max = block_max.gather(1, best[:, None])[:, 0]
        tokens = torch.where(tail_max > head_max, blocks * chunk + tail_arg, tokens)
    return tokens


def _draw(logits: torch.Tensor, rows: list[RowSpec]) -> torch.Tensor:
    vocab = logits.shape[1]
    dev = logits.device
    temps = torch.tensor([min(r.temperature, FLOAT32_MAX) for r in rows], device=dev)  # inf would make NaN
    ks = [r.top_k if 0 < r.top_k < vocab else vocab for r in rows]
    k_max = max(ks)
    scaled = logits / temps[:, None]
    if k_max < vocab:
        vals, ids = torch.topk(scaled, k_max, dim=-1)
    else:
        vals, ids = torch.sort(scaled, dim=-1, descending=True)
    col = torch.arange(vals.shape[1], device=dev)[None, :]
    vals = vals.masked_fill(col >= torch.tensor(ks, device=dev)[:, None], float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    top_p = torch.tensor([r.top_p for r in rows], device=dev)
    if bool((top_p < 1.0).any()):
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each candidate
        probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    # One uniform draw per row from the row's own generator, then inverse-CDF lookup:
    # the result does not depend on how many candidates other rows needed.
    u = torch.cat([torch.rand(1, generator=r.generator, device=dev) for r in rows])
    cdf = torch.cumsum(probs, dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    picks = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)[:, 0]
    return ids.gather(1, picks[:, None])[:, 0]
