"""What every layer of the collective stack agrees on about an op: one definition, read everywhere.

The frontends build op descriptions, the engine negotiates and fuses them, the transports run them.
"""

from __future__ import annotations

import enum


class ReduceOp(str, enum.Enum):
    """How allreduce and reducescatter combine tensors (Horovod's ``hvd.Average`` and friends).

    A ``str`` enum: a member equals (and hashes as) its value, so the engine's wire format carries the
    plain string and tables keyed by members answer to it."""

    AVERAGE = "average"  # a sum on the wire; the engine divides by the number of ranks afterwards
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"  # see hvdray/collective/adasum.py
