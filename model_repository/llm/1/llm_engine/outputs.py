"""What a step reports for a sequence: its :class:`StepOutput` and its logprob entries."""

from __future__ import annotations

from .sequence import Sequence, StepOutput


class TokenTexts:
    """One token decoded on its own, as logprobs report it; cached, since each sampled token
    asks for 1 + top-k of them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[tuple[int, bool], str] = {}

    def __call__(self, token: int, skip_special_tokens: bool = False) -> str:
        key = (token, skip_special_tokens)
        text = self._texts.get(key)
        if text is None:
            text = self._texts[key] = self.tokenizer.decode([token], skip_special_tokens=skip_special_tokens)
        return text


def logprob_entry(texts: TokenTexts, token: int, logprob: float, top, skip_special_tokens: bool) -> dict:
    """The chosen token's text and logprob, and its top alternatives as ``[text, logprob]``."""
    return {"token": texts(token, skip_special_tokens), "logprob": logprob,
            "top": [[texts(tid), lp] for tid, lp in top or []]}


def step_output(seq: Sequence, finishing: bool, empty: bool = False) -> StepOutput:
    """What ``seq`` produced since its last output (all of its per-step records when it is
    finishing); the pending text, ids and logprobs are handed over and cleared."""
    req = seq.request
    if finishing:
        batch, waits = list(req.batch_sizes), list(req.queue_waits_us)
    else:
        batch, waits = req.batch_sizes[-1:], req.queue_waits_us[-1:]
    out = StepOutput(
        index=seq.index, text="" if empty else seq.pending_text,
        token_ids=[] if empty else list(seq.pending_ids),
        finish_reason=seq.finish_reason if finishing else "",
        prompt_tokens=req.prompt_len, cached_tokens=req.cached_tokens,
        completion_tokens=seq.num_generated, cumulative_logprob=seq.cumulative_logprob,
        seed=req.seed, batch_size=batch, queue_wait_us=waits,
        logprobs=list(seq.pending_logprobs) if req.params.logprobs is not None else None,
        final=False, first_token_time=seq.first_token_time,
    )
    seq.text += seq.pending_text
    seq.pending_text, seq.pending_ids, seq.pending_logprobs = "", [], []
    seq.reported = finishing
    return out
