"""Who may register as which worker, and where (decision 0007).

With authentication on, a WorkerLink registration is admitted only when

1. the stream's token is bound to the registration's worker id (``worker_id`` of its
   token-table entry): a worker token registers that one id and no other;
2. no live stream of that id was opened with another credential: a second stream under
   another token is refused and logged (token names only), while the same credential may
   replace its own stream (a worker reconnecting before its old stream timed out);
3. the advertised address proves it serves that worker: the controller calls
   ``Worker.ProveAddress`` there with a fresh nonce, and the answer must be the HMAC only
   the holder of the worker's token can compute (``kvtier.rpc.identity``).

Page events ride on the admitted stream, so they are only ever filed under the id its
credential names. After admission the worker's first command carries its Route-ticket key
(``kvtier.rpc.tickets``). With authentication off every registration stands as sent.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import grpc
import grpc.aio

from kvtier.controller.link_session import LinkSession, quiet
from kvtier.domain.errors import PermissionDenied
from kvtier.domain.records import Registration, TicketKeyCommand, WorkerId
from kvtier.rpc._gen import worker_pb2, worker_pb2_grpc
from kvtier.rpc.auth import Principal
from kvtier.rpc.identity import is_valid_proof, new_nonce
from kvtier.rpc.tickets import TicketSigner
from kvtier.rpc.tls import ClientTls, secure_or_insecure_channel
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.identity")

PROOF_TIMEOUT_S = 5.0


class WorkerIdentity:
    """Admits registrations (``admit``) and hands admitted workers their ticket key (``welcome``).

    ``tls``: how to dial workers for the address proof (their CA, and this controller's
    certificate for workers that require one); None dials plaintext.
    """

    def __init__(self, tickets: TicketSigner, *, tls: ClientTls | None = None,
                 proof_timeout_s: float = PROOF_TIMEOUT_S) -> None:
        self.tickets = tickets
        self._tls = tls
        self._proof_timeout_s = proof_timeout_s
        self.counters: collections.Counter[str] = collections.Counter()

    async def admit(self, registration: Registration, caller: Principal | None,
                    sessions: Mapping[WorkerId, LinkSession]) -> None:
        """Return when ``caller`` may register ``registration``; else raise ``PermissionDenied``.

        ``sessions``: the open streams by worker id, read after the address proof, so nothing
        awaits between this check and the caller opening its stream.
        """
        if caller is None:
            return
        worker = registration.worker_id
        if caller.worker_id != worker:
            self._refuse("wrong_id", caller, registration)
            raise PermissionDenied(
                f"token {caller.name!r} may register worker {caller.worker_id!r} only, not {worker!r}; "
                "each worker registers with its own token", field="register.worker_id")
        failure = await self._address_failure(registration, caller.key_digest)
        if failure is not None:
            self._refuse("address_unproven", caller, registration)
            raise PermissionDenied(
                f"address {registration.address} did not prove that it serves worker {worker!r} "
                f"(Worker.ProveAddress: {failure}); advertise the worker's own address, reachable from "
                "the controller (over TLS when the controller has tls_ca_file)", field="register.address")
        live = sessions.get(worker)
        if live is not None and not live.closed and live.credential != caller.name:
            self._refuse("second_stream", caller, registration, live_credential=live.credential)
            raise PermissionDenied(
                f"worker {worker!r} is connected with another credential; a second stream under "
                f"token {caller.name!r} is refused", field="register.worker_id")

    def welcome(self, session: LinkSession) -> None:
        """Queue the worker's Route-ticket key: the first command of an admitted stream."""
        key = self.tickets.key_for(session.worker_id)
        session.send(TicketKeyCommand(key)).add_done_callback(quiet)

    async def _address_failure(self, registration: Registration, key_digest: bytes) -> str | None:
        """None when the address answers with the right proof; else what went wrong."""
        nonce = new_nonce()
        request = worker_pb2.ProveAddressRequest(worker_id=registration.worker_id, address=registration.address,
                                                 nonce=nonce)
        try:
            async with secure_or_insecure_channel(registration.address, self._tls, ()) as channel:
                reply = await worker_pb2_grpc.WorkerStub(channel).ProveAddress(
                    request, timeout=self._proof_timeout_s)
        except grpc.aio.AioRpcError as err:
            return f"the call failed with {err.code().name}"
        if not is_valid_proof(key_digest, registration.worker_id, registration.address, nonce, reply.proof):
            return "the proof does not match the token"
        return None

    def _refuse(self, reason: str, caller: Principal, registration: Registration, **extra: object) -> None:
        self.counters[f"refused.{reason}"] += 1
        log.warning("worker registration refused", extra={
            "reason": reason, "credential": caller.name, "worker_id": registration.worker_id,
            "address": registration.address, **extra})
