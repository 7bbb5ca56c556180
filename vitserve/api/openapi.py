"""OpenAPI description of /encode's two body kinds and its error answers.

The handler reads the raw body itself (to enforce --max_request_bytes while it streams), so FastAPI
cannot infer the request body; it is declared here so /docs and schemathesis know both forms.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from vitserve.api.schemas import EncodeJSONRequest, EncodeMultipartRequest, EncodeResponse, ErrorBody

_REF = "#/components/schemas/{model}"
DOCS_ASSETS_URL = "/docs/assets"  # Swagger UI / ReDoc files, served from the fastapi-offline package


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


ENCODE_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": _ref("EncodeJSONRequest")},
            "multipart/form-data": {"schema": _ref("EncodeMultipartRequest")},
        },
    }
}

_ERROR_JSON = {"application/json": {"schema": _ref("ErrorBody")}}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {"schema": _ref("EncodeResponse")}}},
    400: {
        "description": "invalid_request, invalid_image, unsupported_image, image_too_small, "
        "aspect_ratio_too_large, "
        "too_many_images, url_not_allowed",
        "content": _ERROR_JSON,
    },
    401: {"description": "unauthorized", "content": _ERROR_JSON},
    413: {"description": "payload_too_large, over_token_budget", "content": _ERROR_JSON},
    503: {"description": "queue_full (with Retry-After), not_ready, encoder_failed", "content": _ERROR_JSON},
    504: {"description": "timeout", "content": _ERROR_JSON},
}


def add_schemas(schema: dict[str, Any]) -> dict[str, Any]:
    """Put the request/response models into components/schemas (with their nested definitions)."""
    models: list[type[BaseModel]] = [EncodeJSONRequest, EncodeMultipartRequest, EncodeResponse, ErrorBody]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    return schema
