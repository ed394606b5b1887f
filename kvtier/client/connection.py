"""A connection to kvtier servers: one gRPC channel per address (TLS or plaintext), the bearer
token, and unary calls under a deadline, retried with backoff on UNAVAILABLE when idempotent.

The bearer token goes to the controller and to workers' admin calls (Stats, CheckIntegrity);
Generate carries the Route ticket of its worker instead (``ticket_metadata``)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import grpc
import grpc.aio

from kvtier.domain.errors import DeadlineExceeded, InvalidArgument
from kvtier.rpc.auth import read_token_file
from kvtier.rpc.convert.limits import MAX_MESSAGE_BYTES
from kvtier.rpc.status import error_from_rpc_error
from kvtier.rpc.tls import ClientTls, secure_or_insecure_channel
from kvtier.runtime.config import ClientConfig
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.client")

T = TypeVar("T")

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Ping only while a call is open: a long stream whose worker died is noticed, and
    # servers with gRPC's default ping policy never see an idle channel ping.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
)


class Connection:
    """Channels to the controller and workers, opened lazily inside the loop that uses them, and
    the retry rule of unary calls; ``AdminClient`` and ``AsyncClient`` add the calls."""

    def __init__(
        self,
        controller: str | None = None,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.2,
        channel_options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
        tls: ClientTls | None = None,
    ) -> None:
        """``token``: the bearer token sent with every call but Generate (controller, and workers'
        admin calls). ``tls``:
        dial every server over TLS (``ClientTls``: CA, client certificate for mTLS); None:
        plaintext, which a TLS server refuses."""
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}", field="timeout_s")
        if max_retries < 0:
            raise InvalidArgument(f"max_retries must be >= 0, got {max_retries}", field="max_retries")
        self.controller = controller
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._options = tuple(channel_options)
        self._metadata: tuple[tuple[str, str], ...] | None = (
            (("authorization", f"Bearer {token}"),) if token else None
        )
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    @classmethod
    def from_config(cls, config: ClientConfig) -> Self:
        token = read_token_file(config.auth_token_file) if config.auth_token_file is not None else None
        return cls(
            config.controller_address,
            token=token,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            retry_backoff_s=config.retry_backoff_s,
            tls=ClientTls.from_files(
                config.tls_ca_file, config.tls_cert_file, config.tls_key_file, config.tls_server_name
            ),
        )

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def _controller_channel(self) -> grpc.aio.Channel:
        if not self.controller:
            raise InvalidArgument(
                "this client has no controller address; pass controller='host:port' (or worker= to generate)",
                field="controller",
            )
        return self._channel(self.controller)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = secure_or_insecure_channel(address, self._tls, self._options)
        return channel

    async def _unary(
        self,
        name: str,
        method: Callable[..., Awaitable[T]],
        message: Any,
        timeout_s: float | None,
        *,
        idempotent: bool,
    ) -> T:
        aloop = asyncio.get_running_loop()
        deadline = aloop.time() + (self.timeout_s if timeout_s is None else timeout_s)
        num_retries = 0
        while True:
            try:
                return await method(message, timeout=remaining_s(deadline, aloop), metadata=self._metadata)
            except grpc.aio.AioRpcError as err:
                retriable = idempotent and err.code() is grpc.StatusCode.UNAVAILABLE
                if not retriable or num_retries >= self.max_retries:
                    raise error_from_rpc_error(err) from err
                delay = self.retry_backoff_s * 2**num_retries * random.uniform(0.5, 1.0)
                if aloop.time() + delay >= deadline:
                    raise error_from_rpc_error(err) from err
                num_retries += 1
                log.debug("retrying after UNAVAILABLE", extra={"rpc": name, "retry": num_retries})
                await asyncio.sleep(delay)


def ticket_metadata(ticket: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata of a Generate: its worker's Route ticket, or nothing (authentication off)."""
    return (("authorization", f"Ticket {ticket}"),) if ticket else None


def remaining_s(deadline: float, aloop: asyncio.AbstractEventLoop) -> float:
    remaining = deadline - aloop.time()
    if remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before it could be sent")
    return remaining
