"""The job-private rendezvous: a ``torch.distributed.Store`` whose keys live in the coordinator actor.

Gloo finds its peers through this store. Every read and write is a Ray call to the job's coordinator,
so the rendezvous opens no port of its own: only a process holding the coordinator's handle (which
Ray gives to the job's driver and workers) can read, write or wait on its keys.

A ``wait`` brings back the values of the keys it waited for, and the next ``get`` of each is answered
from them without another call: rendezvous keys are written once, and Gloo reads every key it waits
for (``hvdray.collective.transport.mesh_store`` makes its connect one wait for all ranks' keys), and
that wait brings back only this rank's part of each peer's Gloo record (``hvdray.collective.gloo_record``).

A wait on keys of an epoch that is over (a newer one formed, or the elastic driver abandoned it
because a member died) raises :class:`HorovodInternalError` at once: an elastic worker then waits
for the next epoch instead of for ``timeout_s``.
"""

from __future__ import annotations

import datetime
import functools
from typing import Any, Callable, Optional, Union

import ray
import torch.distributed as dist

from hvdray.collective import gloo_record
from hvdray.collective.errors import HorovodInternalError
from hvdray.collective.transport.mesh_store import RecordStore
from hvdray.testing import faults


class CoordinatorStore(RecordStore):
    """A Store backed by the coordinator's key-value table, under ``prefix``.

    ``resolve`` turns what a coordinator call returns into its answer: ``ray.get`` for the actor; an
    in-process coordinator (``benchmarks/control_plane_scale.py``) passes its own."""

    def __init__(self, coordinator: Any, prefix: str, timeout_s: float, resolve: Callable[[Any], Any] = ray.get) -> None:
        super().__init__()
        self._coordinator = coordinator
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._resolve = resolve
        # values a wait brought back, until their first get; a Gloo record's part is rebuilt at its get
        self._waited: dict[str, Union[bytes, Callable[[], bytes]]] = {}

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _seconds(self, timeout: Optional[datetime.timedelta]) -> float:
        if timeout is None or timeout.total_seconds() <= 0:
            return self._timeout_s
        return timeout.total_seconds()

    def _raise_for(self, status: str, keys: Any, seconds: float) -> None:
        if status == "superseded":
            raise HorovodInternalError(
                f"the membership epoch of rendezvous key(s) {keys} is over (a member left or a newer epoch formed)"
            )
        if status != "ok":
            raise TimeoutError(f"rendezvous key(s) {keys} did not all appear within {seconds} s")

    def set(self, key: str, value: Any) -> None:
        faults.reached("rendezvous")  # test-only: a fault armed for this rank's first rendezvous call fires
        self._waited.pop(key, None)
        self._resolve(self._coordinator.kv_set.remote(self._key(key), bytes(value)))

    def get(self, key: str) -> bytes:
        if key in self._waited:
            value = self._waited.pop(key)
            return value() if callable(value) else value
        faults.reached("rendezvous")
        status, value = self._resolve(self._coordinator.kv_get.remote(self._key(key), self._timeout_s))
        self._raise_for(status, [key], self._timeout_s)
        return value

    def add(self, key: str, amount: int) -> int:
        faults.reached("rendezvous")
        self._waited.pop(key, None)
        return self._resolve(self._coordinator.kv_add.remote(self._key(key), int(amount)))

    def wait(self, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> None:
        self._read(keys, timeout, None)

    def read_records(self, keys: list[str], reader: int, size: int, timeout: Optional[datetime.timedelta]) -> None:
        self._read(keys, timeout, (reader, size))

    def _read(self, keys: list[str], timeout: Optional[datetime.timedelta], reader: Optional[tuple[int, int]]) -> None:
        """One coordinator call waits for the keys not read yet and brings back their values (each Gloo
        record cut to ``reader``'s part and rebuilt here, if ``reader`` is given)."""
        missing = [k for k in keys if k not in self._waited]
        if not missing:
            return
        faults.reached("rendezvous")
        seconds = self._seconds(timeout)
        status, values = self._resolve(self._coordinator.kv_read.remote([self._key(k) for k in missing], seconds, reader))
        self._raise_for(status, keys, seconds)
        if reader is not None:  # the records' heads and this reader's pair ids: its part of each, rebuilt when read
            values = [functools.partial(gloo_record.as_read_by, part, *reader) for part in gloo_record.parts(*values)]
        self._waited.update(zip(missing, values))

    def prefixed(self, prefix: str) -> "CoordinatorStore":
        return CoordinatorStore(self._coordinator, self._prefix + prefix, self._timeout_s, self._resolve)

    def check(self, keys: list[str]) -> bool:
        return self._resolve(self._coordinator.kv_check.remote([self._key(k) for k in keys]))

    def delete_key(self, key: str) -> bool:
        self._waited.pop(key, None)
        return self._resolve(self._coordinator.kv_delete.remote(self._key(key)))
