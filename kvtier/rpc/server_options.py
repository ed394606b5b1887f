"""What every kvtier gRPC server shares: message limits, keepalive, and its dial address."""

from __future__ import annotations

import socket

import grpc

from kvtier.errors import Unavailable
from kvtier.rpc.convert import MAX_MESSAGE_BYTES

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Clients ping idle streams (WorkerLink, long generations); accept pings every 10 s.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def advertised_host(host: str) -> str:
    """The host others should dial: the listen host, or this machine's address for a wildcard."""
    if host not in ("0.0.0.0", "::", "[::]", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def bind_insecure(server: grpc.aio.Server, host: str, port: int, *, what: str, port_hint: str) -> int:
    """Bind ``host:port`` (0: a free port) and return the bound port, or raise ``Unavailable``
    naming the address and how to pick another one."""
    listen = join_host_port(host, port)
    try:
        bound = server.add_insecure_port(listen)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise Unavailable(f"the {what} cannot listen on {listen}; is the port in use? pass {port_hint} for a free one")
    return bound
