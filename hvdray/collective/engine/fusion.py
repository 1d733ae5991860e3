"""Planning what ready ops run as: mismatch errors, lone ops, and allreduces fused up to a threshold.

The plan of a set of ready cached slots is the same every step, so it is kept (with the views of the
fusion buffer it uses) and the steady state plans nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from hvdray.collective.engine.cache import RankDescs
from hvdray.collective.protocol import OpDesc, OpKind, ReduceOp

#: over Gloo, allreduces at least this large are reduced on their own, in the caller's output tensor:
#: fusing them would save one call's latency (~0.1 ms) at the price of two full copies. Over shared
#: memory a fused batch is copied straight into the node's segment and out of it, which costs no more
#: than reducing each tensor alone and saves two barriers per tensor, so there every tensor that fits
#: one slot of the segment fuses, and batches end at that size (see Communicator.fused_message_bytes)
DIRECT_BYTES = 1 << 20

#: distinct sets of ready cached slots whose plans are kept (a training loop needs one or two)
MAX_PLANS = 64


@dataclass(slots=True)
class ReadyOp:
    """A name ready on every rank, with every rank's description and the problem found in them, if any."""

    name: str
    descs: RankDescs
    cached: bool
    problem: Optional[str] = None

    @property
    def desc(self) -> OpDesc:
        """The description of the lowest rank that submitted it (joined ranks submit nothing)."""
        return self.descs[min(self.descs)]


@dataclass(eq=False)
class Action:
    """One entry of a plan: a (possibly fused) allreduce, another op, or a mismatch error."""

    names: list[str]
    descs: list[OpDesc]  # per name, the description of the lowest rank that submitted it
    fused: bool = False  # an allreduce batch (possibly of one tensor)
    nbytes: int = 0  # of the batch
    rank_descs: RankDescs = field(default_factory=dict)  # every rank's, for other ops
    problem: str = ""  # a mismatch: raised on every rank for names[0]
    staging: Optional[torch.Tensor] = None  # the fusion buffer the views below point into
    flat: Optional[torch.Tensor] = None
    views: list[torch.Tensor] = field(default_factory=list)
    shapes: Optional[tuple[torch.Size, ...]] = None  # of a fused batch's tensors (outputs alike), once known


class _FusionBatch:
    """Consecutive ready allreduces sharing dtype, op and scale factors, up to the fusion threshold."""

    def __init__(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self._names: list[str] = []
        self._descs: list[OpDesc] = []
        self._nbytes = 0

    def fits(self, desc: OpDesc) -> bool:
        if not self._descs:
            return True
        first = self._descs[0]
        return (
            first.dtype is desc.dtype and first.reduce_op is desc.reduce_op and first.prescale == desc.prescale
            and first.postscale == desc.postscale and self._nbytes + desc.nbytes <= self._limit
        )

    def add(self, name: str, desc: OpDesc) -> None:
        self._names.append(name)
        self._descs.append(desc)
        self._nbytes += desc.nbytes

    def take(self) -> Optional[Action]:
        """The batch as one fused action (None when empty), and an empty batch."""
        if not self._names:
            return None
        action = Action(names=self._names, descs=self._descs, fused=True, nbytes=self._nbytes)
        self._names, self._descs, self._nbytes = [], [], 0
        return action


class FusionPlanner:
    """Turns ready ops into actions, keeps the plans of cached slots, and owns the fusion buffers."""

    def __init__(self, fusion_threshold_bytes: int) -> None:
        self.fusion_bytes = fusion_threshold_bytes  # replicated: autotune changes it on every rank together
        self._plans: dict[tuple[int, ...], list[Action]] = {}  # ready cached slots -> what to run
        self._staging: dict[torch.dtype, torch.Tensor] = {}  # fusion buffers, one per dtype, grown on demand

    def cached_plan(
        self, slots: tuple[int, ...], ready: Callable[[], list[ReadyOp]], fused_message_bytes: int
    ) -> list[Action]:
        """The plan for these ready cached slots, made from ``ready()`` the first time."""
        plan = self._plans.get(slots)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            plan = self._plans[slots] = self.plan(ready(), fused_message_bytes)
        return plan

    def forget(self) -> None:
        """Slots changed meaning or the threshold changed: plan again."""
        self._plans.clear()

    def plan(self, ready: list[ReadyOp], fused_message_bytes: int) -> list[Action]:
        """What to run for these ready ops, in order: problems become errors, other ops run alone, and
        consecutive compatible allreduces fuse up to the threshold (and within one message of the
        transport, when it has a limit)."""
        plan: list[Action] = []
        straight = fused_message_bytes
        batch = _FusionBatch(min(self.fusion_bytes, straight) if straight else self.fusion_bytes)
        alone_from = straight + 1 if straight else DIRECT_BYTES

        def close_batch() -> None:
            action = batch.take()
            if action is not None:
                plan.append(action)

        for op in ready:
            desc = op.desc
            if op.problem is not None:
                close_batch()
                plan.append(Action(names=[op.name], descs=[desc], problem=op.problem))
            elif desc.kind is not OpKind.ALLREDUCE:
                close_batch()
                plan.append(Action(names=[op.name], descs=[desc], rank_descs=op.descs))
            elif desc.reduce_op is ReduceOp.ADASUM or desc.nbytes >= alone_from:
                # alone (Adasum's coefficients are per tensor); the small ones around it keep filling the batch
                plan.append(Action(names=[op.name], descs=[desc], fused=True, nbytes=desc.nbytes))
            else:
                if not batch.fits(desc):
                    close_batch()
                batch.add(op.name, desc)
        close_batch()
        return plan

    def staging_views(self, action: Action) -> list[torch.Tensor]:
        """The action's tensors as views of the fusion buffer for their dtype (kept between steps, grown
        when a larger batch comes; plans bound to a replaced buffer are made again)."""
        dtype = action.descs[0].dtype
        staging = self._staging.get(dtype)
        if staging is not None and action.staging is staging:  # every step after the first
            return action.views
        numels = [math.prod(d.shape) for d in action.descs]
        total = sum(numels)
        if staging is None or staging.numel() < total:
            staging = self._staging[dtype] = torch.empty(total, dtype=dtype)
            self._plans.clear()  # their views point into the old buffer
        action.staging = staging
        action.flat = staging[:total]
        action.views = [part.view(d.shape) for part, d in zip(action.flat.split(numels), action.descs)]
        return action.views
