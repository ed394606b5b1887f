"""Route tickets: what a frontend shows a worker instead of its bearer token (decision 0007).

    frontend ── Route (bearer) ──► controller: ranks workers, signs one ticket per worker
             ◄─ [(worker X, address, ticket_X), ...]
    frontend ── Generate (authorization: Ticket ticket_X) ──► worker X: checks the MAC with
                                                              its own key, the worker id,
                                                              the expiry; binds the tenant

A ticket is ``kvtt_<payload>.<mac>``, both URL-safe base64 without padding. The payload is
compact JSON ``{"w": worker id, "t": tenant, "x": expiry (Unix ms)}``; the MAC is
HMAC-SHA256 of the payload bytes under the worker's *ticket key*. The controller derives
each worker's key from its own master key, ``HMAC(master, "kvtier-ticket-key/" + worker
id)``, and hands it to that worker alone, over the authenticated WorkerLink stream after
the worker proved its id and address. So worker Y, whose key differs from X's, can neither
verify nor mint a ticket for X, and a ticket caught by a fake worker is worth nothing
anywhere else, nor after its expiry.

Expiry is wall-clock time on both ends; the TTL (``ControllerConfig.route_ticket_ttl_s``)
absorbs ordinary clock skew. A ticket is checked when a Generate starts; a stream that
started in time runs to its end.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.domain.errors import InvalidArgument, PermissionDenied, Unauthenticated, Unavailable
from kvtier.domain.records import RouteDecision
from kvtier.rpc.auth import Principal, Role
from kvtier.rpc.convert.limits import TICKET_KEY_BYTES as KEY_BYTES

TICKET_PREFIX = "kvtt_"
MAX_TICKET_CHARS = 1024
_KEY_LABEL = b"kvtier-ticket-key/"
MAX_CACHED_KEYS = 4096


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Ticket:
    """A verified ticket: the worker it is for, the tenant it acts for, when it lapses."""

    worker_id: str
    tenant: str
    expires_at_ms: int

    @property
    def principal(self) -> Principal:
        """The caller a ticket stands for on its worker: a frontend of exactly its tenant, so
        ``resolve_tenant`` binds a Generate's namespace as for the frontend that routed it."""
        return Principal(f"ticket:{self.worker_id}", Role.FRONTEND, frozenset({self.tenant}))


class TicketSigner:
    """The controller's side: derives each worker's ticket key and signs tickets.

    ``master_key``: random per controller process (``secrets.token_bytes``) unless given.
    Workers take their key from the leader they link to, and Route is answered only by the
    leader, so every ticket a worker sees was signed with the key it holds.
    """

    def __init__(self, master_key: bytes | None = None, *, ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise InvalidArgument(f"route_ticket_ttl_s must be > 0, got {ttl_s}", field="route_ticket_ttl_s")
        self._master = master_key if master_key is not None else secrets.token_bytes(KEY_BYTES)
        self.ttl_s = ttl_s
        self._clock = clock
        self._keys: dict[str, bytes] = {}  # derived once per worker id (Route signs one ticket per ranked worker)

    def key_for(self, worker_id: str) -> bytes:
        """The key worker ``worker_id`` verifies its tickets with (and no other worker has)."""
        key = self._keys.get(worker_id)
        if key is None:
            if len(self._keys) >= MAX_CACHED_KEYS:
                self._keys.clear()
            key = self._keys[worker_id] = hmac.new(
                self._master, _KEY_LABEL + worker_id.encode("utf-8"), hashlib.sha256).digest()
        return key

    def issue(self, worker_id: str, tenant: str) -> str:
        expires_at_ms = int((self._clock() + self.ttl_s) * 1000)
        payload = json.dumps({"w": worker_id, "t": tenant, "x": expires_at_ms},
                             separators=(",", ":"), sort_keys=True).encode("utf-8")
        mac = hmac.new(self.key_for(worker_id), payload, hashlib.sha256).digest()
        return f"{TICKET_PREFIX}{_b64(payload)}.{_b64(mac)}"

    def with_tickets(self, decision: RouteDecision, tenant: str) -> RouteDecision:
        """``decision`` with a ticket for each ranked worker, for ``tenant``."""
        workers = tuple(dataclasses.replace(w, ticket=self.issue(w.worker_id, tenant)) for w in decision.workers)
        return dataclasses.replace(decision, workers=workers)


class TicketVerifier:
    """The worker's side: its own id, and the key its controller sent (None until then)."""

    def __init__(self, worker_id: str, *, clock: Callable[[], float] = time.time) -> None:
        self.worker_id = worker_id
        self._key: bytes | None = None
        self.clock = clock

    @property
    def has_key(self) -> bool:
        return self._key is not None

    def install(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"ticket_key.key must be {KEY_BYTES} bytes, got {len(key)}", field="ticket_key.key")
        self._key = key

    def verify(self, text: str) -> Ticket:
        """The ticket ``text`` carries, or raise: ``Unauthenticated`` for a malformed, forged or
        expired ticket, ``PermissionDenied`` for one issued for another worker, ``Unavailable``
        while this worker has no key yet (its controller link has not registered)."""
        if self._key is None:
            raise Unavailable(
                f"worker {self.worker_id!r} cannot check Route tickets yet: it has not registered with "
                "its controller; retry, or route to another worker"
            )
        if len(text) > MAX_TICKET_CHARS or not text.startswith(TICKET_PREFIX) or text.count(".") != 1:
            raise Unauthenticated("the Route ticket is malformed; send the ticket Router.Route returned")
        body, _, mac_text = text[len(TICKET_PREFIX):].partition(".")
        try:
            payload, mac = _unb64(body), _unb64(mac_text)
            fields = json.loads(payload)
            worker_id, tenant, expires_at_ms = fields["w"], fields["t"], fields["x"]
        except (binascii.Error, ValueError, KeyError, TypeError):
            raise Unauthenticated("the Route ticket is malformed; send the ticket Router.Route returned") from None
        if not (isinstance(worker_id, str) and isinstance(tenant, str) and isinstance(expires_at_ms, int)):
            raise Unauthenticated("the Route ticket is malformed; send the ticket Router.Route returned")
        if worker_id != self.worker_id:
            raise PermissionDenied(
                f"the Route ticket is for worker {worker_id!r}, not this worker ({self.worker_id!r}); "
                "send each worker the ticket Route returned for it"
            )
        expected = hmac.new(self._key, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, mac):
            raise Unauthenticated(
                "the Route ticket's signature does not verify on this worker (forged, or signed by "
                "another controller); call Router.Route for a fresh one"
            )
        late_s = self.clock() - expires_at_ms / 1000
        if late_s > 0:
            raise Unauthenticated(f"the Route ticket expired {late_s:.1f} s ago; call Router.Route for a fresh one")
        return Ticket(worker_id, tenant, expires_at_ms)
