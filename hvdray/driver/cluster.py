"""Connecting a driver to Ray: a running cluster when one is named, otherwise a local instance; and
the Ray actor classes the driver starts its actors from.

Scripts call :func:`init_ray` with their ``--address`` flag so that one script runs alone on a laptop,
under ``ray job submit`` (which sets ``RAY_ADDRESS``), and on a cluster node with ``--address auto``.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Optional

import ray

log = logging.getLogger(__name__)


def init_ray(address: Optional[str] = None, num_cpus: Optional[int] = None, **kwargs: Any) -> None:
    """Connect to ``address`` (or ``$RAY_ADDRESS``) if either is set, else (or for ``"local"``) start a
    new local Ray instance, never one found running on this machine.

    ``num_cpus`` only sizes a local instance (a cluster has its own resources); ``kwargs`` go to
    ``ray.init``. Does nothing if Ray is already initialised in this process.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address != "local":
        ray.init(address=address, **kwargs)
        log.info("connected to the Ray cluster at %s", address)
        return
    # The dashboard stays on (Ray's default): it serves the state API behind `ray list actors` and the job's
    # actors and placement group by name; include_dashboard=False turns it off.
    # "local" always starts a new instance: without it, ray.init() joins whatever cluster the last
    # `ray start` on this machine recorded, which a script run alone must not do.
    ray.init(address="local", num_cpus=num_cpus, **kwargs)


@functools.cache
def actor_class(cls: type, concurrency_groups: tuple[tuple[str, int], ...] = ()) -> Any:
    """``ray.remote(cls)`` (with ``concurrency_groups``, as ``(name, threads)`` pairs), made once per
    process. Each ``ray.remote`` call makes a new actor class, which Ray exports and keeps in the driver
    again: a driver that started and shut down executors grew by about 0.4-0.7 MB per executor until the
    classes were made once. Ray exports a class again for each new ``ray.init`` by itself."""
    import ray

    if concurrency_groups:  # Ray takes concurrency groups only here, not in .options()
        return ray.remote(concurrency_groups=dict(concurrency_groups))(cls)
    return ray.remote(cls)
