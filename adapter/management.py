"""MindIE's management routes: health, the timed health probe, and the instance's static config.

They are served on the management listener, which is the business one unless
``managementPort`` says otherwise (:mod:`adapter.planes`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from adapter.errors import INCOMPLETE, incomplete_error, not_found_error
from adapter.service import Service, within
from adapter.triton import TritonError

log = logging.getLogger(__name__)
router = APIRouter(include_in_schema=False)

PROBE_WAIT_DEFAULT = 10  # seconds, /health/timed without a suffix
PROBE_WAIT_MAX = 600
_TIMED = re.compile(r"-(\d+)")


def _stopping(request: Request) -> bool:
    return request.app.state.admission.stopping


async def _ready(request: Request) -> bool:
    return await request.app.state.service.triton.ready()


def _was_ready(request: Request) -> bool:
    """Has the model been ready once? Then not ready now (Triton or the model's stub gone) is
    spec §4's "abnormal", which answers 500; before that the service is initialising (503)."""
    return request.app.state.service.triton.was_ready


ABNORMAL = "Service is abnormal"


@router.get("/health")
async def health(request: Request):
    if _stopping(request):
        return JSONResponse({"error": "The service has been stopped", "error_type": "Service Unavailable"},
                            status_code=503)
    if await _ready(request):
        return Response(status_code=200)
    if _was_ready(request):
        return JSONResponse({"error": f"{ABNORMAL}: the model is not ready", "error_type": INCOMPLETE},
                            status_code=500)
    return Response(status_code=503)


@router.get("/v2/health/live")
async def live(request: Request):
    if _was_ready(request) and not _stopping(request) and not await _ready(request):
        return JSONResponse({"message": ABNORMAL}, status_code=500)
    if request.app.state.admission.busy:  # alive, and says so (spec §4)
        return JSONResponse({"message": "Service is alive but busy"})
    return Response(status_code=200)


@router.get("/v2/health/ready")
async def ready(request: Request):
    if _stopping(request):
        return JSONResponse({"message": "Service is stopping"}, status_code=503)
    if request.app.state.admission.busy:  # spec §4: a saturated server takes no more traffic
        return JSONResponse({"message": "Service is alive but busy. Consider reducing request frequency"},
                            status_code=503)
    if await _ready(request):
        return Response(status_code=200)
    if _was_ready(request):
        return JSONResponse({"message": ABNORMAL}, status_code=500)
    return JSONResponse({"message": "Model is not ready"}, status_code=503)


@router.get("/v2/models/{model}/ready")
async def model_ready(model: str, request: Request):
    if model != request.app.state.service.model_name:
        return Response(status_code=404)
    return await health(request)


@router.get("/health/timed")
async def timed_default(request: Request):
    return await _timed(request, PROBE_WAIT_DEFAULT)


@router.get("/health/timed{suffix}")
async def timed(suffix: str, request: Request):
    """``/health/timed-N``: a one-token generation through Triton, which must end in N seconds."""
    match = _TIMED.fullmatch(suffix)
    if match is None:
        return Response(status_code=404)  # another path: MindIE's route only matches -digits
    digits = match.group(1)
    if len(digits) > 3:
        raise not_found_error(f"Max wait time is {PROBE_WAIT_MAX}, input is invalid or too long")
    seconds = int(digits)
    if not 1 <= seconds <= PROBE_WAIT_MAX:
        raise not_found_error(f"Wait time should be in range of [1, {PROBE_WAIT_MAX}], input is not valid")
    return await _timed(request, seconds)


async def _timed(request: Request, seconds: int) -> Response:
    healthy = Response(json.dumps({"status": "healthy"}), media_type="application/json")
    if _stopping(request):
        return healthy  # as MindIE: a stopping server is not probed
    if not await _ready(request):
        if _was_ready(request):
            raise incomplete_error(f"{ABNORMAL}: the model is not ready")
        return Response(status_code=503)
    svc: Service = request.app.state.service
    failure = await probe(svc, seconds)
    if failure:
        log.warning("timed health probe failed: %s", failure)
        raise incomplete_error(failure)
    return healthy


async def probe(svc: Service, seconds: float) -> str | None:
    """Generate one token through Triton within ``seconds``; the failure's text, or None.

    The probe takes a request id from the same counter as requests (MindIE's does too),
    and a prompt of one token, so it costs the engine one short step.
    """
    sampling = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}

    async def one_token() -> str | None:
        async for chunk in svc.triton.generate(svc.next_request_id(), sampling, prompt_ids=[svc.probe_token_id],
                                               stream=False, outputs=["completion_tokens"]):
            if chunk.final:
                return None if chunk.completion_tokens == 1 else "Health probe generated no token"
        return "Health probe ended without a response"

    try:
        return await within(one_token(), seconds)
    except asyncio.TimeoutError:
        return f"Health probe timed out after {seconds} s"
    except TritonError as exc:
        return f"Health probe failed: {exc.message}"


@router.get("/v1/config")
async def config(request: Request):
    """The instance's static facts, in MindIE's keys (read by MindIE's cluster controller).

    ``npuMemSize`` is the KV-cache budget in GiB (``kvCacheMemoryMiB``), ``cpuMemSize`` 0
    (preempted requests are recomputed, not swapped to host memory), ``worldSize`` 1 (one
    device per model instance).
    """
    settings = request.app.state.settings
    sched = settings.schedule
    kv_gib = sched.kvCacheMemoryMiB / 1024
    body = {
        "modelName": settings.model.modelName,
        "maxSeqLen": settings.deploy.maxSeqLen,
        "npuMemSize": int(kv_gib) if kv_gib.is_integer() else kv_gib,
        "cpuMemSize": 0,
        "worldSize": 1,
        "maxOutputLen": sched.maxIterTimes,
        "cacheBlockSize": sched.cacheBlockSize,
    }
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")
