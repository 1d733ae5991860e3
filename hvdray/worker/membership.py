"""An elastic worker's link to the coordinator: which epoch it belongs to, and announced host updates."""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from hvdray.collective.errors import HorovodInternalError
from hvdray.collective.topology import RankInfo
from hvdray.testing import faults

_ASK_EVERY_S = 5.0  # one coordinator call waits at most this long, so a vanished driver is noticed


class CoordinatorMembership:
    """Implements :class:`hvdray.collective.session.Membership` over the coordinator actor."""

    def __init__(self, coordinator: Any, worker_id: str, wait_limit_s: float) -> None:
        self._coordinator = coordinator
        self.worker_id = worker_id
        self._wait_limit_s = wait_limit_s
        faults.set_context(node_id=ray.get_runtime_context().get_node_id())

    def next_epoch(self, left_epoch: int) -> tuple[int, RankInfo]:
        """Wait (up to the elastic timeout) for the driver to form an epoch newer than ``left_epoch``."""
        deadline = time.monotonic() + self._wait_limit_s
        while True:
            status, member = ray.get(
                self._coordinator.await_membership.remote(self.worker_id, left_epoch, _ASK_EVERY_S)
            )
            if status == "member":
                epoch, info, node_gpus = member
                export_rank_env(info, node_gpus)
                faults.set_context(epoch=epoch, size=info.size)
                faults.reached("epoch_forming")
                return epoch, info
            if status == "removed":
                raise HorovodInternalError(f"worker {self.worker_id} was removed from the job in a membership change")
            if time.monotonic() > deadline:
                raise HorovodInternalError(
                    f"worker {self.worker_id} waited {self._wait_limit_s:.0f} s for a new membership epoch"
                )

    def host_updates(self) -> int:
        return ray.get(self._coordinator.host_updates.remote())


def export_rank_env(info: RankInfo, node_gpu_ids: tuple[str, ...]) -> None:
    """Horovod's rank variables (and the node's GPUs) for code that reads the environment."""
    if node_gpu_ids:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpu_ids)
    for key, value in (
        ("HOROVOD_RANK", info.rank), ("HOROVOD_SIZE", info.size),
        ("HOROVOD_LOCAL_RANK", info.local_rank), ("HOROVOD_LOCAL_SIZE", info.local_size),
        ("HOROVOD_CROSS_RANK", info.cross_rank), ("HOROVOD_CROSS_SIZE", info.cross_size),
    ):
        os.environ[key] = str(value)
