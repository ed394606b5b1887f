"""Every gRPC option kvtier sets is one gRPC core knows: core ignores an unknown name silently,
which once left servers at the 5-minute ping default and closed long, quiet generations with
GOAWAY too_many_pings."""

from __future__ import annotations

from pathlib import Path

import grpc._cython.cygrpc as cygrpc
import pytest

from kvtier.client.connection import CHANNEL_OPTIONS
from kvtier.rpc.server_options import SERVER_OPTIONS

CORE = Path(cygrpc.__file__).read_bytes()


@pytest.mark.parametrize("name", sorted({n for n, _ in (*SERVER_OPTIONS, *CHANNEL_OPTIONS)}))
def test_option_name_is_known_to_grpc_core(name: str) -> None:
    assert name.encode() + b"\x00" in CORE, f"gRPC core has no channel argument {name!r}"
