"""The collective engine: one background thread per worker (and process set) that negotiates, fuses
and runs ops. :mod:`.loop` holds the :class:`Engine`; the other modules are its parts."""

from hvdray.collective.engine.execute import EngineStats
from hvdray.collective.engine.handle import Handle, Request
from hvdray.collective.engine.loop import Engine, submit_to_wait
from hvdray.collective.protocol import GENERATED_NAME_MARK

__all__ = ["Engine", "EngineStats", "GENERATED_NAME_MARK", "Handle", "Request", "submit_to_wait"]
