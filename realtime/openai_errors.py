"""Errors of the REST API in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `OpenAIError`; `openai_error_middleware` renders it, and also turns aiohttp's own
4xx/5xx under `/v1/` (unknown route 404, wrong method 405, body over the size cap 413) into the same
shape, so an OpenAI SDK always gets an error it can parse. `type` is OpenAI's: `invalid_request_error`
for 4xx, `server_error` for 5xx; `code` is our stable, documented code string; `param` names the
offending request field (or form field) when there is one. The WebSocket upgrade route keeps its own
errors (it is not an OpenAI route).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from voicewire.protocol.messages import ProtocolError, ReportedError

WS_PATH: Final = "/v1/audio/speech/stream"

ErrorHook = Callable[[web.Request, int, str], None]
"""Called as `hook(request, status, code)` once per error response."""

_HTTP_CODES: Final[dict[int, str]] = {
    404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type",
}


class OpenAIError(ReportedError):
    """A refused or failed REST request with its HTTP `status`, rendered by `openai_error_middleware`."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(code, message, param)
        self.status = status

    def body(self) -> dict[str, dict[str, object]]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def from_protocol_error(exc: ProtocolError) -> OpenAIError:
    """The REST twin of a config error of the WebSocket (same validation, same message and param, code
    `exc.reason` or `invalid_value`); an unknown model is a 404 as in OpenAI's API."""
    status = 404 if exc.reason == "model_not_found" else 400
    return OpenAIError(status, exc.message, code=exc.reason or "invalid_value", param=exc.param)


def openai_error_middleware(on_error: ErrorHook) -> Middleware:
    """Middleware rendering `OpenAIError`s, and aiohttp's HTTP errors under `/v1/`, in OpenAI's shape.
    `on_error(request, status, code)` is called once per error response (for metrics)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except OpenAIError as exc:
            on_error(request, exc.status, exc.code)
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400 or not request.path.startswith("/v1/") or request.path == WS_PATH:
                raise
            code = _HTTP_CODES.get(exc.status, f"http_{exc.status}")
            message = _message(request, exc)
            on_error(request, exc.status, code)
            response = OpenAIError(exc.status, message, code=code).response()
            if exc.status == 405 and "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response

    return middleware


def _message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"Unknown route: {request.method} {request.path}"
    if exc.status == 405:
        return f"Method {request.method} is not allowed on {request.path}"
    if exc.status == 413:
        return f"Request body too large: {exc.text or exc.reason}"
    return exc.text or exc.reason
