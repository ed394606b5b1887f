"""The directory's integrity check: every record and counter of a namespace recomputed from
its page values (``controller/directory.py``'s module docstring has the layout). For tests and
the admin CLI, never on a request path."""

from __future__ import annotations

import collections

from kvtier.controller.directory_scripts import RECORD_BYTES, meta_key, ns_key
from kvtier.controller.redis_connect import RedisClient
from kvtier.domain.errors import IntegrityError
from kvtier.domain.hashing import NamespaceDigest


async def _integrity_snapshot(
    client: RedisClient, namespace: NamespaceDigest
) -> tuple[int, dict[bytes, bytes], set[int], dict[int, set[bytes]], dict[bytes, bytes], list[bytes | None]]:
    """One consistent view of a namespace's current epoch for ``check_integrity``: (epoch, page
    values, holder set, each holder's and record owner's index, counters, structure counters).

    Read in one MULTI / EXEC, since the scripts change these keys together: read one by one,
    a worker's last records and its holder-set entry removed in between (``drop_worker``)
    look like records without a holder. The indexes to read are those of the holders and
    record owners seen by the previous attempt; a new one appearing meanwhile means another try.
    """
    meta = meta_key(namespace)
    wids: set[int] = set()
    for _ in range(8):
        epoch = int(await client.hget(meta, "epoch") or 1)
        order = sorted(wids)
        async with client.pipeline(transaction=True) as pipe:
            pipe.hget(meta, "epoch")
            pipe.hgetall(ns_key(namespace, f"p:{epoch}"))
            pipe.smembers(ns_key(namespace, f"ws:{epoch}"))
            pipe.hgetall(ns_key(namespace, f"c:{epoch}"))
            pipe.hmget(meta, "orphans", "inversions")
            for wid in order:
                pipe.smembers(ns_key(namespace, f"w:{epoch}:{wid}"))
            now_epoch, values, listed, counters, structure, *stored = await pipe.execute()
        listed = {int(w) for w in listed}
        owners = {int.from_bytes(v[p:p + 3], "little")
                  for v in values.values() for p in range(16, len(v) - RECORD_BYTES + 1, RECORD_BYTES)}
        if int(now_epoch or 1) == epoch and listed | owners <= wids:
            return epoch, values, listed, dict(zip(order, stored, strict=True)), counters, structure
        wids |= listed | owners
    raise IntegrityError(f"namespace {namespace[:4].hex()} kept changing while its integrity was read")

async def check_integrity(client: RedisClient, namespace: NamespaceDigest) -> None:
    """Recompute every record and counter of ``namespace``'s current epoch from the page values
    and compare; raises ``IntegrityError`` with the numbers. O(namespace)."""
    epoch, values, listed, indexes, counters, structure = await _integrity_snapshot(client, namespace)
    nodes: dict[bytes, tuple[bytes, dict[int, list[int]]]] = {}
    for key, value in values.items():
        if len(value) <= 16 or (len(value) - 16) % RECORD_BYTES:
            raise IntegrityError(f"page {key[:4].hex()}: value of {len(value)} bytes")
        recs: dict[int, list[int]] = {}
        for p in range(16, len(value), RECORD_BYTES):
            wid = int.from_bytes(value[p:p + 3], "little")
            if recs and wid <= max(recs):
                raise IntegrityError(f"page {key[:4].hex()}: worker ids not ascending at {wid}")
            recs[wid] = [value[p + 3]] + [int.from_bytes(value[q:q + 3], "little")
                                          for q in (p + 4, p + 7, p + 10)]
        nodes[key] = (value[:16], recs)

    def fastest(mask: int) -> int:
        return 0 if not mask else 1 if mask & 1 else 2 if mask & 2 else 3

    want: collections.Counter[str] = collections.Counter()
    children: dict[tuple[bytes, int], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    index: dict[int, set[bytes]] = collections.defaultdict(set)
    for key, (parent, recs) in nodes.items():
        held = [w for w, r in recs.items() if r[0]]
        want["pages"] += bool(held)
        for wid, (mask, *_counts) in recs.items():
            index[wid].add(key)
            if not 0 <= mask <= 7:
                raise IntegrityError(f"page {key[:4].hex()}: worker {wid} has tier mask {mask}")
            if not mask:
                continue
            want["entries"] += 1
            want[f"w:{wid}"] += 1
            for t in (1, 2, 3):
                want[str(t)] += (mask >> (t - 1)) & 1
            if parent == bytes(16):
                continue
            parent_rec = nodes.get(parent, (b"", {}))[1].get(wid)
            if parent_rec is not None:
                children[(parent, wid)][fastest(mask) - 1] += 1
            if parent_rec is None or not parent_rec[0]:
                want["orphans"] += 1
            elif fastest(mask) < fastest(parent_rec[0]):
                want["inversions"] += 1
    for key, (_, recs) in nodes.items():
        for wid, (mask, *counts) in recs.items():
            if counts != children.get((key, wid), [0, 0, 0]):
                raise IntegrityError(f"page {key[:4].hex()} worker {wid}: child counts {counts}, "
                                     f"actual {children.get((key, wid), [0, 0, 0])}")
            if not mask and not any(counts):
                raise IntegrityError(f"page {key[:4].hex()} worker {wid}: empty record")
    if listed != set(index):
        raise IntegrityError(f"holder set {sorted(listed)} != workers with records {sorted(index)}")
    for wid, keys in index.items():
        stored = indexes.get(wid, set())
        if stored != keys:
            raise IntegrityError(f"worker {wid}: index has {len(stored)} keys, records {len(keys)} "
                                 f"({len(stored - keys)} extra, {len(keys - stored)} missing)")
    totals = {k.decode(): int(v) for k, v in counters.items()}
    totals |= {k: int(v or 0) for k, v in zip(("orphans", "inversions"), structure, strict=True)}
    have = {k: v for k, v in totals.items() if v}
    if have != {k: v for k, v in want.items() if v}:
        raise IntegrityError(f"counters {sorted(have.items())} != actual {sorted(want.items())}")
