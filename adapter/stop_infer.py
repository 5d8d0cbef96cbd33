"""``POST /v2/models/{model}/stopInfer``: MindIE's stop of running requests by their id.

The body is ``{"id": "<request id>"}``: the id MindIE gives a request (its ``req-id``
header, else ``endpoint_common_<n>``). Every request with that id that this adapter is
running (each generation has a Triton request id of its own, ``<id>#<n>``, which the stop
names) ends as if stopped by the engine, with what it generated so far
(``finish_reason`` ``stop`` on ``/v1/completions``, ``stop_sequence`` on ``/infer``);
the answer is 200 with the body echoed, or 404 ``RequestId is {id} not found.``
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from adapter.errors import not_found_error, validation_error
from adapter.protocol.common import parse_body
from adapter.service import Service, to_mindie
from adapter.sse import compact
from adapter.triton import TritonError

router = APIRouter(include_in_schema=False)


@router.post("/v2/models/{model}/stopInfer")
async def stop_infer(model: str, request: Request):
    svc: Service = request.app.state.service
    if model != svc.model_name:
        raise not_found_error(f"Model {model} not found.")
    body = parse_body(await request.body())
    request_id = body.get("id")
    if not isinstance(request_id, str) or not request_id:
        raise validation_error("Parameter id must be a non-empty string")
    generations = sorted(svc.running.get(request_id, ()))
    if not generations:
        raise not_found_error(f"RequestId is {request_id} not found.")
    try:
        for triton_id in generations:
            await svc.triton.stop(triton_id)
    except TritonError as exc:
        raise to_mindie(exc) from None
    return Response(compact(body), media_type="application/json")
