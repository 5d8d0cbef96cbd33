"""Turning a scheduler plan into the runner's flat tensors (ids, positions, KV slots, attention groups)."""

from __future__ import annotations

import torch

from .runner import PrefillBatch, StepInput
from .scheduler import Plan
from .sequence import Sequence

# Chunks of prompts up to this long share one padded attention call; chunks of longer
# prompts are attended one by one. The choice depends on the prompt's length, not the
# chunk's, so a prompt position always takes the same attention path: a prefix-cache hit
# gives the same numbers as a miss (bf16, tested), and so does a short prompt split by the
# token budget. A long prompt split by the budget differs in the last bits, since each
# piece attends over a different number of keys.
SHORT_PREFILL_TOKENS = 128


def build_step_input(plan: Plan, bs: int, dev: torch.device, dummy_slot: int) -> tuple[StepInput, list[Sequence]]:
    """Flatten a plan into the runner's tensors; return them and the sequences owning each logits row."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_seqs: list[Sequence] = []
    prefills = []
    short: list[tuple[int, int, int, Sequence]] = []
    logit_rows: list[int] = []
    owners: list[Sequence] = []
    for it in plan.items:
        seq, start, n = it.seq, it.seq.num_computed, it.num_tokens
        row = len(ids)
        ids.extend(seq.token_ids[start : start + n])
        table = seq.table.blocks
        for p in range(start, start + n):
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        if n == 1 and start >= seq.prompt_len:  # a generated token, not the last of a cached prompt
            decode_rows.append(row)
            decode_seqs.append(seq)
        elif max(seq.prompt_len, start + n) <= SHORT_PREFILL_TOKENS:
            short.append((row, n, start + n, seq))
        else:
            ctx = None
            if start > 0:
                ctx = context_slots([seq], start + n, bs, dev)[0]
            prefills.append((row, n, start + n, ctx))
        if it.needs_logits:
            logit_rows.append(row + n - 1)
            owners.append(seq)
    if decode_seqs:
        lens = [len(s.token_ids) for s in decode_seqs]
        ctx = context_slots(decode_seqs, max(lens), bs, dev)
        lens_t = torch.tensor(lens, device=dev)
        mask = torch.arange(ctx.shape[1], device=dev)[None, :] < lens_t[:, None]
        ctx = torch.where(mask, ctx, dummy_slot)
        mask = mask[:, None, None, :]
    else:
        ctx = torch.empty(0, 0, dtype=torch.long, device=dev)
        mask = torch.empty(0, 1, 1, 0, dtype=torch.bool, device=dev)
        lens_t = torch.empty(0, dtype=torch.long, device=dev)
    as_t = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
    return StepInput(as_t(ids), as_t(pos), as_t(slots), as_t(decode_rows), ctx, mask, prefills,
                     as_t(logit_rows), short_prefills(short, bs, dev, dummy_slot), lens_t), owners

def short_prefills(short: list[tuple[int, int, int, Sequence]], bs: int, dev: torch.device,
                   dummy_slot: int) -> PrefillBatch | None:
    """Pad short prefill chunks into one attention call (one SDPA per layer, not one each)."""
    if not short:
        return None
    lq = max(n for _, n, _, _ in short)
    lk = max(ctx for _, _, ctx, _ in short)
    rows = torch.tensor([r for r, _, _, _ in short], device=dev)
    ns = torch.tensor([n for _, n, _, _ in short], device=dev)
    ctxs = torch.tensor([c for _, _, c, _ in short], device=dev)
    qi = torch.arange(lq, device=dev)
    q_valid = qi[None, :] < ns[:, None]  # [P, Lq]
    q_index = torch.where(q_valid, rows[:, None] + qi[None, :], rows[:, None]).reshape(-1)
    kj = torch.arange(lk, device=dev)
    k_valid = kj[None, :] < ctxs[:, None]  # [P, Lk]
    kv = context_slots([s for _, _, _, s in short], lk, bs, dev)
    kv = torch.where(k_valid, kv, dummy_slot).reshape(-1)
    offset = (ctxs - ns)[:, None, None]
    mask = (kj[None, None, :] <= offset + qi[None, :, None]) & k_valid[:, None, :]
    mask[:, :, 0] |= ~q_valid  # padded queries attend somewhere, so no row is all -inf
    q_seq = torch.arange(len(short), device=dev)[:, None].expand(-1, lq)[q_valid]
    q_lens = (offset[:, 0] + qi[None, :] + 1)[q_valid]
    q_valid = q_valid.reshape(-1)
    return PrefillBatch(q_index, q_valid, q_index[q_valid], kv, mask[:, None], (len(short), lq, lk), q_seq, q_lens)

def context_slots(seqs: list[Sequence], length: int, bs: int, dev: torch.device) -> torch.Tensor:
    """Slot ids of positions ``0..length-1`` for each sequence, ``[B, length]``."""
    nb = -(-length // bs)
    table = torch.tensor([s.table.blocks[:nb] + [0] * (nb - len(s.table.blocks[:nb])) for s in seqs],
                         dtype=torch.long, device=dev)
    slots = table[:, :, None] * bs + torch.arange(bs, device=dev)[None, None, :]
    return slots.reshape(len(seqs), nb * bs)[:, :length]
