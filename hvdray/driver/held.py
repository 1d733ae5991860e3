"""What a :class:`~hvdray.driver.executor.RayExecutor` holds in the cluster, and its release.

``shutdown()`` releases it. An executor garbage collected without ``shutdown()`` (a notebook cell that
makes and starts one, run again) leaves it to the next executor's ``start()``: a finalizer may run in the
middle of any code, Ray's included, so it only hands the record over (:func:`abandon`), and
:func:`release_abandoned` makes the Ray calls. What was started in a Ray session that has since ended
(``ray.shutdown()``, a Ray started or joined again) went with it and is only forgotten.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional

import ray

if TYPE_CHECKING:
    from hvdray.driver.controller import ElasticDriver
    from hvdray.driver.coordinator_host import JobCoordinator
    from hvdray.driver.placement import Placement
    from hvdray.driver.worker_group import WorkerGroup

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Held:
    """What an executor holds in the cluster: released by ``shutdown()``, or, for an executor that was
    garbage collected without it (a notebook cell that makes one, run again), by the next executor's
    ``start()`` (see :func:`release_abandoned`)."""

    executor_id: str
    ray_session: Optional[str] = None  # the Ray session it was started in (current_ray_session): it all ends with it
    placement: Optional[Placement] = None
    group: Optional[WorkerGroup] = None  # fixed jobs: the current workers (a new group after a failure)
    coordinator: Optional[JobCoordinator] = None  # elastic jobs: one coordinator for every run
    driver: Optional[ElasticDriver] = None  # elastic jobs: the run in progress

    def __bool__(self) -> bool:
        return any(part is not None for part in (self.placement, self.group, self.coordinator, self.driver))

    def in_ended_session(self) -> bool:
        """Whether the Ray session it was started in has ended (``ray.shutdown()``, or a Ray started or
        joined again since): its workers and placement group went with it."""
        return self.ray_session is not None and self.ray_session != current_ray_session()

    def forget(self) -> None:
        """Drop it all without a call to Ray: what went with an ended session."""
        self.placement = self.group = self.coordinator = self.driver = None

    def release(self) -> None:
        """Stop and release all of it (forget it, if its Ray session has ended)."""
        if self.in_ended_session():
            self.forget()
        if self.driver is not None:
            self.driver.stop()
        if self.group is not None:
            self.group.stop()
            self.group = None
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None
        if self.placement is not None:
            self.placement.release()
            self.placement = None


#: what executors garbage collected without shutdown() still held; a finalizer only appends here (it may run
#: in the middle of any code, Ray's included), and the next start() releases it
_abandoned: list[Held] = []


def current_ray_session() -> Optional[str]:
    """This driver's Ray session, None while Ray is not initialized: its job id, which a new driver
    connection changes, and its node's id, which a new cluster changes (job ids start again at 1 there)."""
    if not ray.is_initialized():
        return None
    try:
        context = ray.get_runtime_context()
        return f"{context.get_node_id()}/{context.get_job_id()}"
    except Exception:  # noqa: BLE001 - a Ray that cannot say (a client mode): taken as the same session
        return None


def abandon(held: Held) -> None:
    if held:
        _abandoned.append(held)


def release_abandoned() -> None:
    """Release what garbage-collected executors left started: their workers and placement groups would
    otherwise hold the cluster's CPUs until the driver exits."""
    while _abandoned:
        held = _abandoned.pop()  # atomic: a finalizer appending meanwhile loses nothing
        if held.in_ended_session():
            continue  # it went with its Ray session
        log.warning("hvdray executor %s was garbage collected without shutdown(): releasing its workers and "
                    "placement group now", held.executor_id)
        try:
            held.release()
        except Exception as exc:  # noqa: BLE001 - what is already gone cannot be released; the new start goes on
            log.debug("hvdray executor %s: releasing what it left failed: %s", held.executor_id, exc)


def held_attribute(name: str) -> Any:
    """An executor attribute kept in its :class:`Held`."""
    return property(lambda self: getattr(self._held, name), lambda self, value: setattr(self._held, name, value))
