"""``POST /infer``: MindIE's TGI-like text and SSE inference."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from adapter.completions import clean
from adapter.openapi import request_body, responses
from adapter.protocol.common import GenerationPlan
from adapter.protocol.infer import InferRequest, InferResponse, InferStreamEvent, parse_infer_request
from adapter.service import Service, json_response, until_disconnect
from adapter.sse import event
from adapter.triton import Chunk

log = logging.getLogger(__name__)
router = APIRouter()


def finish_reason(engine_reason: str) -> str:
    """Spec §2.8. Engine failures never get here: they arrive as errors, not finish reasons."""
    return {"stop": "eos_token", "length": "length", "cancelled": "stop_sequence"}.get(engine_reason,
                                                                                      "invalid flag")


def details(plan: GenerationPlan, reason: str, tokens: int, seed: int) -> dict | None:
    if not plan.details:
        return None
    return {"finish_reason": finish_reason(reason), "generated_tokens": tokens, "seed": seed}


@router.post("/infer", response_model=InferResponse, openapi_extra=request_body(InferRequest),
             responses=responses(InferStreamEvent, "Each event is `data: ` + one InferStreamEvent + a blank "
                                 "line; the last one carries generated_text, and there is no `[DONE]`."))
@router.post("/infer_token", include_in_schema=False)  # MindIE registers the same handler under both paths
async def infer(request: Request):
    svc: Service = request.app.state.service
    plan, req_id = await svc.begin(request, parse_infer_request)
    timeout = plan.sampling.get("timeout")
    if plan.stream:
        start = time.monotonic()  # prefill_time counts from the enqueue
        chunks = await svc.open_stream(request, svc.chunks(req_id, plan, stream=True, client_timeout=timeout))
        return svc.sse_response(_stream(svc, plan, chunks, start), req_id)
    return json_response(await until_disconnect(request, _collect(svc, plan, req_id, timeout)))


async def _collect(svc: Service, plan: GenerationPlan, req_id: str, timeout: float | None) -> dict:
    text, last = "", None
    async for chunk in svc.chunks(req_id, plan, stream=False, client_timeout=timeout):
        text += chunk.text
        last = chunk
    body = {"generated_text": clean(text)}
    if plan.details and last is not None:
        body["details"] = details(plan, last.finish_reason, last.completion_tokens, last.seed)
    return body


async def _stream(svc: Service, plan: GenerationPlan, chunks: AsyncIterator[Chunk],
                  start: float) -> AsyncIterator[bytes]:
    full_text = svc.settings.server.fullTextEnabled
    prev = start
    generated = ""
    first = True
    async for chunk in chunks:
        now = time.monotonic()
        if first:
            timing = {"prefill_time": round((now - start) * 1000, 3), "decode_time": None}
        else:
            timing = {"prefill_time": None, "decode_time": round((now - prev) * 1000, 3)}
        prev = now
        first = False
        text = clean(chunk.text)
        generated += text
        if chunk.final:
            body = dict(timing)
            body["generated_text"] = generated
            body["details"] = details(plan, chunk.finish_reason, chunk.completion_tokens, chunk.seed)
            body["token"] = {"id": chunk.token_ids, "text": None}
            yield event(body)
            return
        body = dict(timing, token={"id": chunk.token_ids, "text": generated if full_text else text})
        yield event(body)
