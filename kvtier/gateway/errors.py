"""OpenAI error objects and the HTTP status of every kvtier error, in one place.

Every error the gateway returns is ``{"error": {"message", "type", "param", "code"}}``; no
stack trace ever reaches a client, and messages never carry prompt text or token ids.
"""

from __future__ import annotations

from typing import Any

from kvtier.domain import errors


class ApiError(Exception):
    """An error response: HTTP ``status`` and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "api_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# kvtier error class -> (HTTP status, OpenAI code). Subclasses match their base (ConfigError
# is an InvalidArgument) through the MRO walk in ``from_kvtier``.
_STATUS: dict[type[errors.KvtierError], tuple[int, str]] = {
    errors.InvalidArgument: (400, "invalid_value"),
    errors.NotFound: (404, "not_found"),
    errors.Unauthenticated: (401, "invalid_api_key"),
    errors.PermissionDenied: (403, "permission_denied"),
    errors.ResourceExhausted: (429, "overloaded"),
    errors.Unavailable: (503, "no_worker"),
    errors.FailedPrecondition: (503, "not_ready"),
    errors.DeadlineExceeded: (504, "timeout"),
    errors.Cancelled: (499, "cancelled"),
}


def from_kvtier(exc: errors.KvtierError) -> ApiError:
    """The response for a kvtier error raised by the client or the gateway itself."""
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            status, code = _STATUS[cls]
            return ApiError(status, exc.message, param=exc.field, code=code)
    return ApiError(500, "internal error in the gateway; see its log", code="internal_error")
