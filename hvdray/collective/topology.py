"""Rank maths: Horovod's rank, local and cross ranks from where each worker runs; and the cores a
worker may run on, which its node's ranks share."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class WorkerSlot:
    """Where one worker actor runs. ``node_id`` is Ray's node id: several raylets may share an IP."""

    node_id: str
    hostname: str
    ip: str
    gpu_ids: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class RankInfo:
    """Horovod's view of one worker's place in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def assign_ranks(slots: Sequence[WorkerSlot]) -> list[RankInfo]:
    """Give each slot (in the given order) its RankInfo.

    Ranks are contiguous per node, nodes ordered by first appearance, workers of one node in the
    order given. ``cross_rank`` is the node's index among the nodes that have a worker with the same
    ``local_rank``; ``cross_size`` is how many such nodes there are (Horovod's semantics).
    """
    if not slots:
        raise ValueError("slots must not be empty")
    node_order: list[str] = []
    members: dict[str, list[int]] = {}
    for index, slot in enumerate(slots):
        if slot.node_id not in members:
            node_order.append(slot.node_id)
            members[slot.node_id] = []
        members[slot.node_id].append(index)

    size = len(slots)
    # for each local rank, the nodes that have a worker with it, each with its index among them: found once
    # per local rank (O(nodes x largest local size)), not once per worker (O(workers x nodes))
    cross: list[dict[str, int]] = []
    for local_rank in range(max(len(local) for local in members.values())):
        with_it = [n for n in node_order if len(members[n]) > local_rank]
        cross.append({node_id: index for index, node_id in enumerate(with_it)})
    result: list[RankInfo | None] = [None] * size
    rank = 0
    for node_id in node_order:
        local = members[node_id]
        for local_rank, slot_index in enumerate(local):
            result[slot_index] = RankInfo(
                rank=rank,
                size=size,
                local_rank=local_rank,
                local_size=len(local),
                cross_rank=cross[local_rank][node_id],
                cross_size=len(cross[local_rank]),
            )
            rank += 1
    return [r for r in result if r is not None]


def reducescatter_rows(total_rows: int, size: int) -> list[int]:
    """Rows each rank receives from a reducescatter: as even as possible, the first ranks get the extra."""
    base, extra = divmod(total_rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def visible_devices(slots: Sequence[WorkerSlot]) -> list[tuple[str, ...]]:
    """For each slot, the sorted union of GPU ids of all workers on its node (``CUDA_VISIBLE_DEVICES``).

    Each worker then picks its own device by ``local_rank``, as Horovod does.
    """
    per_node: dict[str, set[str]] = {}
    for slot in slots:
        per_node.setdefault(slot.node_id, set()).update(slot.gpu_ids)
    return [tuple(sorted(per_node[s.node_id], key=_gpu_sort_key)) for s in slots]


def _gpu_sort_key(gpu_id: str) -> tuple[int, str]:
    return (int(gpu_id), gpu_id) if gpu_id.isdigit() else (1 << 30, gpu_id)


def usable_cpus() -> set[int]:
    """The cores this process may run on (its CPU affinity; all of the machine's where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many cores this process may run on (:func:`usable_cpus`)."""
    return len(usable_cpus())


def engine_threads_have_cores(local_size: int) -> bool:
    """Whether each of a node's ``local_size`` ranks can have a core for its engine thread beside the one
    its own thread computes on (``Settings.steps_on_waiting_thread``'s "auto")."""
    return 2 * local_size <= usable_cores()


def shared_cache_bytes(cpus_root: str = "/sys/devices/system/cpu") -> int:
    """The size of the largest cache that every core this process may run on shares (the last level, L3 on
    most machines), from Linux's sysfs; 0 where it is unknown or no one cache spans those cores."""
    cores = usable_cpus()
    largest = 0
    for index in sorted(glob.glob(os.path.join(cpus_root, f"cpu{min(cores)}", "cache", "index*"))):
        try:
            with open(os.path.join(index, "size")) as size_file, open(os.path.join(index, "shared_cpu_list")) as shared:
                size, sharers = _cache_size(size_file.read()), _cpu_list(shared.read())
        except (OSError, ValueError):
            continue
        if cores <= sharers:
            largest = max(largest, size)
    return largest


def _cache_size(text: str) -> int:
    """sysfs's cache size ("32768K", "8M") in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def _cpu_list(text: str) -> set[int]:
    """sysfs's CPU list ("0-3,8,10-11") as a set."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        if item:
            first, _, last = item.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus
