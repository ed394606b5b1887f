"""Sessions: the lifecycle record of one conversation/agent, in Redis (DESIGN §2, §7).

    (Route with the session id) ─► ACTIVE ──Pause──► PAUSED ──Returning──► RESUMING
                                     ▲                 │                      │
                                     └─────────── Route (next turn) ◄─────────┘
    (Pause of an unknown id) ──────────────────────► PAUSED   (no worker yet: nothing to park)
    any state ──End──► ENDED        (a Route naming an ENDED session starts it afresh)

Pause, Returning and End are idempotent in their target state (a repeat returns the
record as it is). Everything else is a broken contract: Pause of a RESUMING or ENDED
session and Returning of an ACTIVE or ENDED one fail with ``FailedPrecondition`` naming
the state; Returning or End of an id no Route or Pause named is ``NotFound``.
End keeps the session's pages as ordinary cache entries; ``EndRequest.drop`` frees them.

Storage: one hash per session, ``kvt:session:<tenant hex>:<id>`` (sessions are keyed by
tenant and id: ``kvtier.controller.session_tenancy``), rewritten on every change with an
idle TTL (``ttl_s``), so a session nobody touches expires by itself. The orchestrator
(``kvtier.controller.orchestrator``) drives the transitions and serialises them per
session; this module is the record, its Redis form and the gRPC shell.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields, replace
from typing import Protocol, cast

import grpc.aio
from redis.typing import EncodableT, FieldT

from kvtier.controller.redis_connect import RedisClient
from kvtier.controller.resync import REDIS_ERRORS, describe
from kvtier.controller.session_tenancy import SessionKey
from kvtier.domain.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvtier.domain.hashing import NamespaceDigest
from kvtier.domain.records import (
    EndRequest,
    ListSessionsRequest,
    PauseRequest,
    PredictionSource,
    ReturningRequest,
    SessionId,
    SessionInfo,
    SessionPage,
    SessionState,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.rpc._gen import sessions_pb2, sessions_pb2_grpc
from kvtier.rpc.auth import Principal
from kvtier.rpc.auth_interceptor import principal_tenant
from kvtier.rpc.convert.sessions import (
    from_proto_end_request,
    from_proto_pause_request,
    from_proto_returning_request,
    to_proto_end_response,
    to_proto_pause_response,
    to_proto_returning_response,
)
from kvtier.rpc.status import rpc_errors

KEY_PREFIX = "kvt:session:"
DEFAULT_TTL_S = 3600.0
# An ended session's record stays this long (End is idempotent, a late Pause is refused with
# a clear FAILED_PRECONDITION), then goes: an agent fleet ends sessions all day, and keeping
# each for the full idle TTL grew Redis's memory without bound in the soak.
ENDED_TTL_S = 60.0


class PrefetchState:
    """Where the promotion of a parked session stands (strings: stored in Redis as-is)."""

    NONE = "none"  # nothing parked below HBM, or nothing planned
    SCHEDULED = "scheduled"
    SENT = "sent"
    DONE = "done"


@dataclass(slots=True)
class SessionRecord:
    """One session as stored: the mutable form of ``SessionInfo`` (every one of its fields, same
    name and meaning) plus the controller's own state (tenant, namespace, parked pages, the
    prefetch's progress). ``info()`` is the public view. Times are Unix epoch ms; ``None``
    fields are not stored."""

    # SessionInfo's fields.
    session_id: SessionId
    state: SessionState
    worker_id: WorkerId | None = None
    tool_name: str | None = None
    paused_at_ms: int | None = None
    predicted_return_at_ms: int | None = None
    prediction_source: PredictionSource | None = None
    prefetch_at_ms: int | None = None
    parked_tier: Tier | None = None
    num_cached_tokens: int = 0  # tokens of the prefix the last Route named
    # The controller's own.
    tenant: str = ""
    owner: str = ""  # the credential that started it (a session without a tenant is its owner's)
    namespace_digest: NamespaceDigest | None = None
    num_parked_pages: int = 0
    prefetch_state: str = PrefetchState.NONE
    prefetch_done_at_ms: int | None = None
    is_duration_observed: bool = False  # the tool's duration went into the predictor

    def info(self) -> SessionInfo:
        """The public view: a pause's fields only while they mean something (the tool while
        paused or resuming, the source of a prediction that exists, the prefetch time while one
        is scheduled)."""
        shared = {f.name: getattr(self, f.name) for f in fields(SessionInfo)}
        return replace(
            SessionInfo(**shared),
            tool_name=self.tool_name if self.state in (SessionState.PAUSED, SessionState.RESUMING) else None,
            prediction_source=self.prediction_source if self.predicted_return_at_ms is not None else None,
            prefetch_at_ms=self.prefetch_at_ms if self.prefetch_state == PrefetchState.SCHEDULED else None,
        )

    def clear_pause(self) -> None:
        self.tool_name = self.paused_at_ms = self.predicted_return_at_ms = None
        self.prediction_source = self.prefetch_at_ms = self.parked_tier = self.prefetch_done_at_ms = None
        self.num_parked_pages = 0
        self.prefetch_state = PrefetchState.NONE
        self.is_duration_observed = False

    @property
    def key(self) -> SessionKey:
        return SessionKey(self.tenant, self.session_id)

    def require(self, *allowed: SessionState, action: str) -> None:
        if self.state not in allowed:
            raise FailedPrecondition(
                f"session {self.session_id!r} is {self.state.name}; {action} needs "
                f"{' or '.join(s.name for s in allowed)}",
                field="session_id",
            )

    # ---- Redis form -------------------------------------------------------------------
    def to_hash(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, SessionState | PredictionSource):
                out[f.name] = value.value
            elif isinstance(value, Tier):
                out[f.name] = str(int(value))
            elif isinstance(value, bytes):
                out[f.name] = value.hex()
            elif isinstance(value, bool):
                out[f.name] = "1" if value else "0"
            else:
                out[f.name] = str(value)
        return out

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> SessionRecord:
        h = {k.decode(): v.decode() for k, v in raw.items()}

        def opt_int(name: str) -> int | None:
            return int(h[name]) if name in h else None

        return cls(
            session_id=SessionId(h["session_id"]),
            state=SessionState(h["state"]),
            tenant=h.get("tenant", ""),
            owner=h.get("owner", ""),
            worker_id=WorkerId(h["worker_id"]) if "worker_id" in h else None,
            namespace_digest=NamespaceDigest(bytes.fromhex(h["namespace_digest"])) if "namespace_digest" in h
            else None,
            num_cached_tokens=int(h.get("num_cached_tokens", "0")),
            tool_name=h.get("tool_name"),
            paused_at_ms=opt_int("paused_at_ms"),
            predicted_return_at_ms=opt_int("predicted_return_at_ms"),
            prediction_source=PredictionSource(h["prediction_source"]) if "prediction_source" in h else None,
            prefetch_at_ms=opt_int("prefetch_at_ms"),
            parked_tier=Tier(int(h["parked_tier"])) if "parked_tier" in h else None,
            num_parked_pages=int(h.get("num_parked_pages", "0")),
            prefetch_state=h.get("prefetch_state", PrefetchState.NONE),
            prefetch_done_at_ms=opt_int("prefetch_done_at_ms"),
            is_duration_observed=h.get("is_duration_observed") == "1",
        )


SESSION_FETCH_BATCH = 200


def store_key(tenant: str, session: SessionId) -> str:
    """The Redis key of a session: the tenant in hex, so that no tenant or id can reach another's."""
    return f"{KEY_PREFIX}{tenant.encode().hex()}:{session}"


def _bytes_hash(raw: dict[bytes | str, bytes | str]) -> dict[bytes, bytes]:
    """An HGETALL reply: redis-py types it bytes-or-str for decode_responses, which the
    session store's client leaves off, so it is bytes."""
    return cast("dict[bytes, bytes]", raw)


class SessionStore:
    """Session records in Redis, each with an idle TTL refreshed on every write."""

    def __init__(self, client: RedisClient, *, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.client = client
        self.ttl_s = ttl_s

    async def get(self, session_id: SessionId, tenant: str = "") -> SessionRecord | None:
        """The session ``session_id`` of ``tenant`` ("" for the tenant-less one)."""
        raw = await self.client.hgetall(store_key(tenant, session_id))
        return SessionRecord.from_hash(_bytes_hash(raw)) if raw else None

    async def put(self, record: SessionRecord) -> None:
        key = store_key(record.tenant, record.session_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)  # fields that became None must go too
            fields: dict[FieldT, EncodableT] = {k: v for k, v in record.to_hash().items()}
            pipe.hset(key, mapping=fields)
            ttl_s = min(self.ttl_s, ENDED_TTL_S) if record.state is SessionState.ENDED else self.ttl_s
            pipe.pexpire(key, max(1, round(ttl_s * 1000)))
            await pipe.execute()

    async def scan(self) -> AsyncIterator[SessionRecord]:
        async for key in self.client.scan_iter(match=KEY_PREFIX + "*", count=500):
            raw = await self.client.hgetall(key)
            if raw:
                yield SessionRecord.from_hash(_bytes_hash(raw))

    async def page(self, request: ListSessionsRequest) -> SessionPage:
        """One page of sessions in (tenant, session id) order (Admin.ListSessions): the page token is
        the hex of the last session's key returned, empty when no session follows. ``Unavailable``
        without Redis."""
        after = ""
        if request.page_token:
            try:
                after = bytes.fromhex(request.page_token).decode()
            except ValueError:
                raise InvalidArgument("page_token is not a token this service returned; pass the "
                                      "next_page_token of the previous page, or none", field="page_token") from None
        try:
            keys = [key.decode() async for key in self.client.scan_iter(match=KEY_PREFIX + "*", count=500)]
            ids = sorted(k.removeprefix(KEY_PREFIX) for k in keys)  # "<tenant hex>:<id>"
            ids = [i for i in ids if i > after]
            found: list[SessionRecord] = []
            for start in range(0, len(ids), SESSION_FETCH_BATCH):  # one more than a page says if one follows
                async with self.client.pipeline(transaction=False) as pipe:
                    for suffix in ids[start:start + SESSION_FETCH_BATCH]:
                        pipe.hgetall(KEY_PREFIX + suffix)
                    raws = await pipe.execute()
                found.extend(r for r in (SessionRecord.from_hash(raw) for raw in raws if raw)
                             if request.state is None or r.state is request.state)
                if len(found) > request.limit:
                    break
        except REDIS_ERRORS as exc:
            raise Unavailable(f"the session store (Redis) is unreachable: {describe(exc)}; retry") from None
        page = found[:request.limit]
        more = len(found) > request.limit
        return SessionPage(
            sessions=tuple(r.info() for r in page),
            next_page_token=store_key(page[-1].tenant, page[-1].session_id).removeprefix(KEY_PREFIX).encode().hex()
            if more else None,
        )


class SessionHints(Protocol):
    """What the Sessions service calls (``kvtier.controller.orchestrator.Orchestrator``)."""

    async def pause(self, request: PauseRequest, *, caller: Principal | None = None) -> SessionInfo: ...

    async def returning(self, request: ReturningRequest, *, caller: Principal | None = None) -> SessionInfo: ...

    async def end(self, request: EndRequest, *, caller: Principal | None = None) -> SessionInfo: ...


class SessionsServicer(sessions_pb2_grpc.SessionsServicer):
    """Thin shell: convert, call the orchestrator, convert back (errors → status codes).

    ``check_serving`` raises ``Unavailable`` on a standby (the message names the leader),
    as Route does, so hints reach the controller that commands the workers.
    """

    def __init__(self, hints: SessionHints, check_serving: Callable[[], None] = lambda: None) -> None:
        self._hints = hints
        self._check_serving = check_serving

    @rpc_errors
    async def Pause(
        self, request: sessions_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> sessions_pb2.PauseResponse:
        self._check_serving()
        info = await self._hints.pause(from_proto_pause_request(request), caller=principal_tenant(context))
        return to_proto_pause_response(info)

    @rpc_errors
    async def Returning(
        self, request: sessions_pb2.ReturningRequest, context: grpc.aio.ServicerContext
    ) -> sessions_pb2.ReturningResponse:
        self._check_serving()
        info = await self._hints.returning(from_proto_returning_request(request), caller=principal_tenant(context))
        return to_proto_returning_response(info)

    @rpc_errors
    async def End(
        self, request: sessions_pb2.EndRequest, context: grpc.aio.ServicerContext
    ) -> sessions_pb2.EndResponse:
        self._check_serving()
        info = await self._hints.end(from_proto_end_request(request), caller=principal_tenant(context))
        return to_proto_end_response(info)
