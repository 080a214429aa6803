"""The OpenAI-shaped error body, `{"error": {"message", "type", "param", "code"}}`: every error
rtp writes over HTTP, the server's (rtp/server/openai_api.py) and the router's
(rtp/router/flexlb.py) alike, so a client reads one shape whichever process answered."""

from __future__ import annotations

import msgspec
from msgspec import Struct


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(Struct):
    error: ErrorInfo


# OpenAI's error types by status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               500: "server_error", 502: "upstream_error", 503: "service_unavailable", 504: "upstream_error"}

_encoder = msgspec.json.Encoder()


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The body of an error answer, as the OpenAI API writes it."""
    return _encoder.encode(ErrorResponse(ErrorInfo(message, ERROR_TYPES.get(status, "error"), param, status)))
