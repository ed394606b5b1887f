"""A Route's request, decoded and its prefix hashed off the controller's event loop.

A 1,048,576-token Route is 3-5 MiB on the wire; decoding it, checking its token ids and
chaining 65,536 page keys takes a CPU core several hundred milliseconds in Python. On the
event loop that is time every other caller's Route waits. So a Route whose request is over
``INLINE_BYTES`` goes, still as bytes, to a process pool (``HASHING_PROCESSES`` processes,
started on the first one): the pool decodes it, binds its namespace to the caller's tenant
and the current policy epoch (``Router.resolve_namespace``'s rule, from the caller and a copy of
the epoch table), and hands back the request with its prefix as page keys under that
namespace. The event loop only passes bytes in and keys out, and the router looks the keys up
as it does any page-key prefix. Smaller requests are decoded on the loop: a pool round trip
costs more than they do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os

from kvtier.cache.epochs import EpochTable
from kvtier.domain.hashing import PackedKeys, namespace_digest, page_keys
from kvtier.domain.records import PageKeyPrefix, RouteRequest, TokenPrefix
from kvtier.rpc._gen import router_pb2
from kvtier.rpc.auth import Principal, bind_tenant
from kvtier.rpc.convert.router import from_proto_route_request
from kvtier.rpc.status import decode_request
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.route_hashing")

INLINE_BYTES = 64 << 10  # ~16k tokens: decoded and hashed on the event loop below this
HASHING_PROCESSES = max(1, min(4, (os.cpu_count() or 2) // 2))


def decode_route(raw: bytes) -> RouteRequest:
    """The Route request in ``raw`` (``InvalidArgument`` naming the field when it is not one)."""
    return from_proto_route_request(decode_request(router_pb2.RouteRequest.FromString, raw))


def hashed_route(raw: bytes, caller: Principal | None, epochs: EpochTable) -> RouteRequest:
    """``raw`` decoded, with a token prefix turned into its page keys under the namespace the
    router will resolve (the caller's tenant, the epoch in ``epochs``). Runs in the pool."""
    request = decode_route(raw)
    if not isinstance(request.prefix, TokenPrefix):
        return request
    namespace = epochs.apply(bind_tenant(request.namespace, caller))
    keys = page_keys(namespace_digest(namespace), request.prefix.token_ids, namespace.page_size)
    # One bytes object back across the process boundary: unpickling 65,536 keys one by one would
    # hold the controller's GIL for tens of milliseconds.
    return RouteRequest(request.namespace, PageKeyPrefix(PackedKeys(b"".join(keys))), request.session_id)


class RouteHashing:
    """Decodes Route requests: small ones here, large ones in a process pool (module doc)."""

    def __init__(self, *, inline_bytes: int = INLINE_BYTES, num_processes: int = HASHING_PROCESSES) -> None:
        self.inline_bytes = inline_bytes
        self.num_processes = num_processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._is_pool_broken = False

    async def request(self, raw: bytes, caller: Principal | None, epochs: EpochTable) -> RouteRequest:
        if len(raw) <= self.inline_bytes:
            return decode_route(raw)
        if self._pool is None and not self._is_pool_broken:
            # spawn: the controller has gRPC's threads running, and a forked child can deadlock.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.num_processes, mp_context=multiprocessing.get_context("spawn"))
        if self._pool is not None:
            try:
                return await asyncio.get_running_loop().run_in_executor(self._pool, hashed_route, raw, caller, epochs)
            except (RuntimeError, concurrent.futures.BrokenExecutor) as exc:
                # No process could start (a program embedding the controller without the
                # ``if __name__ == "__main__"`` guard spawn needs) or one died: hash in a thread,
                # still off the event loop, though sharing its interpreter lock.
                log.warning("route hashing processes unavailable; hashing in a thread", extra={"reason": str(exc)})
                self.close()
                self._is_pool_broken = True
        return await asyncio.to_thread(hashed_route, raw, caller, epochs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
