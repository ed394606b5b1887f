"""WorkerLink messages from a worker: registration, heartbeats, page events,
inventory snapshots and command acknowledgements."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvtier.domain.errors import ResourceExhausted
from kvtier.domain.records import (
    BootId,
    CommandAck,
    CommandId,
    Heartbeat,
    InventoryPage,
    InventorySnapshotChunk,
    NamespaceInventory,
    PageEvent,
    PageEventBatch,
    PageEventKind,
    Registration,
    SnapshotId,
    WorkerCosts,
    WorkerEvent,
    WorkerId,
)
from kvtier.rpc._gen import worker_link_pb2
from kvtier.rpc.convert.common import (
    from_proto_model_facts,
    from_proto_model_identity,
    read_capacities,
    read_occupancies,
    to_proto_model_facts,
    to_proto_model_identity,
    to_proto_tier_capacity,
    to_proto_tier_occupancy,
)
from kvtier.rpc.convert.fields import (
    EnumMap,
    check_count,
    invalid,
    join_path,
    read_digest,
    read_finite,
    read_key,
    read_list,
    read_optional_tier,
    read_string,
    read_tier,
    required_message,
    tier_or_unset,
    wire_optional_tier,
    wire_tier,
)
from kvtier.rpc.convert.limits import (
    MAX_BATCH_EVENTS,
    MAX_IDENTITY_FIELD_CHARS,
    MAX_SNAPSHOT_CHUNK_PAGES,
    MAX_TEXT_CHARS,
)

_PAGE_EVENT_KINDS = EnumMap(PageEventKind, worker_link_pb2.PageEventKind, "PAGE_EVENT_KIND_")


def to_proto_registration(registration: Registration) -> worker_link_pb2.Register:
    return worker_link_pb2.Register(
        worker_id=registration.worker_id,
        address=registration.address,
        boot_id=registration.boot_id,
        model=to_proto_model_identity(registration.model),
        adapters=registration.adapters,
        page_size=registration.page_size,
        capacities=[to_proto_tier_capacity(c) for c in registration.capacities],
        facts=to_proto_model_facts(registration.facts) if registration.facts is not None else None,
    )


def from_proto_registration(msg: worker_link_pb2.Register, path: str = "register") -> Registration:
    if msg.page_size == 0:
        raise invalid(join_path(path, "page_size"), "must be set (>= 1)")
    adapters_path = join_path(path, "adapters")
    return Registration(
        worker_id=WorkerId(read_string(msg.worker_id, join_path(path, "worker_id"), required=True)),
        address=read_string(msg.address, join_path(path, "address"), required=True),
        boot_id=BootId(read_string(msg.boot_id, join_path(path, "boot_id"), required=True)),
        model=from_proto_model_identity(required_message(msg, "model", path), join_path(path, "model")),
        page_size=msg.page_size,
        capacities=read_capacities(msg.capacities, join_path(path, "capacities")),
        adapters=read_list(
            msg.adapters, adapters_path, lambda a, p: read_string(a, p, max_chars=MAX_IDENTITY_FIELD_CHARS)
        ),
        facts=from_proto_model_facts(msg.facts, join_path(path, "facts")) if msg.HasField("facts") else None,
    )


def to_proto_heartbeat(heartbeat: Heartbeat) -> worker_link_pb2.Heartbeat:
    return worker_link_pb2.Heartbeat(
        seq=heartbeat.seq,
        tiers=[to_proto_tier_occupancy(t) for t in heartbeat.tiers],
        queue_depth=heartbeat.queue_depth,
        num_running_seqs=heartbeat.num_running_seqs,
        costs=to_proto_worker_costs(heartbeat.costs) if heartbeat.costs is not None else None,
    )


_COST_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerCosts))


def to_proto_worker_costs(costs: WorkerCosts) -> worker_link_pb2.WorkerCosts:
    return worker_link_pb2.WorkerCosts(**{name: getattr(costs, name) for name in _COST_FIELDS})


def from_proto_worker_costs(msg: worker_link_pb2.WorkerCosts, path: str = "costs") -> WorkerCosts:
    values = {}
    for name in _COST_FIELDS:
        value = read_finite(getattr(msg, name), join_path(path, name))
        if value < 0:
            raise invalid(join_path(path, name), f"must be >= 0, got {value}")
        values[name] = value
    return WorkerCosts(**values)


def from_proto_heartbeat(msg: worker_link_pb2.Heartbeat, path: str = "heartbeat") -> Heartbeat:
    return Heartbeat(
        seq=msg.seq,
        tiers=read_occupancies(msg.tiers, join_path(path, "tiers")),
        queue_depth=msg.queue_depth,
        num_running_seqs=msg.num_running_seqs,
        costs=from_proto_worker_costs(msg.costs, join_path(path, "costs")) if msg.HasField("costs") else None,
    )


def to_proto_page_event(event: PageEvent) -> worker_link_pb2.PageEvent:
    return worker_link_pb2.PageEvent(
        kind=_PAGE_EVENT_KINDS.to_wire[event.kind],
        namespace_digest=event.namespace_digest,
        page_key=event.page_key,
        parent_key=event.parent_key or b"",
        depth=event.depth or 0,
        tier=tier_or_unset(event.tier),
        from_tier=wire_optional_tier(event.from_tier),
    )


def from_proto_page_event(msg: worker_link_pb2.PageEvent, path: str = "") -> PageEvent:
    kind = _PAGE_EVENT_KINDS.parse(msg.kind, join_path(path, "kind"))
    is_insert = kind is PageEventKind.INSERT
    tier = read_tier(msg.tier, join_path(path, "tier")) if msg.tier or kind is not PageEventKind.DROP else None
    from_tier = read_optional_tier(msg, "from_tier", path)
    if from_tier is not None and kind is not PageEventKind.MOVE:
        raise invalid(join_path(path, "from_tier"), f"must be unset for a {kind.name} event")
    if from_tier is not None and from_tier == tier:
        raise invalid(join_path(path, "from_tier"), f"must differ from tier ({from_tier.label})")
    if is_insert and msg.depth == 0:
        raise invalid(join_path(path, "depth"), "must be >= 1 for an INSERT event")
    return PageEvent(
        kind=kind,
        namespace_digest=read_digest(msg.namespace_digest, join_path(path, "namespace_digest")),
        page_key=read_key(msg.page_key, join_path(path, "page_key")),
        tier=tier,
        parent_key=read_key(msg.parent_key, join_path(path, "parent_key")) if msg.parent_key or is_insert else None,
        depth=msg.depth or None,
        from_tier=from_tier,
    )


def to_proto_page_event_batch(batch: PageEventBatch) -> worker_link_pb2.PageEventBatch:
    return worker_link_pb2.PageEventBatch(
        seq=batch.seq, events=[to_proto_page_event(e) for e in batch.events]
    )


def from_proto_page_event_batch(
    msg: worker_link_pb2.PageEventBatch, path: str = "page_events"
) -> PageEventBatch:
    events_path = join_path(path, "events")
    check_count(msg.events, events_path, MAX_BATCH_EVENTS, volume=True)
    return PageEventBatch(
        seq=msg.seq,
        events=tuple(from_proto_page_event(e, f"{events_path}[{i}]") for i, e in enumerate(msg.events)),
    )


def to_proto_inventory_page(page: InventoryPage) -> worker_link_pb2.InventoryPage:
    return worker_link_pb2.InventoryPage(page_key=page.page_key, parent_key=page.parent_key, depth=page.depth)


def from_proto_inventory_page(msg: worker_link_pb2.InventoryPage, path: str = "") -> InventoryPage:
    if msg.depth == 0:
        raise invalid(join_path(path, "depth"), "must be >= 1")
    return InventoryPage(
        page_key=read_key(msg.page_key, join_path(path, "page_key")),
        parent_key=read_key(msg.parent_key, join_path(path, "parent_key")),
        depth=msg.depth,
    )


def to_proto_namespace_inventory(inventory: NamespaceInventory) -> worker_link_pb2.NamespaceInventory:
    return worker_link_pb2.NamespaceInventory(
        namespace_digest=inventory.namespace_digest,
        tier=wire_tier(inventory.tier),
        pages=[to_proto_inventory_page(p) for p in inventory.pages],
    )


def from_proto_namespace_inventory(
    msg: worker_link_pb2.NamespaceInventory, path: str = ""
) -> NamespaceInventory:
    pages_path = join_path(path, "pages")
    check_count(msg.pages, pages_path, MAX_SNAPSHOT_CHUNK_PAGES, volume=True)
    return NamespaceInventory(
        namespace_digest=read_digest(msg.namespace_digest, join_path(path, "namespace_digest")),
        tier=read_tier(msg.tier, join_path(path, "tier")),
        pages=tuple(from_proto_inventory_page(p, f"{pages_path}[{i}]") for i, p in enumerate(msg.pages)),
    )


def to_proto_inventory_snapshot_chunk(
    chunk: InventorySnapshotChunk,
) -> worker_link_pb2.InventorySnapshotChunk:
    return worker_link_pb2.InventorySnapshotChunk(
        snapshot_id=chunk.snapshot_id,
        chunk_index=chunk.chunk_index,
        is_last=chunk.is_last,
        as_of_seq=chunk.as_of_seq,
        inventories=[to_proto_namespace_inventory(i) for i in chunk.inventories],
    )


def from_proto_inventory_snapshot_chunk(
    msg: worker_link_pb2.InventorySnapshotChunk, path: str = "snapshot"
) -> InventorySnapshotChunk:
    inventories_path = join_path(path, "inventories")
    num_pages = sum(len(inv.pages) for inv in msg.inventories)
    if num_pages > MAX_SNAPSHOT_CHUNK_PAGES:
        raise ResourceExhausted(
            f"{inventories_path} holds {num_pages} pages; at most {MAX_SNAPSHOT_CHUNK_PAGES} per chunk",
            field=inventories_path,
        )
    return InventorySnapshotChunk(
        snapshot_id=SnapshotId(read_string(msg.snapshot_id, join_path(path, "snapshot_id"), required=True)),
        chunk_index=msg.chunk_index,
        is_last=msg.is_last,
        as_of_seq=msg.as_of_seq,
        inventories=read_list(msg.inventories, inventories_path, from_proto_namespace_inventory),
    )


def to_proto_command_ack(ack: CommandAck) -> worker_link_pb2.CommandAck:
    return worker_link_pb2.CommandAck(
        command_id=ack.command_id, ok=ack.ok, error_code=ack.error_code or "", error_message=ack.error_message,
        num_pages=ack.num_pages, num_skipped_pages=ack.num_skipped_pages,
    )


def from_proto_command_ack(msg: worker_link_pb2.CommandAck, path: str = "ack") -> CommandAck:
    if msg.ok:
        return CommandAck(
            command_id=CommandId(msg.command_id), num_pages=msg.num_pages, num_skipped_pages=msg.num_skipped_pages
        )
    return CommandAck(
        command_id=CommandId(msg.command_id),
        error_code=read_string(msg.error_code, join_path(path, "error_code"), required=True),
        error_message=read_string(msg.error_message, join_path(path, "error_message"), max_chars=MAX_TEXT_CHARS),
        num_pages=msg.num_pages,
        num_skipped_pages=msg.num_skipped_pages,
    )


def to_proto_worker_event(event: WorkerEvent) -> worker_link_pb2.WorkerEvent:
    if isinstance(event, Registration):
        return worker_link_pb2.WorkerEvent(register=to_proto_registration(event))
    if isinstance(event, Heartbeat):
        return worker_link_pb2.WorkerEvent(heartbeat=to_proto_heartbeat(event))
    if isinstance(event, PageEventBatch):
        return worker_link_pb2.WorkerEvent(page_events=to_proto_page_event_batch(event))
    if isinstance(event, InventorySnapshotChunk):
        return worker_link_pb2.WorkerEvent(snapshot=to_proto_inventory_snapshot_chunk(event))
    return worker_link_pb2.WorkerEvent(ack=to_proto_command_ack(event))


_WORKER_EVENT_PARSERS: dict[str, Callable[[Any, str], WorkerEvent]] = {
    "register": from_proto_registration,
    "heartbeat": from_proto_heartbeat,
    "page_events": from_proto_page_event_batch,
    "snapshot": from_proto_inventory_snapshot_chunk,
    "ack": from_proto_command_ack,
}


def from_proto_worker_event(msg: worker_link_pb2.WorkerEvent, path: str = "") -> WorkerEvent:
    which = msg.WhichOneof("event")
    if which is None:
        raise invalid(join_path(path, "event"), f"must set one of {', '.join(_WORKER_EVENT_PARSERS)}")
    return _WORKER_EVENT_PARSERS[which](getattr(msg, which), join_path(path, which))
