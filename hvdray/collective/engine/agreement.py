"""What every rank agrees to run each tick, and the state that keeps the ranks' decisions identical.

The :class:`Agreement` composes the replicated parts (the negotiation table, the response cache,
the fusion planner, the round number) with this rank's requests waiting on them (on a cached slot,
or to be announced by name; an unnamed call's ops on their families' slots, see :meth:`Agreement._family_slots`),
the learned step and rank 0's stall inspector and autotuner. The engine thread drives it: sort new
requests, fill the flags, say and absorb a full round's messages, plan what is ready. It never runs an
op and never takes the engine's lock.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from hvdray.collective.autotune import Autotuner, TunedParams
from hvdray.collective.engine.cache import FlagVector, ResponseCache
from hvdray.collective.engine.fusion import Action, FusionPlanner, ReadyOp
from hvdray.collective.engine.handle import Request
from hvdray.collective.engine.negotiation import Drop, Finished, NegotiationTable, RoundMessage
from hvdray.collective.engine.stall import StallInspector
from hvdray.collective.engine.steps import LearnedStep
from hvdray.collective.protocol import GENERATED_NAME_MARK, GeneratedParts, family_variants, generated_parts

log = logging.getLogger(__name__)


def _unnamed_call(queue: list[Request], at: int) -> tuple[list[Request], list[Optional[GeneratedParts]]]:
    """The requests of the unnamed call whose first is ``queue[at]`` (generated): those after it with the same
    call's name (a grouped op's, an op's and its NaN mask, submitted together), and each one's
    :func:`generated_parts` (None: an op without a family, alone)."""
    first = generated_parts(queue[at].name)
    parts, end = [first], at + 1
    while first is not None and end < len(queue) and queue[end].desc.generated:
        following = generated_parts(queue[end].name)
        if following is None or following[0] != first[0]:
            break
        parts.append(following)
        end += 1
    return queue[at:end], parts


class Agreement:
    """One rank's side of the ranks' agreement on what runs when. Engine thread only; ``step`` is shared
    with the engine's submission side, which touches it under the engine's lock."""

    def __init__(
        self, rank: int, size: int, fusion_threshold_bytes: int, stall_warning_s: float, stall_shutdown_s: float,
        cache_capacity: int, tuner: Optional[Autotuner],
    ) -> None:
        self.rank = rank
        self.size = size
        self.round = 0
        self.table = NegotiationTable(size)
        self.cache = ResponseCache(cache_capacity, rank)
        self.flags = FlagVector(cache_capacity)
        self.planner = FusionPlanner(fusion_threshold_bytes)
        self.stall = StallInspector(size, stall_warning_s, stall_shutdown_s)
        self.tuner = tuner if rank == 0 else None
        self.step = LearnedStep()
        # this rank's requests not running yet: waiting on a cached slot, or to be announced by name
        self.slot_requests: dict[int, Request] = {}
        self.outbox: list[Request] = []
        # this rank's unnamed calls waiting on their families' slots, oldest first, each its ops' slots and requests
        # (:meth:`_family_slots`); a call is over once its requests have left ``slot_requests``
        self.family_calls: list[tuple[tuple[int, Request], ...]] = []
        #: this tick's plan's family names (the cache's name of a family's slot) -> the generated name of the
        #: unnamed op that runs on it here (the request the engine runs under that name)
        self.renamed: dict[str, str] = {}
        #: the slots this tick's unnamed calls left for going by name (a full round's announcement can send them,
        #: after the flags found them ready): not run by slot this tick, on any rank
        self.moved_by_name: set[int] = set()

    def sort(self, queue: list[Request]) -> None:
        """New requests go to their cached slot (announced by one flag bit) or to the outbox (by name). A
        generated name is never cached; an unnamed call's requests (a grouped op's, an op's and its NaN mask's,
        submitted together) may go by their families' slots (:meth:`_family_slots`)."""
        lookup = self.cache.lookup if self.cache.enabled else None
        outbox, slot_requests = self.outbox, self.slot_requests
        slots, nbytes = [], 0
        step_families: list[str] = []  # the learned step counts an unnamed op by its family, not its variant's slot
        by_families: Optional[bool] = None if lookup is not None else False  # asked at the first unnamed call
        at = 0
        while at < len(queue):
            request = queue[at]
            desc = request.desc
            if desc.generated:
                call, parts = _unnamed_call(queue, at)
                at += len(call)
                if by_families is None:
                    by_families = self._families_open()
                found = self._family_slots(call, parts) if by_families else None
                if found is None:
                    outbox.extend(call)
                    by_families = False  # something generated now goes by name from here: the later calls too
                else:
                    families, keys = found
                    self.family_calls.append(tuple(zip(families, call)))
                    slot_requests.update(zip(families, call))
                    step_families.extend(keys)
                    nbytes += sum(r.tensor.nbytes for r in call if r.tensor is not None)
                continue
            at += 1
            slot = lookup(desc) if lookup is not None else None
            if slot is None:
                outbox.append(request)
            else:
                slot_requests[slot] = request
                slots.append(slot)
                if request.tensor is not None:  # its description's shape and dtype: the cache matched them
                    nbytes += request.tensor.nbytes
        if slots or step_families:
            self.step.add(slots, nbytes, tuple(step_families))

    def _family_slots(
        self, call: list[Request], parts: list[Optional[GeneratedParts]]
    ) -> Optional[tuple[tuple[int, ...], list[str]]]:
        """The slots of the families (:func:`family_variants`, from each request's ``parts`` of its generated name)
        of an unnamed call's requests, and each family's name whatever the variant (the learned step's count of
        it), if it can go by them (the caller has asked :meth:`_families_open`): every one's family is cached,
        and none of this rank's unnamed calls still waits on these slots (one :data:`FAMILY_VARIANTS` counts
        earlier, of the same family). A slot pending on every rank holds the same call on each (the ranks count
        their calls alike, and none can be that many calls ahead of another: the calls between ran on every
        rank); the ranks run it when every rank's oldest such call is the same call (its slots and generated
        names: the flags' digest, :meth:`read_flags`), else send them all by name."""
        slots, families = [], []
        lookup, pending = self.cache.lookup, self.slot_requests
        for request, named in zip(call, parts):
            found = None if named is None else family_variants(request.desc, named)
            if found is None:
                return None
            family, names, variant = found
            slot = lookup(request.desc, names[variant])
            if slot is None or slot in pending:  # pending: one of this rank's unnamed calls waits on it
                return None
            slots.append(slot)
            families.append(family)
        return (tuple(slots), families) if len(set(slots)) == len(slots) else None

    def _families_open(self) -> bool:
        """Whether unnamed calls may go by their families' slots at all (:meth:`_family_slots`): no rank has
        joined, and nothing generated is on its way by name, from this rank (its outbox) or any other (announced,
        not run yet): an op by name never waits on one by slot."""
        return not self.table.joined and not any(r.desc.generated for r in self.outbox) and not any(
            GENERATED_NAME_MARK in name for name in self.table.announced)

    def _family_requests(self) -> list[tuple[int, Request]]:
        """The ops of this rank's unnamed calls still waiting on their families' slots, oldest call first, by slot
        (``family_calls`` keeps only those, and so forgets the calls that are over)."""
        pending = self.slot_requests
        calls = [tuple((slot, request) for slot, request in call if pending.get(slot) is request)
                 for call in self.family_calls]
        self.family_calls = [call for call in calls if call]
        return [entry for call in self.family_calls for entry in call]

    def _family_by_name(self) -> list[int]:
        """Send this rank's unnamed calls waiting on families' slots by name instead (every rank does, in the
        same round), in their order; the slots they had."""
        family = self._family_requests()
        self.family_calls = []
        for slot, request in family:
            del self.slot_requests[slot]
            self.outbox.append(request)
        self.moved_by_name.update(slot for slot, _ in family)
        return [slot for slot, _ in family]

    def rank0_wants_full(self) -> bool:
        """Rank 0 asks for a full round to drop stalled ops, take a census of a stalled cached op, or send
        autotune's next parameters."""
        stalls = self.stall.wants_full_round(self.table.announced, self.table.joined)
        return stalls or (self.tuner is not None and self.tuner.pending is not None)

    def fill_flags(self, wants_full: bool, blocked: bool) -> torch.Tensor:
        """This tick's flag vector, to be AND-combined across ranks (``blocked``: a caller here waits on an op);
        its digest is of this rank's oldest unnamed call on its families' slots, if it has one."""
        if self.moved_by_name:
            self.moved_by_name.clear()
        oldest = self.family_calls[0] if self._family_requests() else ()
        return self.flags.fill(self.slot_requests, self.rank in self.table.joined, wants_full, blocked,
                               tuple((slot, request.name) for slot, request in oldest) or None)

    def read_flags(self) -> tuple[list[int], list[int], bool]:
        """After the AND: (slots ready everywhere, slots pending somewhere, full round wanted); a new round.
        When every rank has an unnamed call on its families' slots and the oldest are not all the same call
        (another generated name, another family, another op more or fewer), every rank sends its own by name:
        the names pair them, and a mismatch gets its error."""
        self.round += 1
        ready, somewhere, full = self.flags.read()
        if self.flags.family_agreed is False:
            slots = self._family_by_name()
            if slots:
                ready = [s for s in ready if s not in slots]
        return ready, somewhere, full

    # -- a full round ------------------------------------------------------------------------
    def message(self, join: bool, stop: bool, call: int, finished: Optional[Finished]) -> RoundMessage:
        """What this rank says in this full round (``call``: the executor call its announcements belong to;
        ``finished``: it has just left that call's function)."""
        message = RoundMessage(
            announce=[r.desc for r in self.outbox], census=sorted(self.slot_requests), join=join, stop=stop,
            call=call, finished=finished,
        )
        self.outbox = []
        if self.rank == 0:
            message.drops = self.stall.take_drops()
        if self.tuner is not None:
            message.tune = self.tuner.take_pending(time.perf_counter())
        return message

    def absorb(self, messages: list[RoundMessage]) -> tuple[bool, list[Drop]]:
        """Every rank's message of this round, in rank order. Returns whether it brought new work, and
        the stalled names that rank 0 dropped (forgotten here), each with the ranks that never submitted it."""
        busy, announced = self.table.absorb(messages, time.monotonic())
        for name in announced:
            if self.cache.slot_of(name) is not None:
                self._uncache(name)  # announced by name again: renegotiate it everywhere
        if self.table.joined or any(GENERATED_NAME_MARK in name for name in announced):
            self._family_by_name()  # a generated name goes by name somewhere: every rank's does
        if self.rank == 0:
            self.stall.take_census(messages)
        if messages[0].tune is not None:
            self._apply(messages[0].tune)
        drops = []
        for drop in messages[0].drops:
            self.table.drop(drop.name)
            slot = self.cache.slot_of(drop.name)
            if slot is not None:
                request = self.slot_requests.pop(slot, None)
                if request is not None and request.name != drop.name:  # a family's: fail the op by its own name
                    drop = drop._replace(name=request.name)
                self.stall.forget_slot(slot)
            drops.append(drop)
        return busy, drops

    def _apply(self, params: TunedParams) -> None:
        """Autotune's fusion and cache parameters, applied by every rank in the same round (rank 0 sent them;
        the engine applies the cycle time)."""
        self.planner.fusion_bytes = int(params.fusion_threshold_mb * 1024 * 1024)
        self.cache.enabled = params.cache_enabled and self.cache.capacity > 0
        self._forget_plans()
        log.debug("rank %d applies autotuned %s", self.rank, params)

    def _uncache(self, name: str) -> None:
        """Forget a cached name on every rank; a request pending on its slot goes out by name instead."""
        slot = self.cache.evict(name)
        self._forget_plans()
        if slot is not None:
            self._by_name_again(slot)
        self.stall.forget_slot(slot)

    def _by_name_again(self, slot: int) -> None:
        """``slot`` left the cache: a request pending on it goes out by name instead, and with it the rest of
        its unnamed call, if it was one (in the call's order)."""
        if any(s == slot for s, _ in self._family_requests()):
            self._family_by_name()
        elif slot in self.slot_requests:
            self.outbox.append(self.slot_requests.pop(slot))

    def _forget_plans(self) -> None:
        """Slots changed meaning or fusion changed: plan ready slots again, and learn the step again."""
        self.planner.forget()
        self.step.forget()

    # -- what is ready -------------------------------------------------------------------------
    def ready_plan(self, ready_slots: list[int], fused_message_bytes: int) -> list[Action]:
        """What runs now: cached slots in slot order, then newly negotiated names in announcement order
        (the same on every rank), consecutive compatible allreduces fused."""
        cache = self.cache
        renamed = self.renamed
        if renamed:
            renamed.clear()
        if self.moved_by_name:
            ready_slots = [slot for slot in ready_slots if slot not in self.moved_by_name]
        for slot in ready_slots:
            request = self.slot_requests.pop(slot, None)  # a joined rank has none pending
            if request is not None and request.desc.generated:  # an unnamed op on its family's slot
                renamed[cache.name_of(slot)] = request.name
            cache.touch(slot, self.round)
        if renamed:  # unnamed calls ran: forget those that are over now, not at the next tick (they hold outputs)
            self._family_requests()
        newly = self.table.take_ready()
        if ready_slots and not newly and not self.table.joined:
            # the steady state: the same cached tensors every step, planned once
            return self.planner.cached_plan(
                tuple(ready_slots),
                lambda: [ReadyOp(cache.name_of(slot), cache.descs(slot), True) for slot in ready_slots],
                fused_message_bytes,
            )
        ready = [ReadyOp(cache.name_of(slot), cache.descs(slot), True) for slot in ready_slots]
        ready += [ReadyOp(name, descs, False) for name, descs in newly]
        return self.planner.plan(self._agree(ready), fused_message_bytes)

    def _agree(self, ready: list[ReadyOp]) -> list[ReadyOp]:
        """Find each ready op's problem (a mismatch, or not runnable with joined ranks) and cache the newly
        agreed names, in order (the same on every rank, so every rank gives them the same slots)."""
        cache, table = self.cache, self.table
        for op in ready:
            op.problem = table.problem(op.name, op.descs, op.cached)
            if op.problem is None and cache.enabled and not op.cached and len(op.descs) == self.size:
                if not op.desc.generated:
                    self._cache(op.name, op)
                    continue
                found = family_variants(op.desc)
                new_family = False
                for name in found[1] if found is not None else ():  # every variant: the next calls, in flight or not
                    if not cache.holds(name, op.descs):
                        self._uncache(name)  # a family's rows or splits changed on some rank: its slot anew
                    new_family = new_family or cache.slot_of(name) is None
                    self._cache(name, op)
                if new_family:
                    self.step.family_negotiated()
        return ready

    def _cache(self, name: str, op: ReadyOp) -> None:
        """Cache ``op``'s descriptions under ``name`` (its own, or a variant of its family's); a request pending on
        the slot that makes room goes by name."""
        evicted = self.cache.put(name, op.descs, self.round)
        if evicted is not None:
            self._forget_plans()
            self._by_name_again(evicted)
