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


def step_output(seq: Sequence, finishing: bool, empty: bool = False, later_steps: int = 0) -> StepOutput:
    """What ``seq`` produced since its last output (all of its per-step records when it is
    finishing); the pending text, ids and logprobs are handed over and cleared.
    ``later_steps``: steps after this one that :func:`step_outputs` reports separately."""
    req = seq.request
    if finishing:
        batch, waits = list(req.batch_sizes), list(req.queue_waits_us)
    else:
        at = len(req.batch_sizes) - 1 - later_steps
        batch, waits = req.batch_sizes[at:at + 1], req.queue_waits_us[at:at + 1]
    out = StepOutput(
        index=seq.index, text="" if empty else seq.pending_text,
        token_ids=[] if empty else list(seq.pending_ids),
        finish_reason=seq.finish_reason if finishing else "",
        prompt_tokens=req.prompt_len, cached_tokens=req.cached_tokens,
        completion_tokens=seq.num_generated - later_steps, cumulative_logprob=seq.cumulative_logprob,
        seed=req.seed, batch_size=batch, queue_wait_us=waits,
        logprobs=list(seq.pending_logprobs) if req.params.logprobs is not None else None,
        final=False, first_token_time=seq.first_token_time,
    )
    seq.text += seq.pending_text
    seq.pending_text, seq.pending_ids, seq.pending_logprobs, seq.pending_lens = "", [], [], []
    seq.reported = finishing
    return out


def step_outputs(seq: Sequence, finishing: bool) -> list[StepOutput]:
    """Stream mode: one output per step since the last. Steps held back while a stop string
    could still match go out together once it is ruled out (or matched), each with its own
    token, logprob and text (spec §2.7.1: "released as separate events")."""
    steps = len(seq.pending_ids)
    if steps <= 1 or len(seq.pending_lens) != steps:
        return [step_output(seq, finishing)]
    texts = split_text(seq.pending_text, seq.pending_lens)
    ids, logprobs = seq.pending_ids, seq.pending_logprobs
    outputs = []
    for i in range(steps):
        seq.pending_text, seq.pending_ids, seq.pending_logprobs = texts[i], ids[i:i + 1], logprobs[i:i + 1]
        last = i == steps - 1
        outputs.append(step_output(seq, finishing and last, later_steps=steps - 1 - i))
    return outputs


def split_text(text: str, lengths: list[int]) -> list[str]:
    """``text`` cut into pieces of ``lengths`` in turn: a stop string's cut shortens the last
    pieces, and what the end adds (an unfinished character, flushed) goes to the last one."""
    pieces, pos = [], 0
    for n in lengths:
        pieces.append(text[pos:pos + n])
        pos += n
    pieces[-1] += text[pos:]
    return pieces
