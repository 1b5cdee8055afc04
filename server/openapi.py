"""The OpenAPI document at ``/openapi.json``, as FastAPI builds it from the routes' pydantic models,
corrected to what the server answers: invalid requests get 400 in the error envelope of the route's
API family (FastAPI would describe a 422 that never comes), the bearer key is declared where
``--api-key`` guards the path, and the OpenAI and llama.cpp bodies' ``model`` lists the public names
(only those under ``--strict-model-names``, else any name, these as examples; Anthropic's ``model`` is
any label)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "request_id": {"type": "string"}, "error": {
        "type": "object",
        "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }},
}


def install(app: FastAPI, is_open: Callable[[str], bool], keyed: bool, models: Sequence[str],
            strict: bool = False) -> None:
    """``app.openapi`` builds (once) the corrected document; ``is_open`` tells the paths served
    without the key, ``keyed`` whether the server has one, ``models`` its public names, ``strict``
    whether other names are refused."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = _corrected(doc, is_open, keyed, list(models), strict)
        return app.openapi_schema

    app.openapi = openapi


def _body_schema(op: dict[str, Any]) -> str | None:
    ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
    return ref.rsplit("/", 1)[-1] or None


def _corrected(doc: dict[str, Any], is_open: Callable[[str], bool], keyed: bool, models: list[str],
               strict: bool) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, operations in doc.get("paths", {}).items():
        for name in filter(None, map(_body_schema, operations.values())):
            schema = schemas.get(name, {})
            if "model" in schema.get("properties", {}) and not path.startswith("/v1/messages"):
                named = {"type": "string", "enum": models} if strict else {"type": "string", "examples": models}
                required = "model" in schema.get("required", ())
                schema["properties"]["model"] = named if required else {"anyOf": [named, {"type": "null"}]}
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["Error"], schemas["AnthropicError"] = _ERROR, _ANTHROPIC_ERROR
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc.get("paths", {}).items():
        error = "AnthropicError" if path.startswith("/v1/messages") else "Error"
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            responses["400"] = {"description": "Invalid request (the field named in the error, where there is one)",
                                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}}}
            if keyed and not is_open(path):
                op["security"] = [{"bearer": []}]
                responses["401"] = {"description": "Missing or wrong API key", "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}}}
    return doc
