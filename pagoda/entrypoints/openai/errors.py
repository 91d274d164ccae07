"""Every failure answered with OpenAI's error body, `{"error": {message, type, param, code}}`,
and the status that fits it; none of them reaches the engine or disturbs another request."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.engine.async_llm import EngineOverloadedError
from pagoda.engine.core_client import EngineDeadError
from pagoda.engine.errors import EngineSleepingError
from pagoda.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagoda.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# Union members appear in pydantic's error locations by their type names; they are not fields.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict"}


# Longest echo of a bad value in an error message (a value may be megabytes long).
_MAX_ECHO_CHARS = 200
# Seconds an overloaded server asks clients to wait before retrying.
RETRY_AFTER_S = 1
# Routes of OpenAI's API the server knows but lacks, and the feature each needs.
ABSENT_ROUTES = {
    "/v1/audio/{rest:path}": "speech models",
    "/v1/images/{rest:path}": "image generation models",
    "/v1/moderations": "moderation models",
    "/v1/files": "file storage",
    "/v1/files/{rest:path}": "file storage",
    "/v1/batches": "the batch API",
    "/v1/batches/{rest:path}": "the batch API",
    "/v1/fine_tuning/{rest:path}": "fine-tuning",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=_TYPES.get(self.status, "error"), param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(error: InvalidRequestError, param_names: dict[str, str] | None = None) -> OpenAIError:
    """A 400 for an engine-side validation error, its field renamed to the one the client sent
    (and named first in the message, which speaks of the engine's field)."""
    param = (param_names or {}).get(error.param, error.param)
    message = str(error) if param == error.param else f"{param}: {error}"
    return OpenAIError(400, message, param=param)


def not_json_error() -> OpenAIError:
    return OpenAIError(400, "the request body must be JSON, sent with 'Content-Type: application/json'")


def invalid_json_error(detail: str) -> OpenAIError:
    return OpenAIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")


def empty_body_error() -> OpenAIError:
    return OpenAIError(400, "the request body is empty: send a JSON object", code="invalid_json")


def validation_error(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """A 400 naming the first bad field of the body, the rule it broke and the value sent
    (`errors` as pydantic lists them; FastAPI's locations start with "body")."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return invalid_json_error(first.get("ctx", {}).get("error", "invalid JSON"))
    if isinstance(first.get("input"), bytes):  # the body was not parsed as JSON
        return not_json_error()
    if first["type"] == "missing" and tuple(first["loc"]) == ("body",):
        return empty_body_error()
    param = _param_path([part for part in first["loc"] if part != "body"])
    message = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]
    if first["type"] != "missing" and "input" in first:
        echo = repr(first["input"])
        message += f", got {echo if len(echo) <= _MAX_ECHO_CHARS else echo[:_MAX_ECHO_CHARS] + '...'}"
    if not param:
        return OpenAIError(400, f"request body: {message}")
    return OpenAIError(400, f"{param}: {message}", param=param)


def _param_path(loc: list[str | int]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_TAGS:
            path += f".{part}" if path else part
    return path


def to_openai_error(error: Exception) -> OpenAIError:
    """The OpenAI error for anything a request's handling may raise; unexpected ones are logged."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, InvalidRequestError):
        return invalid_request(error)
    if isinstance(error, EngineOverloadedError):
        # 503, not 429: the whole server is full, not this client over a quota of its own.
        return OpenAIError(503, str(error), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, EngineSleepingError):
        return OpenAIError(503, str(error), code="engine_sleeping")
    if isinstance(error, EngineDeadError):
        return OpenAIError(503, f"the engine is not running: {str(error).splitlines()[0]}")
    logger.error("unexpected error serving a request", exc_info=error)
    return OpenAIError(500, f"internal error: {type(error).__name__}")


def engine_control_error(error: Exception) -> OpenAIError:
    """The answer to a sleep / wake_up / update_weights the engine refused: a bad argument (or
    a checkpoint path it cannot read) is a 400, a request the engine's state forbids (e.g. sleeping with requests in flight) a 409."""
    if isinstance(error, (EngineDeadError, TimeoutError)) or not isinstance(error, (ValueError, OSError, RuntimeError)):
        return to_openai_error(error)
    return OpenAIError(400 if isinstance(error, (ValueError, OSError)) else 409, str(error))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            return not_found_error(request).response()
        return OpenAIError(error.status_code, str(error.detail)).response()

    async def _expected(_: Request, error: Exception) -> JSONResponse:
        return to_openai_error(error).response()

    # Errors a request may cause, answered without the traceback kept for unexpected ones.
    for expected in (OpenAIError, InvalidRequestError, EngineOverloadedError, EngineSleepingError, EngineDeadError):
        app.add_exception_handler(expected, _expected)

    @app.exception_handler(Exception)
    async def _any(_: Request, error: Exception) -> JSONResponse:
        return to_openai_error(error).response()


def not_found_error(request: Request) -> OpenAIError:
    return OpenAIError(
        404, f"no route {request.method} {request.url.path} on this server (see /docs)", code="unknown_route"
    )


def install_absent_routes(app: FastAPI) -> None:
    """Answer OpenAI's routes the server lacks with what they need, not a bare "Not Found"."""
    for path, feature in ABSENT_ROUTES.items():
        app.add_api_route(path, _absent_route(feature), methods=["GET", "POST", "DELETE"], include_in_schema=False)


def _absent_route(feature: str) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def absent(request: Request) -> JSONResponse:
        message = f"not supported by this server: {request.url.path} needs {feature}"
        return OpenAIError(404, message, code="unsupported_route").response()

    return absent
