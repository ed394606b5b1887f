"""Route tickets (kvtier.rpc.tickets) and address proofs (kvtier.rpc.identity), with a fake clock;
the interceptor's ticket path. The same rules on a running stack: tests/e2e/test_worker_identity.py."""

from __future__ import annotations

import base64
import json

import pytest

from kvtier.domain.errors import InvalidArgument, PermissionDenied, Unauthenticated, Unavailable
from kvtier.domain.records import RankedWorker, RouteDecision, WorkerId
from kvtier.rpc._gen import worker_link_pb2
from kvtier.rpc.auth import Principal, Role, TokenTable, hash_token, make_entry
from kvtier.rpc.auth_interceptor import AuthInterceptor
from kvtier.rpc.convert.link_commands import from_proto_ticket_key_command
from kvtier.rpc.identity import address_proof, is_valid_proof, new_nonce, token_key
from kvtier.rpc.tickets import TicketSigner, TicketVerifier

GENERATE = "/kvtier.v1.Worker/Generate"


class Clock:
    def __init__(self, now_s: float = 1_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def verifier_for(signer: TicketSigner, worker_id: str, clock: Clock) -> TicketVerifier:
    verifier = TicketVerifier(worker_id, clock=clock)
    verifier.install(signer.key_for(worker_id))
    return verifier


def test_a_ticket_verifies_on_its_worker_and_stands_for_a_frontend_of_its_tenant():
    clock = Clock()
    signer = TicketSigner(ttl_s=30, clock=clock)
    ticket = verifier_for(signer, "w-x", clock).verify(signer.issue("w-x", "acme"))
    assert (ticket.worker_id, ticket.tenant) == ("w-x", "acme")
    assert ticket.principal == Principal("ticket:w-x", Role.FRONTEND, frozenset({"acme"}))
    assert ticket.principal.tenant_for("") == "acme"
    with pytest.raises(PermissionDenied):
        ticket.principal.tenant_for("other")


def test_a_ticket_for_another_worker_is_refused_and_keys_differ_per_worker():
    clock = Clock()
    signer = TicketSigner(clock=clock)
    assert signer.key_for("w-x") != signer.key_for("w-y")
    with pytest.raises(PermissionDenied, match="for worker 'w-x', not this worker"):
        verifier_for(signer, "w-y", clock).verify(signer.issue("w-x", "acme"))
    # Relabelled for w-y, the MAC (made with w-x's key) does not verify under w-y's key.
    ticket = signer.issue("w-x", "acme")
    body, mac = ticket.removeprefix("kvtt_").split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    payload["w"] = "w-y"
    forged = "kvtt_" + base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode() + "." + mac
    with pytest.raises(Unauthenticated, match="signature does not verify"):
        verifier_for(signer, "w-y", clock).verify(forged)


def test_an_expired_ticket_is_refused():
    clock = Clock()
    signer = TicketSigner(ttl_s=30, clock=clock)
    verifier = verifier_for(signer, "w-x", clock)
    ticket = signer.issue("w-x", "acme")
    clock.now_s += 29.9
    assert verifier.verify(ticket).tenant == "acme"
    clock.now_s += 0.2
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.verify(ticket)


def test_another_controllers_ticket_and_garbage_are_refused_and_no_key_is_unavailable():
    clock = Clock()
    ours, theirs = TicketSigner(clock=clock), TicketSigner(clock=clock)
    verifier = verifier_for(ours, "w-x", clock)
    with pytest.raises(Unauthenticated, match="signature"):
        verifier.verify(theirs.issue("w-x", "acme"))
    for garbage in ("", "kvt_bearer", "kvtt_", "kvtt_a.b", "kvtt_!!.??", "kvtt_" + "a" * 2000 + ".b"):
        with pytest.raises(Unauthenticated, match="malformed"):
            verifier.verify(garbage)
    with pytest.raises(Unavailable, match="not registered"):
        TicketVerifier("w-x").verify(ours.issue("w-x", "acme"))


def test_with_tickets_gives_each_ranked_worker_its_own():
    clock = Clock()
    signer = TicketSigner(clock=clock)
    decision = signer.with_tickets(RouteDecision((RankedWorker(WorkerId("w-x"), "h:1", 1.0),
                                                  RankedWorker(WorkerId("w-y"), "h:2", 0.5))), "acme")
    x, y = decision.workers
    assert verifier_for(signer, "w-x", clock).verify(x.ticket).worker_id == "w-x"
    assert verifier_for(signer, "w-y", clock).verify(y.ticket).worker_id == "w-y"
    assert x.ticket not in repr(decision)  # tickets stay out of logs


def test_a_ticket_key_command_carries_exactly_32_bytes():
    for key in (b"", b"k" * 31, b"k" * 33):
        with pytest.raises(InvalidArgument) as info:
            from_proto_ticket_key_command(worker_link_pb2.TicketKeyCommand(key=key))
        assert info.value.field == "ticket_key.key"
    assert from_proto_ticket_key_command(worker_link_pb2.TicketKeyCommand(key=b"k" * 32)).key == b"k" * 32
    assert "kkkk" not in repr(from_proto_ticket_key_command(worker_link_pb2.TicketKeyCommand(key=b"k" * 32)))


def test_address_proofs_bind_the_token_id_address_and_nonce():
    key = token_key("kvt_worker-x")
    assert key == bytes.fromhex(hash_token("kvt_worker-x"))  # what the controller's table stores
    nonce = new_nonce()
    proof = address_proof(key, "w-x", "10.0.0.1:5", nonce)
    assert is_valid_proof(key, "w-x", "10.0.0.1:5", nonce, proof)
    assert not is_valid_proof(key, "w-y", "10.0.0.1:5", nonce, proof)
    assert not is_valid_proof(key, "w-x", "10.0.0.2:5", nonce, proof)
    assert not is_valid_proof(key, "w-x", "10.0.0.1:5", new_nonce(), proof)
    assert not is_valid_proof(token_key("kvt_other"), "w-x", "10.0.0.1:5", nonce, proof)


def test_the_interceptor_takes_tickets_on_generate_and_refuses_bearer_tokens():
    clock = Clock()
    signer = TicketSigner(clock=clock)
    table = TokenTable([make_entry("fe", "frontend", ["acme"], hash_token("kvt_fe"))])
    interceptor = AuthInterceptor(table, server="worker", tickets=verifier_for(signer, "w-x", clock))
    caller = interceptor.authorize(GENERATE, (("authorization", f"Ticket {signer.issue('w-x', 'acme')}"),))
    assert caller.tenants == frozenset({"acme"})
    with pytest.raises(Unauthenticated, match="never a bearer token; got a bearer token") as info:
        interceptor.authorize(GENERATE, (("authorization", "Bearer kvt_fe"),))
    assert "kvt_fe" not in info.value.message
    with pytest.raises(Unauthenticated, match="got no ticket"):
        interceptor.authorize(GENERATE, ())
    # Bearer tokens still serve every other method.
    assert interceptor.authorize("/kvtier.v1.Router/Route", (("authorization", "Bearer kvt_fe"),)).name == "fe"
