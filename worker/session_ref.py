"""How the worker keys a session: by namespace digest and session id (``SessionRef``).

The digest covers the namespace's tenant, so another tenant's generation under the same
session id is another session on this worker: it leaves this one's pages, hold and tally
alone. A session's hold is a radix pin whose id (``hold_id``) names both.
"""

from __future__ import annotations

from typing import NamedTuple

from kvtier.domain.hashing import NamespaceDigest
from kvtier.domain.records import PinId, SessionId

# Session holds' pin ids start with this (admin pin ids never do).
HOLD_PREFIX = "session-hold/"


class SessionRef(NamedTuple):
    """What the worker keys a session by: its namespace digest (which covers its tenant) and id."""

    digest: NamespaceDigest
    session_id: SessionId


def hold_id(session: SessionRef) -> PinId:
    """The pin id of a session's hold (admin pin ids never start with ``HOLD_PREFIX``)."""
    return PinId(f"{HOLD_PREFIX}{session.digest.hex()}/{session.session_id}")


def hold_ref(pin_id: PinId) -> SessionRef:
    """The session of a hold's pin id (``hold_id`` reversed)."""
    digest, _, session = pin_id.removeprefix(HOLD_PREFIX).partition("/")
    return SessionRef(NamespaceDigest(bytes.fromhex(digest)), SessionId(session))
