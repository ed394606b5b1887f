"""Records of the tier manager's moves in flight: a commanded move's ticket and outcome (the
controller's Demote and Prefetch), and the part of a move one transfer carries."""

from __future__ import annotations

from collections.abc import Callable
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
