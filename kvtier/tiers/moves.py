"""Records of the tier manager's moves: a commanded move's ticket and outcome (the controller's
Demote and Prefetch), the part of a move one transfer carries, and the parts in flight."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvtier.cache.radix import RadixNode
from kvtier.domain.hashing import PageKey
from kvtier.domain.tiers import Tier
from kvtier.tiers.shadows import Shadowed
from kvtier.tiers.transfer import TransferDone, TransferId


@dataclass(frozen=True, slots=True)
class MoveOutcome:
    """Result of a commanded move: pages moved, and pages left where they were (held by a
    sequence, pinned, moving, under a faster child, or no room in the destination)."""

    num_moved: int
    num_skipped: int


@dataclass(slots=True, eq=False)
class MoveTicket:
    """A commanded move (controller Demote / Prefetch) while its transfers run.

    Its transfers are applied together once the last one completes (a prefetch's DRAM
    parents must land before its NVMe children; a park's DRAM pages before the HBM pages
    above them). Then ``is_done`` is set and ``on_done`` runs once, on the engine thread,
    with the final outcome. A ticket with nothing to move is done when it is returned.
    """

    is_promotion: bool
    num_moved: int = 0
    num_skipped: int = 0
    promoted: list[PageKey] = field(default_factory=list)  # a promotion's pages that went up, once applied
    transfer_ids: list[TransferId] = field(default_factory=list)
    num_open: int = 0  # transfers not completed yet
    hold: RadixNode | None = None  # a prefetch pins the chain's deepest HBM page meanwhile
    is_done: bool = False
    on_done: Callable[[MoveOutcome], None] | None = None

    @property
    def outcome(self) -> MoveOutcome:
        return MoveOutcome(num_moved=self.num_moved, num_skipped=self.num_skipped)


@dataclass(slots=True)
class PendingMove:
    nodes: list[RadixNode]
    dsts: list[int]
    src: Tier
    dst: Tier
    ticket: MoveTicket | None = None  # a commanded move's part: applied with the whole ticket
    done: TransferDone | None = None  # completed, waiting for the ticket's other parts
    # HBM pages that go back onto their copy below, no bytes copied; applied with the copied
    # ones, deepest first (their HBM pages held meanwhile).
    shadowed: list[Shadowed] = field(default_factory=list)
    # The source pages the move holds, by node: a node may move or go meanwhile, and the hold
    # is released on the page it was taken on, never on wherever the node points now.
    srcs: list[int] = field(default_factory=list)


def finish(ticket: MoveTicket) -> None:
    """Mark ``ticket`` done and run its acknowledgement (``on_done``), once."""
    ticket.is_done = True
    if ticket.on_done is not None:
        ticket.on_done(ticket.outcome)


class MovesInFlight:
    """The parts of moves whose transfers were submitted and are not applied yet, by transfer.

    Demotions and promotions add their parts here; the tier manager applies each once its
    transfer completes (``TierManager.poll``). Every page a part holds carries an extra
    reference (HBM/DRAM) or a reserved slot (NVMe) until then."""

    def __init__(self) -> None:
        self._parts: dict[TransferId, PendingMove] = {}

    def __bool__(self) -> bool:
        return bool(self._parts)

    def __iter__(self) -> Iterator[PendingMove]:
        return iter(self._parts.values())

    def add(self, transfer_id: TransferId, part: PendingMove) -> None:
        self._parts[transfer_id] = part

    def get(self, transfer_id: TransferId) -> PendingMove | None:
        return self._parts.get(transfer_id)

    def pop(self, transfer_id: TransferId) -> PendingMove:
        return self._parts.pop(transfer_id)

    def num_leaving(self, tier: Tier) -> int:
        """Pages of ``tier`` in transfers to a slower tier: freed there once applied."""
        return sum(len(p.nodes) + len(p.shadowed) for p in self._parts.values() if p.src is tier and p.dst > tier)

    def num_from(self, tier: Tier) -> int:
        """Pages in transfers out of ``tier``, either way."""
        return sum(len(p.nodes) for p in self._parts.values() if p.src is tier)

    def has_from(self, tier: Tier) -> bool:
        """Whether any transfer out of ``tier`` is in flight."""
        return any(p.src is tier for p in self._parts.values())

    def shadowed(self) -> list[Shadowed]:
        """Demotions onto a copy below reserved by the parts in flight."""
        return [entry for p in self._parts.values() for entry in p.shadowed]

