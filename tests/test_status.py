"""kvtier.rpc.status against a real grpc.aio server on loopback: each domain error arrives
with its status code and field, and an unexpected exception leaks nothing but a run id."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvtier.domain import errors
from kvtier.domain.errors import KvtierError
from kvtier.rpc._gen import sessions_pb2, sessions_pb2_grpc
from kvtier.rpc.convert.sessions import from_proto_pause_request
from kvtier.rpc.status import (
    FIELD_METADATA_KEY,
    RUN_ID_METADATA_KEY,
    error_from_rpc_error,
    rich_status,
    rpc_errors,
    status_code_for,
)

SERVICE = "kvtier.test.Raiser"
SECRET = "token ids 101 102 103 and /etc/secret"

EXPECTED: dict[type[KvtierError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.CheckpointError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.IntegrityError: grpc.StatusCode.INTERNAL,
}
BY_NAME = {cls.__name__: cls for cls in EXPECTED}


def _raise(name: str) -> None:
    if name == "unexpected":
        raise RuntimeError(SECRET)
    if name == "abort-myself":
        raise AssertionError("handled in the servicer")
    cls = BY_NAME[name]
    raise cls(f"request.field_{name} is out of range", field=f"request.field_{name}")


class Raiser:
    """Raises whatever error class the request names (bytes in, bytes out)."""

    @rpc_errors
    async def Unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        name = request.decode()
        if name == "abort-myself":
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "the servicer's own abort")
        _raise(name)
        return b"unreachable"

    @rpc_errors
    async def Stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"first"
        _raise(request.decode())


class Sessions(sessions_pb2_grpc.SessionsServicer):
    """A thin servicer over the generated stubs: convert, (domain call), convert back."""

    @rpc_errors
    async def Pause(self, request: sessions_pb2.PauseRequest, context: grpc.aio.ServicerContext) -> object:
        pause = from_proto_pause_request(request)
        raise errors.NotFound(f"session {pause.session_id!r} is not known", field="session_id")


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    raiser = Raiser()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(raiser.Unary),
                    "Stream": grpc.unary_stream_rpc_method_handler(raiser.Stream),
                },
            ),
        )
    )
    sessions_pb2_grpc.add_SessionsServicer_to_server(Sessions(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            yield chan
    finally:
        await server.stop(grace=None)


async def _unary(channel: grpc.aio.Channel, name: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await channel.unary_unary(f"/{SERVICE}/Unary")(name.encode(), timeout=10)
    return excinfo.value


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
async def test_each_error_maps_to_its_status_code(channel: grpc.aio.Channel, cls: type[KvtierError]) -> None:
    err = await _unary(channel, cls.__name__)

    assert err.code() == EXPECTED[cls] == status_code_for(cls)
    field = f"request.field_{cls.__name__}"
    assert field in err.details()
    assert dict(err.trailing_metadata())[FIELD_METADATA_KEY] == field
    rebuilt = error_from_rpc_error(err)
    assert type(rebuilt) is cls
    assert rebuilt.field == field
    assert rebuilt.message == err.details()


async def test_errors_in_a_streaming_response_abort_after_the_sent_items(channel: grpc.aio.Channel) -> None:
    call = channel.unary_stream(f"/{SERVICE}/Stream")(b"ResourceExhausted", timeout=10)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        async for item in call:
            received.append(item)
    assert received == [b"first"]
    assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "request.field_ResourceExhausted" in excinfo.value.details()


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_unexpected_exception_is_internal_and_leaks_nothing(
    channel: grpc.aio.Channel, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kvtier.rpc.status")
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        if method == "Unary":
            await channel.unary_unary(f"/{SERVICE}/Unary")(b"unexpected", timeout=10)
        else:
            async for _ in channel.unary_stream(f"/{SERVICE}/Stream")(b"unexpected", timeout=10):
                pass
    err = excinfo.value

    assert err.code() == grpc.StatusCode.INTERNAL
    assert SECRET not in err.details() and "RuntimeError" not in err.details()
    run_id = dict(err.trailing_metadata())[RUN_ID_METADATA_KEY]
    assert run_id in err.details()
    # The server log has the whole story under the same run id.
    logged = [rec for rec in caplog.records if run_id in rec.getMessage()]
    assert logged and logged[0].exc_info is not None and SECRET in str(logged[0].exc_info[1])
    rebuilt = error_from_rpc_error(err)
    assert type(rebuilt) is KvtierError and rebuilt.code == "INTERNAL"


async def test_a_servicers_own_abort_passes_through(channel: grpc.aio.Channel) -> None:
    err = await _unary(channel, "abort-myself")
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert err.details() == "the servicer's own abort"


async def test_conversion_errors_reach_the_client_of_a_generated_service(channel: grpc.aio.Channel) -> None:
    stub = sessions_pb2_grpc.SessionsStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await stub.Pause(sessions_pb2.PauseRequest(tool_name="search"), timeout=10)
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session_id" in excinfo.value.details()
    assert error_from_rpc_error(excinfo.value).field == "session_id"

    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await stub.Pause(sessions_pb2.PauseRequest(session_id="s-1"), timeout=10)
    rebuilt = error_from_rpc_error(excinfo.value)
    assert isinstance(rebuilt, errors.NotFound) and rebuilt.field == "session_id"


async def test_unmapped_status_codes_become_a_plain_kvtier_error(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await channel.unary_unary(f"/{SERVICE}/NoSuchMethod")(b"", timeout=10)
    rebuilt = error_from_rpc_error(excinfo.value)
    assert type(rebuilt) is KvtierError
    assert str(rebuilt).startswith("UNIMPLEMENTED")


def test_rpc_errors_rejects_sync_methods() -> None:
    with pytest.raises(TypeError, match="async"):

        @rpc_errors
        def Sync(request: bytes, context: object) -> bytes:
            return request


def _details(err: grpc.aio.AioRpcError) -> dict[str, object]:
    """The google.rpc.Status details of ``err`` by message name, decoded with the standard
    packages alone (what a client in any language does)."""
    raw = dict(err.trailing_metadata())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(raw)
    assert status.code == err.code().value[0]
    assert status.message == err.details()
    out: dict[str, object] = {}
    for any_detail in status.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.ResourceInfo,
                    error_details_pb2.QuotaFailure, error_details_pb2.RetryInfo):
            if any_detail.Is(cls.DESCRIPTOR):
                msg = cls()
                any_detail.Unpack(msg)
                out[cls.__name__] = msg
    return out


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
async def test_each_error_carries_standard_rich_details(channel: grpc.aio.Channel, cls: type[KvtierError]) -> None:
    err = await _unary(channel, cls.__name__)
    details = _details(err)
    field = f"request.field_{cls.__name__}"

    info = details["ErrorInfo"]
    assert info.domain == "kvtier.dev"
    assert info.metadata["error_type"] == cls.__name__
    assert info.reason == "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(cls.__name__)).upper()
    assert [v.field for v in details["BadRequest"].field_violations] == [field]
    code = EXPECTED[cls]
    assert ("ResourceInfo" in details) is (code is grpc.StatusCode.NOT_FOUND)
    assert ("QuotaFailure" in details) is (code is grpc.StatusCode.RESOURCE_EXHAUSTED)
    retryable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert ("RetryInfo" in details) is retryable
    if retryable:
        assert details["RetryInfo"].retry_delay.seconds >= 1
    # grpcio-status, the standard Python reader, accepts the trailer as well.
    assert rpc_status.from_call(err).code == code.value[0]


async def test_the_client_reads_the_standard_form_without_the_kvtier_trailers() -> None:
    """A server that sends only google.rpc.Status (another implementation of the contract)
    still yields the right error class and field."""

    class StandardOnly:
        async def Unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            err = errors.ConfigError("config.port must be > 0", field="config.port")
            status = rich_status(err, grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err.message,
                                trailing_metadata=(("grpc-status-details-bin", status.SerializeToString()),))
            return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Unary": grpc.unary_unary_rpc_method_handler(StandardOnly().Unary)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            err = await _unary(chan, "x")
    finally:
        await server.stop(grace=None)
    assert FIELD_METADATA_KEY not in dict(err.trailing_metadata())
    rebuilt = error_from_rpc_error(err)
    assert type(rebuilt) is errors.ConfigError
    assert rebuilt.field == "config.port"


async def test_an_unexpected_error_carries_error_info_with_the_run_id(channel: grpc.aio.Channel) -> None:
    err = await _unary(channel, "unexpected")
    info = _details(err)["ErrorInfo"]
    assert info.reason == "INTERNAL"
    assert info.metadata["run_id"] == dict(err.trailing_metadata())[RUN_ID_METADATA_KEY]
    assert SECRET not in str(info)
