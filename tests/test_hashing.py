import hashlib

import pytest

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, next_key, page_keys, root_key, short


def test_page_keys_follow_the_documented_chain():
    ns = namespace_digest(NamespaceIdentity(model_id="m", tenant="a"))
    tokens = list(range(10))
    keys = page_keys(ns, tokens, page_size=4)
    assert len(keys) == 2  # the partial tail (tokens 8, 9) gets no key
    k0 = hashlib.blake2b(ns, digest_size=16).digest()
    k1 = hashlib.blake2b(k0 + b"".join(t.to_bytes(4, "little") for t in range(4)), digest_size=16).digest()
    k2 = hashlib.blake2b(k1 + b"".join(t.to_bytes(4, "little") for t in range(4, 8)), digest_size=16).digest()
    assert keys == [k1, k2]
    assert root_key(ns) == k0
    assert next_key(k1, range(4, 8)) == k2


def test_keys_depend_on_every_identity_field_and_on_prefix():
    base = NamespaceIdentity(model_id="m")
    variants = [
        NamespaceIdentity(model_id="m2"),
        NamespaceIdentity(model_id="m", weights_digest="w"),
        NamespaceIdentity(model_id="m", tokenizer_digest="t"),
        NamespaceIdentity(model_id="m", adapter="lora"),
        NamespaceIdentity(model_id="m", rope_config="{}"),
        NamespaceIdentity(model_id="m", kv_dtype="bf16"),
        NamespaceIdentity(model_id="m", page_size=32),
        NamespaceIdentity(model_id="m", tenant="b"),
        NamespaceIdentity(model_id="m", policy_epoch=1),
    ]
    digests = {namespace_digest(v) for v in [base, *variants]}
    assert len(digests) == len(variants) + 1
    # Field boundaries are unambiguous.
    assert namespace_digest(NamespaceIdentity(model_id="ab", adapter="c")) != namespace_digest(
        NamespaceIdentity(model_id="a", adapter="bc")
    )
    ns = namespace_digest(base)
    # Same page tokens after a different prefix give a different key.
    a = page_keys(ns, [1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = page_keys(ns, [1, 2, 3, 5, 9, 9, 9, 9], 4)
    assert a[1] != b[1]


def test_token_encoding_is_int32_not_python_hash():
    ns = namespace_digest(NamespaceIdentity(model_id="m"))
    # Large ids beyond int16 must not collide with their truncations.
    assert page_keys(ns, [70000], 1) != page_keys(ns, [70000 % 65536], 1)
    assert len(short(page_keys(ns, [1], 1)[0])) == 8


def test_identity_validation_names_the_field():
    with pytest.raises(InvalidArgument, match="namespace.model_id"):
        NamespaceIdentity(model_id="").validate()
    with pytest.raises(InvalidArgument, match="namespace.kv_dtype"):
        NamespaceIdentity(model_id="m", kv_dtype="int3").validate()
