"""The FastAPI application: routes, error envelope, health, models, metrics and guards."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from llm_engine.config import Settings
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from adapter import completions, infer, management, mindie_metrics, openapi, stop_infer
from adapter.admission import AdmissionState
from adapter.errors import MindIEError, error_body, not_found_error
from adapter.guards import Admission, ApiKey, BodyLimit, HeaderLimit
from adapter.metrics import MetricsMiddleware
from adapter.planes import PlaneFilter, listeners
from adapter.service import ClientGone, Service
from adapter.triton import TritonClient

log = logging.getLogger(__name__)


def create_app(settings: Settings, tokenizer=None) -> FastAPI:
    admission = AdmissionState(settings.server.maxLinkNum, max_wait=settings.server.e2eTimeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        t = settings.triton
        triton = TritonClient(t.grpc_target, t.modelName)
        app.state.service = Service(settings, triton, tokenizer)
        app.state.scrape_client = mindie_metrics.scrape_client()
        log.info("adapter serving model %s through Triton gRPC %s:%s", settings.model.modelName,
                 t.grpcAddress, t.grpcPort)
        yield
        await app.state.scrape_client.aclose()
        await triton.close()

    app = FastAPI(title="MindIE Server API on Triton", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.admission = admission
    app.state.settings = settings
    app.include_router(completions.router)
    app.include_router(infer.router)
    app.include_router(management.router)
    app.include_router(stop_infer.router)
    app.include_router(mindie_metrics.router)
    openapi.install(app, [m.modelName for m in settings.deploy.ModelConfig])

    @app.exception_handler(MindIEError)
    async def mindie_error(_: Request, exc: MindIEError):
        return Response(json.dumps(error_body(exc), separators=(",", ":"), ensure_ascii=False),
                        status_code=exc.status, media_type="application/json", headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        # a bug must still answer in MindIE's envelope; Starlette logs the traceback
        return Response(json.dumps({"error": "Failed to get engine response.", "error_type": "Incomplete Generation"},
                                   separators=(",", ":")), status_code=500, media_type="application/json")

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)  # gone while its body was being read
    async def client_gone(_: Request, __: Exception):
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        if exc.status_code in (404, 405):
            return Response(status_code=404)  # MindIE answers unknown routes with an empty 404
        return Response(status_code=exc.status_code)

    @app.get("/v1/models")
    async def models(request: Request):
        svc: Service = request.app.state.service
        body = {"object": "list", "data": [{"id": svc.model_name, "object": "model", "root": svc.model_root,
                                            "owned_by": "MindIE Server", "parent": "null"}]}
        return Response(json.dumps(body, indent=4), media_type="application/json")

    @app.get("/v1/models/{model}")
    async def model_info(model: str, request: Request):
        svc: Service = request.app.state.service
        if model != svc.model_name:
            raise not_found_error(f"Model {model} not found.")
        return {"id": svc.model_name, "object": "model", "created": svc.started, "owned_by": "MindIE Server"}

    srv = settings.server
    app.add_middleware(Admission, state=admission)
    app.add_middleware(BodyLimit, max_bytes=srv.maxRequestLength * 2**20, mib=srv.maxRequestLength)
    app.add_middleware(ApiKey, key=srv.apiKey)
    app.add_middleware(HeaderLimit)
    app.add_middleware(MetricsMiddleware)
    planes = listeners(srv)
    if len(planes) > 1:  # one listener serves every route: nothing to filter
        app.add_middleware(PlaneFilter, planes_by_port={listener.port: listener.planes for listener in planes})
    return app
