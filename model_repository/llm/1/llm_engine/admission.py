"""What a request may ask for under the engine's limits: length checks, derived limits, defaults.

:func:`admit` runs when a request is handed to the engine, before it is queued; it raises
:class:`~llm_engine.errors.EnqueueRejected` or :class:`~llm_engine.errors.InvalidParameter`
with MindIE's messages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .errors import EnqueueRejected, InvalidParameter
from .params import SamplingParams
from .sequence import Request
from .structured import grammar_for


@dataclass
class EngineLimits:
    max_seq_len: int
    max_input_len: int
    max_iter_times: int
    max_position_embeddings: int
    truncation: int
    default_top_k: int
    vocab_size: int
    default_temperature: float = 1.0
    kv_blocks: int = 0  # the KV cache's size in blocks of kv_block_size tokens; 0 = unbounded
    kv_block_size: int = 16

    def kv_room(self, prompt_len: int, sequences: int) -> int | None:
        """The most new tokens each of ``sequences`` sequences can hold in the whole KV cache
        after a prompt of ``prompt_len`` tokens (``None`` when unbounded).

        The sequences share the prompt's full blocks and each holds its own copy of the
        partial last one, so a request that fits alone always runs once the others leave:
        it never waits for blocks that do not exist, nor preempts itself for good.
        """
        if not self.kv_blocks:
            return None
        bs = self.kv_block_size
        per_sequence = (self.kv_blocks - prompt_len // bs) // max(1, sequences)
        return per_sequence * bs - prompt_len % bs

    def kv_prompt_cap(self, sequences: int) -> int | None:
        """The longest prompt that leaves each sequence room for one new token."""
        if not self.kv_blocks:
            return None
        return max(0, (self.kv_blocks - max(1, sequences) + 1) * self.kv_block_size - 1)


def fill_defaults(p: SamplingParams, lim: EngineLimits) -> None:
    """Give unset sampling parameters the model's defaults (spec §2.1, §2.2).

    ``top_k``: generation_config.json, then config.json, then 1000; ``temperature``:
    generation_config.json, else 1.0 (both read by :func:`llm_engine.weights.model_limits`).
    """
    if p.top_k is None:
        p.top_k = lim.default_top_k
    if p.temperature is None:
        p.temperature = lim.default_temperature
        if p.num_sequences > 1 and p.greedy and not p.use_beam_search:
            raise InvalidParameter("n/best_of > 1 needs temperature > 0, and the model's default "
                                   f"temperature is {p.temperature}")


def admit(req: Request, lim: EngineLimits) -> None:
    """Check (and, with ``truncation``, cut) the prompt; set ``max_new_tokens``, the seed and defaults."""
    n = len(req.prompt_ids)
    if n == 0:
        raise EnqueueRejected("Failed to enqueue inferRequest. The prompt is empty")
    p = req.params
    cap = min(lim.max_input_len, lim.max_seq_len - 1)
    kv_cap = lim.kv_prompt_cap(p.num_sequences)
    if kv_cap is not None and kv_cap < cap:
        cap = kv_cap  # the KV cache is smaller than maxSeqLen: its size limits the prompt too
    if lim.truncation:
        # MindIE keeps min(maxInputTokenLen, maxSeqLen - 1) tokens and skips L3; this also keeps
        # the prompt and one new token inside the model's positions (the RoPE table ends there)
        keep = min(cap, lim.max_position_embeddings - 1) if lim.max_position_embeddings else cap
        if n > keep:
            req.prompt_ids = req.prompt_ids[:keep] if lim.truncation < 0 else req.prompt_ids[-keep:]
            n = keep
    if lim.max_position_embeddings and n > lim.max_position_embeddings and not lim.truncation:
        raise EnqueueRejected(
            "Failed to enqueue inferRequest. This model's maximum input ids length cannot be greater "
            f"than maxPositionEmbeddings {lim.max_position_embeddings},the input ids length is {n}")
    if n > cap:
        raise EnqueueRejected(
            "Failed to enqueue inferRequest. This model's maximum input ids length cannot be greater "
            f"than {cap},the input ids length is {n}")
    if any(t < 0 or t >= lim.vocab_size for t in req.prompt_ids):
        raise EnqueueRejected("Failed to enqueue inferRequest. Invalid Input Ids")
    room = lim.max_seq_len - n
    if lim.max_position_embeddings:
        room = min(room, lim.max_position_embeddings - n)
    kv_room = lim.kv_room(n, p.num_sequences)
    if kv_room is not None:
        room = min(room, kv_room)
    req.max_new_tokens = max(1, min(p.max_tokens or lim.max_iter_times, lim.max_iter_times, room))
    req.seed = p.seed if p.seed is not None else random.getrandbits(32)
    req.grammar = grammar_for(p.response_format)
    fill_defaults(p, lim)
