"""The OpenAPI document: request bodies and responses of routes that read the raw body.

The inference routes validate the raw body with MindIE's own rules, order and messages
(``adapter.protocol``), so FastAPI does not see their bodies. Their request and response
schemas are declared here instead: every schema is a component under
``#/components/schemas/`` (nested models included), so every ``$ref`` in the document
resolves, and :func:`install` adds the components no route's ``response_model`` brings in.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from adapter.protocol.common import BodyTooLarge, ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"
_COMPONENTS: dict[str, tuple[type[BaseModel], JsonSchemaMode]] = {}


def schema_ref(model: type[BaseModel], mode: JsonSchemaMode = "validation") -> dict:
    """A ``$ref`` to ``model``'s component, which :func:`install` adds to the document."""
    _COMPONENTS[model.__name__] = (model, mode)
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def request_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route that parses its JSON body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema_ref(model)}}}}


def responses(stream_event: type[BaseModel], stream_doc: str) -> dict:
    """``responses=`` of an inference route: its SSE form, and MindIE's errors (spec §1.2)."""
    error = {"model": ErrorResponse}
    return {
        200: {"description": "JSON without `stream`; with `stream: true`, server-sent events. " + stream_doc,
              "content": {"text/event-stream": {"schema": schema_ref(stream_event, "serialization")}}},
        413: {"model": BodyTooLarge, "description": "The body is larger than `maxRequestLength` MiB."},
        422: {**error, "description": "Input Validation Error: parse, type, range or combination check, "
                                      "or the tokenizer failed."},
        424: {**error, "description": "Generation Error: the engine rejected the request at enqueue "
                                      "(prompt over the token limit, invalid token ids)."},
        500: {**error, "description": "Incomplete Generation: timeout, Triton or the model unavailable, "
                                      "generation failed."},
        503: {**error, "description": "Service Unavailable: stopping, or overloaded (with Retry-After)."},
    }


def install(app: FastAPI, model_names: list[str]) -> None:
    """Serve a document whose components include every model :func:`schema_ref` named.

    ``model_names`` (the configured ``modelName`` values) become the enum of the
    completions request's ``model``, which validation checks against the same list.
    """

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description,
                          routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        _, defs = models_json_schema(list(_COMPONENTS.values()), ref_template=REF_TEMPLATE)
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        if "CompletionRequest" in schemas:
            schemas["CompletionRequest"]["properties"]["model"]["enum"] = list(model_names)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
