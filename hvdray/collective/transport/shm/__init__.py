"""The shared-memory transport among the ranks of one node.

``segment.py`` (the file in ``/dev/shm``: naming, creation, mapping, cleanup), ``barrier.py`` (how the
local ranks wait for each other on it), ``parts.py`` (how messages divide between them),
``node.py`` (allreduce, allgather and broadcast through the segment's slots), ``fused.py`` (the
engine's fused tensor lists), ``shared_tensors.py`` (collectives straight between tensors that live in
shared memory), ``shared_storage.py`` (where those tensors live, and how a rank maps its peers'),
``shared_pages.py`` (private tensors whose pages move into shared memory where they lie),
``pages_collectives.py`` (allreduces and reducescatters of such tensors),
``cross_memory.py`` (allreduces that read and write the peers' private tensors through the kernel)
and ``strategies.py`` (their entries in the communicator's lists).
"""

from hvdray.collective.transport.shm.node import NodeCollectives
from hvdray.collective.transport.shm.parts import data_bytes_for, slot_bytes_for
from hvdray.collective.transport.shm.segment import (
    NAME_PREFIX,
    SHM_DIR,
    Segment,
    SharedMemoryError,
    job_tag,
    segment_path,
    unsupported_reason,
)

__all__ = [
    "NAME_PREFIX",
    "SHM_DIR",
    "NodeCollectives",
    "Segment",
    "SharedMemoryError",
    "data_bytes_for",
    "job_tag",
    "segment_path",
    "slot_bytes_for",
    "unsupported_reason",
]
