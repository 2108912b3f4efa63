"""Which node each rank of a group sits on, so hops can be told apart as intra- or inter-node."""

from __future__ import annotations

import dataclasses

__all__ = ["Topology"]


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """``world`` ranks on nodes of ``ranks_per_node`` consecutive ranks (``None``: one node).

    Example::

        >>> t = Topology(4, ranks_per_node=2)
        >>> [t.node_of(r) for r in range(4)], t.is_inter(1, 2), t.is_inter(2, 3)
        ([0, 0, 1, 1], True, False)
    """

    world: int
    """Ranks in the group."""
    ranks_per_node: int | None = None
    """Consecutive ranks per node; ``None`` (or >= world) means every rank is on one node."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world={self.world} must be at least 1")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be at least 1 (or None for one node)")

    def node_of(self, rank: int) -> int:
        """The node index of group rank ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the group of {self.world}")
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def is_inter(self, src: int, dst: int) -> bool:
        """True when a message from ``src`` to ``dst`` crosses a node boundary."""
        rpn = self.ranks_per_node
        if not (0 <= src < self.world and 0 <= dst < self.world):
            self.node_of(src if not 0 <= src < self.world else dst)  # raises, naming the bad rank
        return rpn is not None and src // rpn != dst // rpn

    @property
    def nodes(self) -> int:
        """Number of nodes the group spans."""
        return self.node_of(self.world - 1) + 1

    @property
    def ring_crosses_nodes(self) -> bool:
        """True when some hop ``r -> r+1 (mod world)`` of the ring is inter-node."""
        return self.nodes > 1
