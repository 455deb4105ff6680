"""OpenAI's error envelope, `{"error": {"message", "type", "param", "code"}}`, for every failure the server returns.

Routes raise `APIError`; the handlers installed by `install_error_handlers` turn it (and FastAPI's own errors:
validation, unknown route, wrong method, anything unexpected) into the envelope, so a client never sees a
bare-text or framework-shaped error.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger("kvserve.server")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    def __init__(self, status_code: int, message: str, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def envelope(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return error_response(self.status_code, self.envelope(), self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(status_code: int, envelope: dict, headers: dict[str, str] | None = None) -> Response:
    # ensure_ascii: an error may quote the client's input, which may hold lone surrogates that UTF-8 refuses.
    body = json.dumps(envelope, ensure_ascii=True)
    return Response(body, status_code=status_code, media_type="application/json", headers=headers)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors -> (one readable message, the OpenAI `param` of the first offending field)."""
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = _param_path(location)
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    message = first.get("msg", "invalid value")
    return (f"{param}: {message}" if param else message), param


def _param_path(location: list[str]) -> str | None:
    # ("messages", "0", "role") -> "messages[0].role"; pydantic adds union branch names we drop ("str", "list[...]").
    path = ""
    for part in location:
        if part.isdigit():
            path += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "function-after", "function-before"):
            continue
        else:
            path += f".{part}" if path else part
    return path or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(list(exc.errors()))
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        error_type = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
        return APIError(exc.status_code, message, type=error_type, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return unexpected_error_response(request.method, request.url.path, exc)


def unexpected_error_response(method: str, path: str, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", method, path, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", type=SERVER_ERROR).response()
