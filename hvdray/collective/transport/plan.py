"""Which strategies a job's lists hold: a shared-memory segment per node, hierarchical allreduce, or
plain Gloo.

Pure decisions from the job's layout and settings, so every rank derives the same plan. Ranks are
contiguous per node (``topology.assign_ranks``), so a node is a block of consecutive ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransportOptions:
    """The settings that pick the transport (``shm_transport``, ``hierarchical_allreduce``, ...)."""

    shm: bool = True
    hierarchical: Optional[bool] = None  # None: automatic
    buffer_bytes: int = 32 << 20
    job_tag: str = ""
    adopt_tensors: bool = False  # share_reduced_tensors: see shm.SharedMemoryAdoption
    share_pages: bool = True  # share_reduced_pages: see shm.shared_pages
    cross_memory: bool = True  # cross_memory_attach: see shm.cross_memory


@dataclass(frozen=True)
class NodeLayout:
    """The job's nodes as blocks of consecutive ranks."""

    node_sizes: tuple[int, ...]

    @classmethod
    def from_local_ranks(cls, local: Sequence[tuple[int, int]]) -> "NodeLayout":
        """Build from every rank's ``(local_rank, local_size)``; raises ValueError unless nodes are rank blocks."""
        sizes: list[int] = []
        rank = 0
        while rank < len(local):
            local_rank, local_size = local[rank]
            block = [(i, local_size) for i in range(local_size)]
            if local_rank != 0 or local_size < 1 or list(local[rank : rank + local_size]) != block:
                raise ValueError(
                    f"ranks are not contiguous per node: rank {rank} has local rank {local_rank} of {local_size}"
                )
            sizes.append(local_size)
            rank += local_size
        return cls(tuple(sizes))

    @property
    def num_nodes(self) -> int:
        return len(self.node_sizes)

    @property
    def homogeneous(self) -> bool:
        return len(set(self.node_sizes)) == 1

    def node_of(self, rank: int) -> int:
        first = 0
        for node, size in enumerate(self.node_sizes):
            if rank < first + size:
                return node
            first += size
        raise ValueError(f"rank {rank} is outside the layout {self.node_sizes}")

    def first_rank(self, node: int) -> int:
        return sum(self.node_sizes[:node])


@dataclass(frozen=True)
class TransportPlan:
    """What the communicator builds: a node segment, and whether allreduce is hierarchical."""

    node_shm: bool
    hierarchical: bool
    reason: str


def plan_transport(layout: NodeLayout, options: TransportOptions, unsupported: Sequence[str]) -> TransportPlan:
    """Decide the paths; ``unsupported`` lists why some rank cannot map shared memory (empty when all can)."""
    largest = max(layout.node_sizes)
    if not options.shm:
        return TransportPlan(False, False, "shm_transport is off")
    if largest == 1:
        return TransportPlan(False, False, "no two ranks share a node")
    if unsupported:
        return TransportPlan(False, False, f"shared memory is unavailable: {unsupported[0]}")
    if layout.num_nodes == 1:
        return TransportPlan(True, False, "all ranks share one node")
    if options.hierarchical is False:
        return TransportPlan(False, False, "hierarchical_allreduce is off and the job spans several nodes")
    if not layout.homogeneous:
        reason = f"nodes hold different numbers of ranks {layout.node_sizes}"
        if options.hierarchical:
            log.warning("hierarchical_allreduce needs the same number of ranks on every node: %s; using Gloo", reason)
        return TransportPlan(False, False, reason)
    return TransportPlan(True, True, f"{layout.num_nodes} nodes of {largest} ranks")
