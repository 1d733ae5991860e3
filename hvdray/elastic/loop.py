"""``hvd.elastic.run``: retry the training function across elastic resets."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

from hvdray.collective import session
from hvdray.collective.errors import HorovodInternalError
from hvdray.elastic.state import HostsUpdatedInterrupt, State
from hvdray.worker import datasets

log = logging.getLogger(__name__)

R = TypeVar("R")


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorate ``train(state, ...)``: on a peer failure roll back to the last commit, on a host update keep
    the commit; either way re-form the ring with the driver's new membership, sync and call it again."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if not isinstance(state, State):
            raise TypeError(f"the first argument of an hvd.elastic.run function must be a State, got "
                            f"{type(state).__name__}")
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                log.info("hvdray elastic: hosts updated; re-forming the ring")
                skip_sync = exc.skip_sync
            except Exception as exc:
                # a ring broken by a dead peer, or the epoch's dataset split stopped by the driver on a fault
                failure = exc if isinstance(exc, HorovodInternalError) else datasets.peer_failure(exc)
                if failure is None:
                    raise
                log.warning("hvdray elastic: peer failure (%s); rolling back to the last commit", failure)
                state.restore()
                skip_sync = False
            session.reset()  # joins the next membership epoch, past any that fails to connect
            state.on_reset()

    return wrapper

