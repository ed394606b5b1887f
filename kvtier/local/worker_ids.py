"""Which worker id each slot of ``kvtier worker-pool`` holds when the ids come from a tokens directory.

With auth on, a worker may register only the id its token names (decision 0007), so the pool
cannot name workers after their slot: it hands out the ids the tokens directory holds (one
file per id, the file name being the id: the chart's worker-tokens Secret mounted on the
worker nodes), and each worker reads ``<dir>/<id>`` as its ``auth_token_file`` on its node.

    list_worker_ids(dir)          ─► the ids a tokens directory holds (runs on a worker node)
    assign_worker_ids(...)        ─► pure: slot -> id, from the claims, the ids and the live actors
    SlotClaims                    ─► the claims, kept in the Ray cluster's GCS key-value store

Rules (``assign_worker_ids``):

* A claimed slot keeps its id: an adopted worker, or one restarted in the same slot, keeps the
  name peers and the controller know it by.
* A slot without a claim takes the lowest free id (natural order: ``worker-2`` before
  ``worker-10``); an id is free when no slot claims it and no live actor has it as its name.
* When no id is free the slot gets none and no worker starts there (``without_id``).
* A claim whose slot is no longer planned (its node left) is released once no live actor has
  its name; while one has, the id stays taken.

Claims live as long as the Ray cluster, like the detached actors they describe, so a restarted
pool finds which slot each named actor fills (its node and local index: its ports and NVMe
directory) without asking the actors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.domain.errors import ConfigError

SlotKey = tuple[str, int]
"""A pool slot: (Ray node id, local index on that node)."""

_WORKER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}$")  # as a token table's worker_id
_CLAIM_PREFIX = "worker-pool/claim/"


def natural_key(worker_id: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders the digit runs of an id by value: worker-2 < worker-10."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", worker_id) if part)


def list_worker_ids(directory: Path) -> list[str]:
    """The worker ids a tokens directory holds: its regular files (symbolic links followed, as a
    Kubernetes Secret volume presents its keys), hidden entries (the volume's ``..data``) skipped.

    Raises ``ConfigError`` (field ``worker_tokens_dir``) when the directory cannot be read, or
    names a file that cannot be a worker id.
    """
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise ConfigError(
            f"worker_tokens_dir {directory} cannot be read on this node ({exc.strerror}); mount the worker "
            "tokens (one file per worker id, e.g. the chart's auth.workerTokensSecret) there",
            field="worker_tokens_dir") from exc
    ids = []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_file():
            continue
        if not _WORKER_ID_RE.match(entry.name):
            raise ConfigError(
                f"worker_tokens_dir {directory} holds {entry.name!r}, which is not a worker id (1-128 letters, "
                "digits and _.@:- starting with a letter or digit)", field="worker_tokens_dir")
        ids.append(entry.name)
    return sorted(ids, key=natural_key)


@dataclass(frozen=True, slots=True)
class IdAssignment:
    worker_ids: dict[SlotKey, str]  # every planned slot that holds an id -> that id
    new_claims: tuple[str, ...]  # ids given to a slot in this pass (to be recorded)
    released: tuple[str, ...]  # claims to forget: slot gone and no live actor by that name
    without_id: tuple[SlotKey, ...]  # planned slots left without an id: none was free


def unclaimed(slots: Iterable[SlotKey], claims: Mapping[str, SlotKey]) -> list[SlotKey]:
    """The planned slots no claim names (they need the list of ids)."""
    claimed = set(claims.values())
    return [s for s in slots if s not in claimed]


def assign_worker_ids(
    slots: Sequence[SlotKey],
    claims: Mapping[str, SlotKey],
    available: Sequence[str],
    live: Collection[str] = (),
) -> IdAssignment:
    """The id of each planned slot (the module's rules). ``claims``: id -> slot as recorded;
    ``available``: the ids a tokens directory holds; ``live``: names of the live actors."""
    planned = set(slots)
    worker_ids: dict[SlotKey, str] = {}
    released: list[str] = []
    for worker_id in sorted(claims, key=natural_key):
        slot = claims[worker_id]
        if slot in planned and slot not in worker_ids:
            worker_ids[slot] = worker_id
        elif worker_id not in live:
            released.append(worker_id)
    # Released ids may still be named by a live actor of an unplanned slot: those stay taken.
    taken = set(worker_ids.values()) | set(live) | (set(claims) - set(released))
    free = iter([w for w in sorted(set(available), key=natural_key) if w not in taken])
    new: list[str] = []
    without: list[SlotKey] = []
    for slot in slots:
        if slot in worker_ids:
            continue
        given = next(free, None)
        if given is None:
            without.append(slot)
        else:
            worker_ids[slot] = given
            new.append(given)
    return IdAssignment(worker_ids, tuple(new), tuple(released), tuple(without))


class SlotClaims:
    """The pool's claims (worker id -> slot) in the Ray cluster's GCS key-value store.

    Needs a connected Ray driver. One key per id, in the pool's Ray namespace, so one id is
    never claimed by two slots; written before the worker starts, so a pool that dies mid-start
    leaves the id with its slot.
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def load(self) -> dict[str, SlotKey]:
        from ray.experimental import internal_kv

        claims: dict[str, SlotKey] = {}
        for key in internal_kv._internal_kv_list(_CLAIM_PREFIX, namespace=self.namespace):
            raw = internal_kv._internal_kv_get(key, namespace=self.namespace)
            if raw is None:  # deleted meanwhile
                continue
            record = json.loads(raw)
            claims[key.decode().removeprefix(_CLAIM_PREFIX)] = (record["node_id"], int(record["index"]))
        return claims

    def put(self, worker_id: str, slot: SlotKey) -> None:
        from ray.experimental import internal_kv

        record = json.dumps({"node_id": slot[0], "index": slot[1]})
        internal_kv._internal_kv_put(_CLAIM_PREFIX + worker_id, record, overwrite=True, namespace=self.namespace)

    def drop(self, worker_id: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(_CLAIM_PREFIX + worker_id, namespace=self.namespace)
