"""What every kvtier gRPC server shares: message limits, keepalive, binding (TLS or not), the
rule that only loopback may go unauthenticated, and its dial address."""

from __future__ import annotations

import ipaddress
import socket

import grpc
import grpc.aio

from kvtier.domain.errors import ConfigError, Unavailable
from kvtier.rpc.convert.limits import MAX_MESSAGE_BYTES

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Clients ping idle streams (WorkerLink, long generations); accept pings every 10 s. (gRPC
    # core's name for it: with an unknown name the server keeps its 5-minute default and
    # closes a connection whose stream sent nothing for a minute with GOAWAY too_many_pings.)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name (or a wildcard): others may reach it


def check_exposure(host: str, *, what: str, is_authenticated: bool, allow_unauthenticated: bool) -> None:
    """Refuse to serve every caller unauthenticated on an address other machines can reach.

    On loopback only local processes can connect, so a token table is optional there;
    elsewhere it takes a token table or the explicit ``allow_unauthenticated`` override
    (for networks where something else, e.g. a NetworkPolicy or mesh, admits callers).
    """
    if is_authenticated or allow_unauthenticated or is_loopback(host):
        return
    table = "auth_token_file" if what == "controller" else "auth_tokens_file"
    raise ConfigError(
        f"the {what} would listen on {host}, reachable from other machines, without authentication; "
        f"set {table} (--{table.replace('_', '-')}) to a token table, or pass --allow-unauthenticated "
        "(KVTIER_ALLOW_UNAUTHENTICATED=true) to accept every caller",
        field=table,
    )


def bind_port(
    server: grpc.aio.Server,
    host: str,
    port: int,
    *,
    what: str,
    port_hint: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Bind ``host:port`` (0: a free port), with TLS when ``credentials`` are given, and return
    the bound port, or raise ``Unavailable`` naming the address and how to pick another one."""
    listen = join_host_port(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(listen)
        else:
            bound = server.add_secure_port(listen, credentials)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise Unavailable(f"the {what} cannot listen on {listen}; is the port in use? pass {port_hint} for a free one")
    return bound


async def serve_health_only(health: object, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A plaintext server answering only ``grpc.health.v1`` from ``health`` (the main server's
    HealthServicer), for probes that cannot speak TLS (the kubelet's gRPC probe); and its port."""
    from grpc_health.v1 import health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = bind_port(server, host, port, what="health endpoint", port_hint="--health-port 0")
    await server.start()
    return server, bound
