"""WorkerLink messages from the controller: demote, prefetch, drop, invalidate, snapshot, drain,
pin, unpin and fetch commands, and the command envelope."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import PageKey
from kvtier.domain.records import (
    Command,
    CommandId,
    ControllerCommand,
    DemoteCommand,
    DrainCommand,
    DropCommand,
    FetchCommand,
    InvalidateCommand,
    PinCommand,
    PinId,
    PrefetchCommand,
    RequestSnapshotCommand,
    SessionId,
    SnapshotId,
    TicketKeyCommand,
    UnpinCommand,
    WorkerId,
)
from kvtier.rpc._gen import worker_link_pb2
from kvtier.rpc.convert.common import from_proto_invalidation_scope, to_proto_invalidation_scope
from kvtier.rpc.convert.fields import (
    invalid,
    join_path,
    optional_field,
    read_digest,
    read_keys,
    read_optional_duration,
    read_optional_spread,
    read_optional_string,
    read_string,
    read_tier,
    required_message,
    wire_tier,
)
from kvtier.rpc.convert.limits import MAX_COMMAND_PAGES, TICKET_KEY_BYTES


def _command_keys(msg: Any, path: str) -> tuple[PageKey, ...]:
    keys = read_keys(msg.page_keys, join_path(path, "page_keys"), limit=MAX_COMMAND_PAGES)
    if not keys:
        raise invalid(join_path(path, "page_keys"), "must not be empty")
    return keys


def _command_target(msg: Any, path: str) -> tuple[tuple[PageKey, ...], SessionId | None, bool]:
    """Page keys, a session id or the whole namespace: exactly one addresses a command's pages."""
    session_id = read_optional_string(msg.session_id, join_path(path, "session_id"))
    if msg.whole_namespace:
        if session_id is not None:
            raise invalid(join_path(path, "session_id"), "must be empty when whole_namespace is set")
        if msg.page_keys:
            raise invalid(join_path(path, "page_keys"), "must be empty when whole_namespace is set")
        return (), None, True
    if session_id is None:
        return _command_keys(msg, path), None, False
    if msg.page_keys:
        raise invalid(join_path(path, "page_keys"), "must be empty when session_id is set")
    return (), SessionId(session_id), False


def _check_target(
    keys: tuple[PageKey, ...], session_id: SessionId | None, whole_namespace: bool, what: str
) -> None:
    if bool(keys) + bool(session_id) + whole_namespace != 1:
        raise InvalidArgument(
            f"a {what} names its pages by page_keys, session_id or whole_namespace (exactly one)",
            field="page_keys",
        )


def to_proto_demote_command(command: DemoteCommand) -> worker_link_pb2.DemoteCommand:
    _check_target(command.page_keys, command.session_id, command.whole_namespace, "DemoteCommand")
    return worker_link_pb2.DemoteCommand(
        namespace_digest=command.namespace_digest,
        page_keys=command.page_keys,
        target_tier=wire_tier(command.target_tier),
        session_id=command.session_id or "",
        whole_namespace=command.whole_namespace,
    )


def from_proto_demote_command(msg: worker_link_pb2.DemoteCommand, path: str = "demote") -> DemoteCommand:
    keys, session_id, whole_namespace = _command_target(msg, path)
    return DemoteCommand(
        namespace_digest=read_digest(msg.namespace_digest, join_path(path, "namespace_digest")),
        page_keys=keys,
        target_tier=read_tier(msg.target_tier, join_path(path, "target_tier")),
        session_id=session_id,
        whole_namespace=whole_namespace,
    )


def to_proto_prefetch_command(command: PrefetchCommand) -> worker_link_pb2.PrefetchCommand:
    return worker_link_pb2.PrefetchCommand(
        namespace_digest=command.namespace_digest,
        page_keys=command.page_keys,
        target_tier=wire_tier(command.target_tier),
        deadline_ms=command.deadline_ms,
        session_id=command.session_id or "",
        return_in_ms=command.return_in_ms,
        away_ms=command.away_ms,
        return_spread=command.return_spread,
    )


def from_proto_prefetch_command(
    msg: worker_link_pb2.PrefetchCommand, path: str = "prefetch"
) -> PrefetchCommand:
    session_id = read_optional_string(msg.session_id, join_path(path, "session_id"))
    keys = read_keys(msg.page_keys, join_path(path, "page_keys"), limit=MAX_COMMAND_PAGES)
    if not keys and session_id is None:
        raise invalid(join_path(path, "page_keys"), "must not be empty unless session_id is set")
    return PrefetchCommand(
        namespace_digest=read_digest(msg.namespace_digest, join_path(path, "namespace_digest")),
        page_keys=keys,
        target_tier=read_tier(msg.target_tier, join_path(path, "target_tier")),
        deadline_ms=optional_field(msg, "deadline_ms"),
        session_id=SessionId(session_id) if session_id else None,
        return_in_ms=read_optional_duration(msg, "return_in_ms", path),
        away_ms=read_optional_duration(msg, "away_ms", path),
        return_spread=read_optional_spread(msg, "return_spread", path),
    )


def to_proto_drop_command(command: DropCommand) -> worker_link_pb2.DropCommand:
    _check_target(command.page_keys, command.session_id, command.whole_namespace, "DropCommand")
    return worker_link_pb2.DropCommand(
        namespace_digest=command.namespace_digest,
        page_keys=command.page_keys,
        session_id=command.session_id or "",
        whole_namespace=command.whole_namespace,
        keep_pages=command.keep_pages,
    )


def from_proto_drop_command(msg: worker_link_pb2.DropCommand, path: str = "drop") -> DropCommand:
    keys, session_id, whole_namespace = _command_target(msg, path)
    if msg.keep_pages and session_id is None:
        raise invalid(join_path(path, "keep_pages"), "may be true only with session_id")
    return DropCommand(
        namespace_digest=read_digest(msg.namespace_digest, join_path(path, "namespace_digest")),
        page_keys=keys,
        session_id=session_id,
        whole_namespace=whole_namespace,
        keep_pages=msg.keep_pages,
    )


def to_proto_invalidate_command(command: InvalidateCommand) -> worker_link_pb2.InvalidateCommand:
    return worker_link_pb2.InvalidateCommand(
        scope=to_proto_invalidation_scope(command.scope), policy_epoch=command.policy_epoch
    )


def from_proto_invalidate_command(
    msg: worker_link_pb2.InvalidateCommand, path: str = "invalidate"
) -> InvalidateCommand:
    scope = from_proto_invalidation_scope(required_message(msg, "scope", path), join_path(path, "scope"))
    if msg.policy_epoch == 0:
        raise invalid(join_path(path, "policy_epoch"), "must be >= 1")
    return InvalidateCommand(scope=scope, policy_epoch=msg.policy_epoch)


def to_proto_request_snapshot_command(
    command: RequestSnapshotCommand,
) -> worker_link_pb2.RequestSnapshotCommand:
    return worker_link_pb2.RequestSnapshotCommand(snapshot_id=command.snapshot_id)


def from_proto_request_snapshot_command(
    msg: worker_link_pb2.RequestSnapshotCommand, path: str = "request_snapshot"
) -> RequestSnapshotCommand:
    return RequestSnapshotCommand(
        snapshot_id=SnapshotId(read_string(msg.snapshot_id, join_path(path, "snapshot_id"), required=True))
    )


def to_proto_drain_command(command: DrainCommand) -> worker_link_pb2.DrainCommand:
    return worker_link_pb2.DrainCommand(draining=command.draining)


def from_proto_drain_command(msg: worker_link_pb2.DrainCommand, path: str = "drain") -> DrainCommand:
    return DrainCommand(draining=msg.draining)


def _pin_id(value: str, path: str) -> PinId:
    return PinId(read_string(value, path, required=True))


def to_proto_pin_command(command: PinCommand) -> worker_link_pb2.PinCommand:
    return worker_link_pb2.PinCommand(
        pin_id=command.pin_id,
        namespace_digest=command.namespace_digest,
        page_keys=command.page_keys,
        tier=wire_tier(command.tier),
        expires_at_ms=command.expires_at_ms,
    )


def from_proto_pin_command(msg: worker_link_pb2.PinCommand, path: str = "pin") -> PinCommand:
    return PinCommand(
        pin_id=_pin_id(msg.pin_id, join_path(path, "pin_id")),
        namespace_digest=read_digest(msg.namespace_digest, join_path(path, "namespace_digest")),
        page_keys=_command_keys(msg, path),
        tier=read_tier(msg.tier, join_path(path, "tier")),
        expires_at_ms=optional_field(msg, "expires_at_ms"),
    )


def to_proto_unpin_command(command: UnpinCommand) -> worker_link_pb2.UnpinCommand:
    return worker_link_pb2.UnpinCommand(pin_id=command.pin_id)


def from_proto_unpin_command(msg: worker_link_pb2.UnpinCommand, path: str = "unpin") -> UnpinCommand:
    return UnpinCommand(pin_id=_pin_id(msg.pin_id, join_path(path, "pin_id")))


def to_proto_ticket_key_command(command: TicketKeyCommand) -> worker_link_pb2.TicketKeyCommand:
    return worker_link_pb2.TicketKeyCommand(key=command.key)


def from_proto_ticket_key_command(msg: worker_link_pb2.TicketKeyCommand, path: str = "ticket_key") -> TicketKeyCommand:
    if len(msg.key) != TICKET_KEY_BYTES:
        raise invalid(join_path(path, "key"), f"must be {TICKET_KEY_BYTES} bytes, got {len(msg.key)}")
    return TicketKeyCommand(key=bytes(msg.key))


def to_proto_fetch_command(command: FetchCommand) -> worker_link_pb2.FetchCommand:
    return worker_link_pb2.FetchCommand(peer_worker_id=command.peer_worker_id,
                                        namespace_digest=command.namespace_digest, page_keys=command.page_keys,
                                        max_pages=command.max_pages)


def from_proto_fetch_command(msg: worker_link_pb2.FetchCommand, path: str = "fetch") -> FetchCommand:
    if bool(msg.page_keys) == bool(msg.max_pages):
        raise invalid(join_path(path, "page_keys"), "exactly one of page_keys and max_pages must be set")
    return FetchCommand(
        peer_worker_id=WorkerId(read_string(msg.peer_worker_id, join_path(path, "peer_worker_id"), required=True)),
        namespace_digest=read_digest(msg.namespace_digest, join_path(path, "namespace_digest")),
        page_keys=_command_keys(msg, path) if msg.page_keys else (),
        max_pages=msg.max_pages,
    )


# Command type -> (oneof member, to_proto); oneof member -> from_proto.
_COMMAND_WRITERS: dict[type, tuple[str, Callable[[Any], Any]]] = {
    DemoteCommand: ("demote", to_proto_demote_command),
    PrefetchCommand: ("prefetch", to_proto_prefetch_command),
    DropCommand: ("drop", to_proto_drop_command),
    InvalidateCommand: ("invalidate", to_proto_invalidate_command),
    RequestSnapshotCommand: ("request_snapshot", to_proto_request_snapshot_command),
    DrainCommand: ("drain", to_proto_drain_command),
    PinCommand: ("pin", to_proto_pin_command),
    UnpinCommand: ("unpin", to_proto_unpin_command),
    TicketKeyCommand: ("ticket_key", to_proto_ticket_key_command),
    FetchCommand: ("fetch", to_proto_fetch_command),
}
_COMMAND_PARSERS: dict[str, Callable[[Any, str], Command]] = {
    "demote": from_proto_demote_command,
    "prefetch": from_proto_prefetch_command,
    "drop": from_proto_drop_command,
    "invalidate": from_proto_invalidate_command,
    "request_snapshot": from_proto_request_snapshot_command,
    "drain": from_proto_drain_command,
    "pin": from_proto_pin_command,
    "unpin": from_proto_unpin_command,
    "ticket_key": from_proto_ticket_key_command,
    "fetch": from_proto_fetch_command,
}


def to_proto_controller_command(command: ControllerCommand) -> worker_link_pb2.ControllerCommand:
    member, write = _COMMAND_WRITERS[type(command.command)]
    return worker_link_pb2.ControllerCommand(
        command_id=command.command_id, **{member: write(command.command)}
    )


def from_proto_controller_command(
    msg: worker_link_pb2.ControllerCommand, path: str = ""
) -> ControllerCommand:
    which = msg.WhichOneof("command")
    if which is None:
        raise invalid(join_path(path, "command"), f"must set one of {', '.join(_COMMAND_PARSERS)}")
    return ControllerCommand(
        command_id=CommandId(msg.command_id),
        command=_COMMAND_PARSERS[which](getattr(msg, which), join_path(path, which)),
    )
