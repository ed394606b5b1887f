"""The one place where domain errors become gRPC status codes and back (DESIGN §5 decision 10).

Servers: decorate grpc.aio servicer methods with ``@rpc_errors`` (or wrap a block in
``async with error_boundary(context, "Router.Route")``). A raised ``KvtierError``
aborts the call with its status code, its message as details, and gRPC's standard rich
error model in the ``grpc-status-details-bin`` trailer: a ``google.rpc.Status`` whose
details are ``ErrorInfo`` (reason: the error class in UPPER_SNAKE_CASE, domain
``kvtier.dev``), ``BadRequest`` naming the offending field, and, where they fit,
``ResourceInfo`` (NOT_FOUND), ``QuotaFailure`` (RESOURCE_EXHAUSTED) and ``RetryInfo``
(UNAVAILABLE, RESOURCE_EXHAUSTED). The ``kvtier-error-field`` and ``kvtier-error-type``
trailers repeat the field and class for clients that read only those. Any other exception is a bug: it is
logged with a fresh run id and the caller gets ``INTERNAL`` with that id and nothing
else, never the exception's text.

Request bytes that do not decode as the method's message (corrupt wire format, invalid
UTF-8 in a string field) never reach a servicer: grpc itself would answer UNKNOWN, so every
kvtier server installs ``MalformedRequestInterceptor``, which decodes inside the handler and
answers ``INVALID_ARGUMENT`` (field ``request``) instead.

Clients: ``error_from_rpc_error(rpc_error)`` turns a ``grpc.RpcError`` back into the
matching ``KvtierError`` subclass, field included, reading the standard details first and
the kvtier trailers when a server sent no details.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from kvtier.domain import errors
from kvtier.domain.errors import InvalidArgument, KvtierError

logger = logging.getLogger(__name__)

FIELD_METADATA_KEY = "kvtier-error-field"
ERROR_TYPE_METADATA_KEY = "kvtier-error-type"
RUN_ID_METADATA_KEY = "kvtier-run-id"
DETAILS_METADATA_KEY = "grpc-status-details-bin"  # google.rpc.Status, serialized
ERROR_DOMAIN = "kvtier.dev"  # ErrorInfo.domain
# RetryInfo.retry_delay of UNAVAILABLE (a leader election, a Redis reconnect) and
# RESOURCE_EXHAUSTED (a rate limit's window) answers.
RETRY_DELAY_S = 1

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


MAX_METADATA_VALUE_CHARS = 256


def metadata_value(text: str) -> str:
    """``text`` as a valid gRPC metadata value: printable ASCII, others escaped, at most
    ``MAX_METADATA_VALUE_CHARS`` characters. A field path can hold a caller's map key (any
    text), and one invalid character would turn the whole answer into INTERNAL."""
    escaped = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in text)
    return escaped if len(escaped) <= MAX_METADATA_VALUE_CHARS else escaped[: MAX_METADATA_VALUE_CHARS - 3] + "..."


def _reason(err: KvtierError) -> str:
    """``InvalidArgument`` → ``INVALID_ARGUMENT``: ErrorInfo.reason's UPPER_SNAKE_CASE."""
    name = type(err).__name__
    return "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name)).upper()


def _resource_type(field: str | None) -> str:
    """The kind of thing a NOT_FOUND names, from its field path (``namespace.model_id`` →
    ``namespace``, ``session_id`` → ``session``)."""
    head = (field or "").split(".", 1)[0].split("[", 1)[0]
    return head.removesuffix("_id") or "resource"


def rich_status(err: KvtierError, code: grpc.StatusCode) -> status_pb2.Status:
    """``err`` as a ``google.rpc.Status`` with the details its code calls for."""
    info = error_details_pb2.ErrorInfo(reason=_reason(err), domain=ERROR_DOMAIN,
                                       metadata={"error_type": type(err).__name__})
    details: list[Any] = [info]
    if err.field:
        info.metadata["field"] = err.field
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=err.field, description=err.message)]))
    if code is grpc.StatusCode.NOT_FOUND:
        details.append(error_details_pb2.ResourceInfo(
            resource_type=_resource_type(err.field), description=err.message))
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        details.append(error_details_pb2.QuotaFailure(violations=[
            error_details_pb2.QuotaFailure.Violation(subject=err.field or "", description=err.message)]))
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        retry = error_details_pb2.RetryInfo()
        delay_s = getattr(err, "retry_after_s", None)
        retry.retry_delay.FromNanoseconds(round((RETRY_DELAY_S if delay_s is None else delay_s) * 1e9))
        details.append(retry)
    status = status_pb2.Status(code=code.value[0], message=err.message)
    for detail in details:
        status.details.add().Pack(detail)
    return status


async def abort_with(context: grpc.aio.ServicerContext, err: KvtierError) -> NoReturn:
    """Abort the current RPC with ``err``'s status code and rich details. Always raises
    (``grpc.aio.AbortError``)."""
    code = status_code_for(err)
    metadata: list[tuple[str, str | bytes]] = [
        (ERROR_TYPE_METADATA_KEY, type(err).__name__),
        (DETAILS_METADATA_KEY, rich_status(err, code).SerializeToString()),
    ]
    if err.field:
        metadata.append((FIELD_METADATA_KEY, metadata_value(err.field)))
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
    message = f"internal error in {rpc_name}; the server log has the details under run id {run_id}"
    status = status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message=message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason="INTERNAL", domain=ERROR_DOMAIN,
                                                          metadata={"run_id": run_id}))
    await context.abort(
        grpc.StatusCode.INTERNAL, message,
        trailing_metadata=((RUN_ID_METADATA_KEY, run_id), (DETAILS_METADATA_KEY, status.SerializeToString())),
    )
    raise AssertionError("context.abort() returned")


async def _abort_for(context: grpc.aio.ServicerContext, rpc_name: str, exc: Exception) -> NoReturn:
    if isinstance(exc, KvtierError):
        await abort_with(context, exc)
    await _abort_internal(context, rpc_name, exc)


@contextlib.asynccontextmanager
async def error_boundary(context: grpc.aio.ServicerContext, rpc_name: str = "rpc") -> AsyncIterator[None]:
    """Turn exceptions raised inside the block into aborts (see the module docstring)."""
    try:
        yield
    except grpc.aio.AbortError:
        raise  # the servicer aborted on purpose
    except Exception as exc:
        await _abort_for(context, rpc_name, exc)


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
        try:  # error_boundary's body inlined: an async context manager costs Route ~4 us
            return await method(*args)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_for(args[-1], rpc_name, exc)

    return unary  # type: ignore[return-value]


KVTIER_METHOD_PREFIX = "/kvtier.v1."


def decode_request(decode: Callable[[bytes], Any], raw: bytes) -> Any:
    """``decode(raw)``, or ``InvalidArgument`` naming the message type when the bytes do not
    decode (for a servicer that takes raw bytes: ``kvtier.controller.route_hashing``)."""
    try:
        return decode(raw)
    except DecodeError as exc:
        raise _malformed(decode, exc) from None


def _malformed(decode: Callable[[bytes], Any], exc: DecodeError) -> InvalidArgument:
    message_type = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
    name = message_type.full_name if message_type is not None else "request message"
    # protobuf's reason names the failure ("String field had bad UTF-8"), never the bytes.
    reason = str(exc).rsplit(": ", 1)[-1] or type(exc).__name__
    return InvalidArgument(f"the request is not a valid {name}: {reason}", field="request")


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT, not grpc's UNKNOWN, when request bytes do not decode.

    grpc runs a handler's ``request_deserializer`` before the servicer, and an exception
    there becomes ``UNKNOWN: Unexpected DecodeError``. For kvtier's own services this
    interceptor hands the servicer the raw bytes' decoding instead: a unary request that
    does not decode is aborted with ``INVALID_ARGUMENT``; on a request stream the bad
    message raises ``InvalidArgument`` from the request iterator, inside the servicer's
    ``@rpc_errors`` boundary. Health and reflection keep grpc's behaviour.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.request_deserializer is None or not method.startswith(KVTIER_METHOD_PREFIX):
            return handler
        decode = handler.request_deserializer
        serialize = handler.response_serializer
        if handler.request_streaming:
            behavior = handler.stream_stream or handler.stream_unary

            async def decoded(raw_messages: AsyncIterator[bytes]) -> AsyncIterator[Any]:
                async for raw in raw_messages:
                    try:
                        yield decode(raw)
                    except DecodeError as exc:
                        raise _malformed(decode, exc) from None

            if handler.stream_stream is not None:

                async def stream_stream(raw_messages: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
                    async with contextlib.aclosing(behavior(decoded(raw_messages), context)) as responses:
                        async for response in responses:
                            yield response

                return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=serialize)

            async def stream_unary(raw_messages: AsyncIterator[bytes], context: Any) -> Any:
                return await behavior(decoded(raw_messages), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=serialize)

        async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return decode(raw)
            except DecodeError as exc:
                await abort_with(context, _malformed(decode, exc))

        if handler.unary_stream is not None:
            behavior = handler.unary_stream
            if not inspect.isasyncgenfunction(behavior):
                return handler  # no kvtier servicer streams with context.write()

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                request = await parse(raw, context)
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)

        behavior = handler.unary_unary

        async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await parse(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serialize)


def status_details(rpc_error: grpc.RpcError) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` a failed call carries, or None when it has none (or an
    undecodable one, or one whose code disagrees with the call's)."""
    metadata = dict(_from_call(rpc_error, "trailing_metadata", None) or ())
    raw = metadata.get(DETAILS_METADATA_KEY)
    if not isinstance(raw, bytes):
        return None
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw)
    except DecodeError:
        return None
    code: grpc.StatusCode | None = _from_call(rpc_error, "code", None)
    return status if code is not None and status.code == code.value[0] else None


def _from_details(status: status_pb2.Status) -> tuple[str | None, str | None]:
    """(field, error class name) from a status's BadRequest and ErrorInfo details."""
    field = error_type = None
    for any_detail in status.details:
        if any_detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_detail.Unpack(bad)
            field = next((v.field for v in bad.field_violations if v.field), field)
        elif any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            any_detail.Unpack(info)
            if info.domain == ERROR_DOMAIN:
                error_type = info.metadata.get("error_type") or None
    return field, error_type


def error_from_rpc_error(rpc_error: grpc.RpcError) -> KvtierError:
    """The ``KvtierError`` a failed call stands for (works for sync and aio calls)."""
    code: grpc.StatusCode | None = _from_call(rpc_error, "code", None)
    details: str = _from_call(rpc_error, "details", None) or str(rpc_error)
    metadata = dict(_from_call(rpc_error, "trailing_metadata", None) or ())
    status = status_details(rpc_error)
    if status is not None:
        field, error_type = _from_details(status)
    else:
        field, error_type = metadata.get(FIELD_METADATA_KEY) or None, metadata.get(ERROR_TYPE_METADATA_KEY)
    cls = _ERROR_BY_STATUS.get(code) if code is not None else None
    named = _KNOWN_ERRORS.get(str(error_type or ""))
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
