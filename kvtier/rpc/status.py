"""The one place where domain errors become gRPC status codes and back (DESIGN §5 decision 10).

Servers: decorate grpc.aio servicer methods with ``@rpc_errors`` (or wrap a block in
``async with error_boundary(context, "Router.Route")``). A raised ``KvtierError``
aborts the call with its status code, its message as details, and the offending field
in the ``kvtier-error-field`` trailing metadata. Any other exception is a bug: it is
logged with a fresh run id and the caller gets ``INTERNAL`` with that id and nothing
else, never the exception's text.

Clients: ``error_from_rpc_error(rpc_error)`` turns a ``grpc.RpcError`` back into the
matching ``KvtierError`` subclass, field included.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio

from kvtier import errors
from kvtier.errors import KvtierError

logger = logging.getLogger(__name__)

FIELD_METADATA_KEY = "kvtier-error-field"
ERROR_TYPE_METADATA_KEY = "kvtier-error-type"
RUN_ID_METADATA_KEY = "kvtier-run-id"

_STATUS_BY_ERROR_CODE: dict[str, grpc.StatusCode] = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "CANCELLED": grpc.StatusCode.CANCELLED,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}

_ERROR_BY_STATUS: dict[grpc.StatusCode, type[KvtierError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
}

# Subclasses a server may name in ERROR_TYPE_METADATA_KEY; only these are rebuilt, and
# only when their code agrees with the status, so a peer cannot pick an arbitrary class.
_KNOWN_ERRORS: dict[str, type[KvtierError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, KvtierError) and cls is not KvtierError
}


def status_code_for(err: KvtierError | type[KvtierError]) -> grpc.StatusCode:
    """The status code of an error (or error class); unknown codes are INTERNAL."""
    return _STATUS_BY_ERROR_CODE.get(err.code, grpc.StatusCode.INTERNAL)


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


async def abort_with(context: grpc.aio.ServicerContext, err: KvtierError) -> NoReturn:
    """Abort the current RPC with ``err``'s status code. Always raises (``grpc.aio.AbortError``)."""
    code = status_code_for(err)
    metadata: list[tuple[str, str]] = [(ERROR_TYPE_METADATA_KEY, type(err).__name__)]
    if err.field:
        metadata.append((FIELD_METADATA_KEY, err.field))
    if code is grpc.StatusCode.INTERNAL:
        # A KvtierError with code INTERNAL (IntegrityError) is a bug report: keep its
        # message (errors carry no token ids or text) and make it findable in the log.
        run_id = new_run_id()
        logger.error("%s (run id %s)", err.message, run_id)
        metadata.append((RUN_ID_METADATA_KEY, run_id))
    await context.abort(code, err.message, trailing_metadata=tuple(metadata))
    raise AssertionError("context.abort() returned")  # grpc.aio always raises


async def _abort_internal(context: grpc.aio.ServicerContext, rpc_name: str, exc: Exception) -> NoReturn:
    run_id = new_run_id()
    logger.error("unexpected error in %s (run id %s)", rpc_name, run_id, exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL,
        f"internal error in {rpc_name}; the server log has the details under run id {run_id}",
        trailing_metadata=((RUN_ID_METADATA_KEY, run_id),),
    )
    raise AssertionError("context.abort() returned")


@contextlib.asynccontextmanager
async def error_boundary(context: grpc.aio.ServicerContext, rpc_name: str = "rpc") -> AsyncIterator[None]:
    """Turn exceptions raised inside the block into aborts (see the module docstring)."""
    try:
        yield
    except grpc.aio.AbortError:
        raise  # the servicer aborted on purpose
    except KvtierError as err:
        await abort_with(context, err)
    except Exception as exc:
        await _abort_internal(context, rpc_name, exc)


F = TypeVar("F", bound=Callable[..., Any])


def rpc_errors(method: F) -> F:
    """Decorator for grpc.aio servicer methods ``(self, request, context)`` or
    ``(request, context)``: coroutines and async generators (streaming responses)."""
    rpc_name = method.__qualname__

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(*args: Any) -> Any:
            async with error_boundary(args[-1], rpc_name):
                async for item in method(*args):
                    yield item

        return stream  # type: ignore[return-value]

    if not inspect.iscoroutinefunction(method):
        raise TypeError(f"@rpc_errors needs an async servicer method, got {rpc_name}")

    @functools.wraps(method)
    async def unary(*args: Any) -> Any:
        async with error_boundary(args[-1], rpc_name):
            return await method(*args)

    return unary  # type: ignore[return-value]


def error_from_rpc_error(rpc_error: grpc.RpcError) -> KvtierError:
    """The ``KvtierError`` a failed call stands for (works for sync and aio calls)."""
    code: grpc.StatusCode | None = _from_call(rpc_error, "code", None)
    details: str = _from_call(rpc_error, "details", None) or str(rpc_error)
    metadata = dict(_from_call(rpc_error, "trailing_metadata", None) or ())
    field = metadata.get(FIELD_METADATA_KEY) or None
    cls = _ERROR_BY_STATUS.get(code) if code is not None else None
    named = _KNOWN_ERRORS.get(str(metadata.get(ERROR_TYPE_METADATA_KEY, "")))
    if named is not None and code is not None and status_code_for(named) is code:
        cls = named  # e.g. ConfigError rather than plain InvalidArgument
    if cls is None:
        status = code.name if code is not None else "UNKNOWN"
        return KvtierError(f"{status}: {details}", field=field)
    return cls(details, field=field)


def _from_call(rpc_error: grpc.RpcError, name: str, default: Any) -> Any:
    # grpc.RpcError itself declares no accessors; the concrete errors are also grpc.Call.
    accessor = getattr(rpc_error, name, None)
    return accessor() if callable(accessor) else default
