"""Bearer-token authentication on every kvtier gRPC server, and who the caller is (DESIGN §8).

    client ── authorization: Bearer <token> ──► AuthInterceptor ──► servicer
                                                   │ token → Principal (kvtier.rpc.auth.TokenTable)
                                                   │ method → roles (METHOD_ROLES)
                                                   ├─ no / malformed header, unknown token → UNAUTHENTICATED
                                                   ├─ role not allowed for the method    → PERMISSION_DENIED
                                                   └─ else: the servicer runs with the Principal set

``grpc.health.v1``, server reflection and ``Worker.ProveAddress`` need no token (probes,
tooling, and the controller's address check, whose answer proves a credential without
revealing it). Every other method must be listed in ``METHOD_ROLES``; an unlisted one is
refused for every caller, so a new RPC cannot slip through unprotected (a test walks the
generated descriptors).

``Worker.Generate`` takes no bearer token at all: it takes ``authorization: Ticket <ticket>``,
the Route ticket the controller signed for this worker (``kvtier.rpc.tickets``), so a
frontend's long-lived credential never reaches a worker. The ticket stands for a frontend
of exactly the tenant it names.

grpc.aio interceptors cannot hand values to servicers, so the interceptor wraps the
method's behaviour: the wrapper sets a context variable for the task that runs the call,
and ``principal_tenant(context)`` / ``principal_name(context)`` read it. Without an
interceptor (authentication off) both say so: None and "anonymous". The token itself is
never logged nor echoed in an error.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
import grpc.aio

from kvtier.domain.errors import KvtierError, PermissionDenied, Unauthenticated
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.rpc.auth import Principal, Role, TokenTable, TokenTableFile, bind_tenant
from kvtier.rpc.status import abort_with
from kvtier.rpc.tickets import TicketVerifier
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.rpc.auth")

AUTHORIZATION = "authorization"
ANONYMOUS = "anonymous"
PUBLIC_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})
PUBLIC_METHODS = frozenset({"/kvtier.v1.Worker/ProveAddress"})
TICKET_METHODS = frozenset({"/kvtier.v1.Worker/Generate"})
"""Methods that take a Route ticket (``authorization: Ticket <ticket>``) and no bearer token."""

_FRONTEND = frozenset({Role.FRONTEND, Role.ADMIN})
_ADMIN = frozenset({Role.ADMIN})
_WORKER = frozenset({Role.WORKER})
_ADMIN_METHODS = ("Status", "ListWorkers", "ListSessions", "Lookup", "Invalidate", "Drain", "Pin", "Unpin",
                  "Evict", "SetPolicy", "GetPolicy", "PolicyHistory", "RollbackPolicy", "Snapshot")
_RULES: dict[str, Mapping[str, frozenset[Role]]] = {
    "kvtier.v1.Router": {"Route": _FRONTEND, "ListModels": _FRONTEND},
    "kvtier.v1.Sessions": {"Pause": _FRONTEND, "Returning": _FRONTEND, "End": _FRONTEND},
    "kvtier.v1.Worker": {"Generate": frozenset({Role.FRONTEND}), "Stats": _ADMIN, "CheckIntegrity": _ADMIN},
    "kvtier.v1.WorkerLink": {"Connect": _WORKER},
    "kvtier.v1.Admin": dict.fromkeys(_ADMIN_METHODS, _ADMIN),
}
METHOD_ROLES: Mapping[str, frozenset[Role]] = {
    f"/{service}/{method}": roles for service, methods in _RULES.items() for method, roles in methods.items()
}
"""Full method name (``/kvtier.v1.Admin/Status``) → the roles that may call it."""

_caller: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("kvtier_principal", default=None)


def is_public(method: str) -> bool:
    if method in PUBLIC_METHODS:
        return True
    return method.split("/")[1] in PUBLIC_SERVICES if method.count("/") >= 2 else False


def required_roles(method: str) -> frozenset[Role]:
    """The roles that may call ``method``; empty for a method nobody listed (refused to all)."""
    return METHOD_ROLES.get(method, frozenset())


def _short(method: str) -> str:
    """``/kvtier.v1.Admin/Status`` → ``Admin.Status``, as errors name methods."""
    _, service, name = (method.split("/") + ["", ""])[:3]
    return f"{service.rsplit('.', 1)[-1]}.{name}"


# -- who is calling (servicers) ------------------------------------------------------------------


def current_principal() -> Principal | None:
    """The authenticated caller of the call being served; None while authentication is off."""
    return _caller.get()


def principal_tenant(context: grpc.aio.ServicerContext | None = None) -> Principal | None:
    """The caller whose tenants bound what a request may name (pass it to ``resolve_tenant``);
    None while authentication is off, and the payload's tenant stands."""
    return _caller.get()


def principal_name(context: grpc.aio.ServicerContext | None = None) -> str:
    """The caller's token name for audit fields (``set_by``); "anonymous" while auth is off."""
    caller = _caller.get()
    return caller.name if caller is not None else ANONYMOUS


def resolve_tenant(namespace: NamespaceIdentity, caller: Principal | None) -> NamespaceIdentity:
    """``namespace`` with the tenant the caller may act for (``Principal.tenant_for``): a frontend
    naming another tenant → PERMISSION_DENIED (field ``namespace.tenant``); naming none → its
    only tenant; an admin → any. Unchanged while authentication is off."""
    return bind_tenant(namespace, caller)


# -- the interceptor ----------------------------------------------------------------------------


def bearer_token(metadata: Any) -> str | None:
    """The token of the ``authorization: Bearer <token>`` header, or None when absent or malformed."""
    scheme, token = _authorization(metadata)
    return token if scheme == "bearer" else None


def _authorization(metadata: Any) -> tuple[str, str | None]:
    """(lowercase scheme, credential) of the ``authorization`` header; ("", None) when absent,
    (scheme, None) when the credential is empty."""
    for key, value in metadata or ():
        if key.lower() != AUTHORIZATION:
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        scheme, _, credential = value.strip().partition(" ")
        return scheme.lower(), credential.strip() or None
    return "", None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every non-public call against a token table and checks the method's roles."""

    def __init__(self, tokens: TokenTable | TokenTableFile, *, server: str = "server",
                 tickets: TicketVerifier | None = None) -> None:
        self._tokens = tokens
        self._server = server
        self._tickets = tickets

    def authorize(self, method: str, metadata: Any) -> Principal:
        """The caller's principal, or raise ``Unauthenticated`` / ``PermissionDenied``."""
        if method in TICKET_METHODS:
            return self._authorize_ticket(method, metadata)
        token = bearer_token(metadata)
        if token is None:
            raise Unauthenticated(
                f"{_short(method)} needs a bearer token: send 'authorization: Bearer <token>' metadata "
                "(kvtier CLI: --token or KVTIER_TOKEN; config: auth_token_file)"
            )
        caller = self._tokens.authenticate(token)
        if caller is None:
            raise Unauthenticated(
                f"the bearer token sent to {_short(method)} is not valid on this {self._server} "
                "(unknown or revoked)"
            )
        allowed = required_roles(method)
        if caller.role not in allowed:
            needs = " or ".join(sorted(r.value for r in allowed)) or "a role no token has (the method is unmapped)"
            raise PermissionDenied(
                f"{_short(method)} needs role {needs}; token {caller.name!r} has role {caller.role.value}"
            )
        return caller

    def _authorize_ticket(self, method: str, metadata: Any) -> Principal:
        scheme, ticket = _authorization(metadata)
        if scheme != "ticket" or ticket is None:
            sent = "a bearer token" if scheme == "bearer" else "no ticket"
            raise Unauthenticated(
                f"{_short(method)} takes the Route ticket Router.Route returned for this worker "
                f"('authorization: Ticket <ticket>'), never a bearer token; got {sent}"
            )
        if self._tickets is None:
            raise Unauthenticated(f"this {self._server} checks no Route tickets, so {_short(method)} is refused")
        return self._tickets.verify(ticket).principal

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_public(method):
            return handler
        try:
            caller = self.authorize(method, handler_call_details.invocation_metadata)
        except KvtierError as err:
            log.info("call refused", extra={"method": _short(method), "code": err.code})
            return _refusing(handler, err)
        return _rewrap(handler, lambda behavior: _as_caller(behavior, caller), keep_deserializer=True)


def _as_caller(behavior: Callable[..., Any], caller: Principal) -> Callable[..., Any]:
    """``behavior`` run with ``caller`` as the current principal (same kind: coroutine or async gen)."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            token = _caller.set(caller)
            try:
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            finally:
                with contextlib.suppress(ValueError):  # closed from another context
                    _caller.reset(token)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = _caller.set(caller)
        try:
            return await behavior(request, context)
        finally:
            _caller.reset(token)

    return call


def _refusing(handler: grpc.RpcMethodHandler, err: KvtierError) -> grpc.RpcMethodHandler:
    """A handler of the same shape that aborts with ``err`` without reading the request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort_with(context, err)

    return _rewrap(handler, lambda _behavior: refuse, keep_deserializer=False)


def _rewrap(
    handler: grpc.RpcMethodHandler,
    transform: Callable[[Callable[..., Any]], Callable[..., Any]],
    *,
    keep_deserializer: bool,
) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer if keep_deserializer else None
    encode = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(transform(handler.stream_stream), decode, encode)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(transform(handler.stream_unary), decode, encode)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(transform(handler.unary_stream), decode, encode)
    return grpc.unary_unary_rpc_method_handler(transform(handler.unary_unary), decode, encode)


def server_interceptors(
    tokens: TokenTable | TokenTableFile | None, *, server: str, tickets: TicketVerifier | None = None,
) -> tuple[AuthInterceptor, ...]:
    """The auth interceptor to install first on a server, or none while authentication is off."""
    return (AuthInterceptor(tokens, server=server, tickets=tickets),) if tokens is not None else ()
