"""Request bodies parsed and validated in a worker thread, not on the event loop: a body of
tens of megabytes takes that long to parse that /health and every stream would wait on it.

A thread helps only while it lets the event loop's thread take the GIL, which C and Rust code
(json's scanner, pydantic's validators) does not do before it returns. So JSON is parsed with
Python hooks for objects and numbers (bytecode, where the interpreter switches threads every
few milliseconds), and the validators of the fields that can hold millions of items (prompts,
message contents) are Python loops (see protocol.py); the size limits refuse what can never
fit before the items are validated one by one.

Unknown top-level fields (what clients and frameworks send routinely: OpenAI's newest fields,
their own tags) are left out before validation, named in one log line and counted in the
`x-pagoda-ignored-fields` response header; with strict fields they are a 400 instead. Nested
objects always refuse unknown fields (a typo there has no routine excuse).

The routes take the raw request, so FastAPI no longer sees the body's model: `body_schema`
puts it back into the OpenAPI document.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.openai.errors import empty_body_error, invalid_json_error, not_json_error, validation_error
from pagoda.entrypoints.openai.limits import RequestLimits
from pagoda.entrypoints.openai.protocol import BodyContext, RequestBody

logger = logging.getLogger(__name__)

Body = TypeVar("Body", bound=RequestBody)
_SCHEMA_REF = "#/components/schemas/{model}"
IGNORED_FIELDS_HEADER = "x-pagoda-ignored-fields"
# How much of the ignored names one log line shows: names are the client's text.
_MAX_LOGGED_NAMES = 16
_MAX_NAME_CHARS = 64


async def parse_body(
    request: Request,
    model: type[Body],
    limits: RequestLimits | None,
    served_model_name: str | None = None,
    strict_fields: bool = True,
) -> Body:
    """The request's JSON body as `model` (400 naming the bad field otherwise)."""
    if not _is_json(request.headers.get("content-type", "")):
        raise not_json_error()
    raw = await request.body()
    return await asyncio.to_thread(validate_body, raw, model, limits, served_model_name, strict_fields)


def validate_body(
    raw: bytes,
    model: type[Body],
    limits: RequestLimits | None,
    served_model_name: str | None = None,
    strict_fields: bool = True,
) -> Body:
    """`raw` as `model`; unless `strict_fields`, unknown top-level fields are left out (and logged)."""
    if not raw.strip():
        raise empty_body_error()
    try:
        data = json.loads(raw, object_pairs_hook=_object, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except ValueError as error:  # bad syntax, bad UTF-8, an integer of thousands of digits
        raise invalid_json_error(str(error)) from None
    ignored = (
        [] if strict_fields or not isinstance(data, dict) else [key for key in data if key not in model.model_fields]
    )
    if ignored:
        data = {key: value for key, value in data.items() if key in model.model_fields}
        logger.warning("%s: ignored fields the server does not know: %s", model.__name__, describe_names(ignored))
    try:
        body = model.model_validate(data, context=BodyContext(limits, served_model_name))
    except ValidationError as error:
        raise validation_error(error.errors(include_url=False)) from None
    if ignored:
        body._ignored_fields = tuple(ignored)
    return body


def describe_names(names: list[str]) -> str:
    """Client-chosen names, fit for one log line: printable ASCII only, each cut short, and
    only the first few of them."""
    shown = [_printable(name[:_MAX_NAME_CHARS]) for name in names[:_MAX_LOGGED_NAMES]]
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f" and {rest} more" if rest else "")


def _printable(text: str) -> str:
    return "".join(char if " " <= char <= "~" else "?" for char in text)


def count_ignored_fields(response: Response, body: RequestBody) -> Response:
    """`response` with the number of fields of `body` that were ignored, if any, in a header."""
    if body.ignored_fields:
        response.headers[IGNORED_FIELDS_HEADER] = str(len(body.ignored_fields))
    return response


def _is_json(content_type: str) -> bool:
    """As FastAPI decides: no Content-Type, application/json or application/*+json."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    is_json_suffix = media_type.startswith("application/") and media_type.endswith("+json")
    return not media_type or media_type == "application/json" or is_json_suffix


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of the range of a double")
    return value


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads a `model` body itself."""
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add the request models (and the models they use) to the app's OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            _, definitions = models_json_schema([(model, "validation") for model in models], ref_template=_SCHEMA_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
        return app.openapi_schema

    app.openapi = openapi
