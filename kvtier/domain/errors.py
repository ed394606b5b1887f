"""Domain error types shared by every process.

Expected outcomes (pool full, cache miss, not the leader) are return values, not
exceptions. These types are for broken contracts: bad input, missing things,
exhausted limits, refused callers. The gRPC layer maps each class to one status
code in one place (``kvtier.rpc.status``); nothing else decides status codes.
Messages name the offending field and, where there is one, the accepted range, and
never carry token ids or text.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class. ``field`` names the offending input when there is one."""

    code = "INTERNAL"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(KvtierError):
    """The caller sent something malformed or out of range."""

    code = "INVALID_ARGUMENT"


class ConfigError(InvalidArgument):
    """A configuration value (flag, env var, file) is missing or out of range."""


class NotFound(KvtierError):
    """A named thing (worker, session, namespace, file) does not exist."""

    code = "NOT_FOUND"


class ResourceExhausted(KvtierError):
    """A request can never fit, or a quota is exceeded. ``retry_after_s``: when a retry may
    succeed (a rate limit's refill); None: the default delay."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, field: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s


class FailedPrecondition(KvtierError):
    """The system is not in a state that allows the operation (e.g. not leader)."""

    code = "FAILED_PRECONDITION"


class PermissionDenied(KvtierError):
    code = "PERMISSION_DENIED"


class Unauthenticated(KvtierError):
    code = "UNAUTHENTICATED"


class Unavailable(KvtierError):
    """A dependency (Redis, a worker) cannot be reached right now; retry may help."""

    code = "UNAVAILABLE"


class DeadlineExceeded(KvtierError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(KvtierError):
    code = "CANCELLED"


class CheckpointError(InvalidArgument):
    """A model checkpoint is missing a tensor, has a wrong shape, or an unsupported architecture."""


class IntegrityError(KvtierError):
    """An internal invariant of a pool or index broke. Always a bug."""

    code = "INTERNAL"
