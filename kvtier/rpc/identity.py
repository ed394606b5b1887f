"""Address proofs: the controller's check that a registering worker serves the address it
advertises (decision 0007).

    worker ── WorkerLink.Connect (bearer: worker X's token) ── Register(X, address A) ──► controller
    controller ── Worker.ProveAddress(X, A, nonce) ──► whatever serves A
              ◄─ proof = HMAC-SHA256(SHA-256(token of X), "kvtier-address-proof" ‖ X ‖ A ‖ nonce)

The controller holds only SHA-256 of each token (its table), the worker holds the token,
so both can compute the proof and nothing on the wire reveals the token. A process that
registers X with another worker's address fails: the worker at that address does not hold
X's token. Each field is length-prefixed, so no two field lists share an encoding.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

_LABEL = b"kvtier-address-proof"
NONCE_BYTES = 32
MIN_NONCE_BYTES, MAX_NONCE_BYTES = 16, 64


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _message(worker_id: str, address: str, nonce: bytes) -> bytes:
    parts = (_LABEL, worker_id.encode("utf-8"), address.encode("utf-8"), nonce)
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


def address_proof(key_digest: bytes, worker_id: str, address: str, nonce: bytes) -> bytes:
    """The proof for ``nonce``; ``key_digest`` is SHA-256 of the worker's token."""
    return hmac.new(key_digest, _message(worker_id, address, nonce), hashlib.sha256).digest()


def token_key(token: str) -> bytes:
    """The proof key a worker derives from its bearer token (what the controller's table stores)."""
    return hashlib.sha256(token.encode("utf-8")).digest()


def is_valid_proof(key_digest: bytes, worker_id: str, address: str, nonce: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(address_proof(key_digest, worker_id, address, nonce), proof)
