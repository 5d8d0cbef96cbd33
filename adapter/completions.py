"""``POST /v1/completions``: MindIE's OpenAI-style completions, plain and SSE."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from adapter.openapi import request_body, responses
from adapter.protocol.common import GenerationPlan
from adapter.protocol.completions import (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    parse_completion_request,
)
from adapter.service import DeadlineExceeded, Service, json_response, until_disconnect
from adapter.sse import DONE, event
from adapter.triton import Chunk

log = logging.getLogger(__name__)
router = APIRouter()
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def clean(text: str) -> str:
    """Drop ASCII control characters other than \\n, \\r, \\t (MindIE does)."""
    return _CONTROL.sub("", text)


def finish_reason(engine_reason: str) -> str | None:
    if not engine_reason:
        return None
    return "length" if engine_reason == "length" else "stop"


class LogprobBuilder:
    """Builds MindIE's logprobs objects; ``text_offset`` runs on across choices in UTF-8 bytes."""

    def __init__(self) -> None:
        self.offset = 0

    def build(self, entries: list[dict]) -> dict:
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for e in entries:
            out["text_offset"].append(self.offset)
            self.offset += len(e["token"].encode("utf-8"))
            out["token_logprobs"].append(e["logprob"])
            out["tokens"].append(e["token"])
            top = {e["token"]: e["logprob"]}
            for tok, lp in e["top"]:
                top.setdefault(tok, lp)
            out["top_logprobs"].append(top)
        return out


def usage(chunks: list[Chunk], completion_tokens: int) -> dict:
    first = chunks[0]
    longest = max(chunks, key=lambda c: len(c.batch_size))
    return {
        "prompt_tokens": first.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
        "completion_tokens": completion_tokens,
        "total_tokens": first.prompt_tokens + completion_tokens,
        "batch_size": longest.batch_size,
        "queue_wait_time": longest.queue_wait_us,
    }


@router.post("/v1/completions", response_model=CompletionResponse, openapi_extra=request_body(CompletionRequest),
             responses=responses(CompletionStreamResponse, "Each event is `data: ` + one CompletionStreamResponse "
                                 "(one choice) + a blank line; the stream ends with `data: [DONE]`. With beam "
                                 "search, one event holds the whole CompletionResponse."))
async def completions(request: Request):
    svc: Service = request.app.state.service
    plan, req_id = await svc.begin(request, parse_completion_request)
    if plan.stream and not plan.sampling.get("use_beam_search"):
        chunks = await svc.open_stream(request, svc.chunks(req_id, plan, stream=True))
        return svc.sse_response(_stream(svc, plan, req_id, chunks), req_id)
    if plan.stream:  # beam search: a pseudo-stream with one event
        try:
            body = await until_disconnect(request, _collect(svc, plan, req_id, stream=True))
        except DeadlineExceeded as exc:  # a timeout belongs to the stream: MindIE's raw text (spec §1.5)
            return svc.sse_response(_raw(str(exc)), req_id)
        return svc.sse_response(_once(body), req_id)
    return json_response(await until_disconnect(request, _collect(svc, plan, req_id)))


async def _once(body: dict) -> AsyncIterator[bytes]:
    yield event(body)
    yield DONE


async def _raw(text: str) -> AsyncIterator[bytes]:
    yield text.encode()


async def _collect(svc: Service, plan: GenerationPlan, req_id: str, stream: bool = False) -> dict:
    per_index: dict[int, list[Chunk]] = {}
    async for chunk in svc.chunks(req_id, plan, stream=stream):
        per_index.setdefault(chunk.index, []).append(chunk)
    ordered = sorted(per_index.values(), key=lambda cs: cs[-1].cumulative_logprob, reverse=True)
    ordered = ordered[: plan.num_choices]
    lp = LogprobBuilder()
    choices = []
    for i, cs in enumerate(ordered):
        entries = [e for c in cs for e in (c.logprobs or [])]
        choices.append({
            "index": i,
            "text": clean("".join(c.text for c in cs)),
            "logprobs": lp.build(entries) if plan.logprobs is not None else None,
            "stop_reason": None,
            "finish_reason": finish_reason(cs[-1].finish_reason) or "stop",
        })
    all_chunks = [c for cs in ordered for c in cs]
    total = sum(cs[-1].completion_tokens for cs in ordered)
    return {"id": req_id, "object": "text_completion", "created": int(time.time()), "model": plan.model,
            "choices": choices, "usage": usage(all_chunks, total)}


async def _stream(svc: Service, plan: GenerationPlan, req_id: str,
                  chunks: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
    full_text = svc.settings.server.fullTextEnabled
    so_far: dict[int, str] = {}
    lp = LogprobBuilder()
    async for chunk in chunks:
        text = clean(chunk.text)
        so_far[chunk.index] = so_far.get(chunk.index, "") + text
        logprobs = None
        if plan.logprobs is not None:
            logprobs = lp.build((chunk.logprobs or [])[:1])
        choice = {"index": chunk.index, "text": so_far[chunk.index] if full_text else text,
                  "logprobs": logprobs, "stop_reason": None,
                  "finish_reason": finish_reason(chunk.finish_reason)}
        body = {"id": req_id, "object": "text_completion", "created": int(time.time()),
                "model": plan.model, "choices": [choice]}
        if chunk.finish_reason:
            body["usage"] = usage([chunk], chunk.completion_tokens)
        yield event(body)
    yield DONE


