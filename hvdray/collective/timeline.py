"""The timeline: a Chrome-trace JSON file of what the engine did with each tensor, in Horovod's terms.

Every tensor is one row (a trace "thread") inside its process set's "process" (pid 0 is the global
set), named as Horovod names it: the op, a dot, the tensor's name (``allreduce.grad.3``; a generated
name already reads ``allreduce.noname.7``). Its events are Horovod's: ``NEGOTIATE_<OP>`` (submitted
until every rank had it), then the op itself (``ALLREDUCE``, ``BROADCAST``, ...; ready until done)
holding ``QUEUE`` (ready until its batch started) and, for allreduce, ``MEMCPY_IN_FUSION_BUFFER``,
``REDUCE`` (the transport's reduction, Horovod's ``GLOO_ALLREDUCE``; its ``args`` give how many
tensors shared it) and ``MEMCPY_OUT_FUSION_BUFFER``. Events are complete (``X``) events that nest on
the tensor's row. The first metadata event carries ``start_time_since_epoch_in_micros``, the wall
clock at time stamp 0, as Horovod's does. ``mark_cycles`` adds a ``CYCLE_START`` instant for every
engine tick that had work. The file is a JSON array, closed by ``stop``; a file cut short by a crash
still opens in Perfetto, which accepts a missing ``]``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Optional

from hvdray.collective.protocol import GENERATED_NAME_MARK

log = logging.getLogger(__name__)

_FLUSH_EVERY = 512  # events buffered before a write


class Timeline:
    """Writes one rank's trace events to ``path``; safe to call from several engine threads."""

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self._origin = time.perf_counter()
        started_us = time.time_ns() // 1000
        self._lock = threading.Lock()
        self._file: Optional[Any] = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._file.write("[\n")
        self._pending: list[str] = []
        self._rows: dict[tuple[int, str], int] = {}
        self._named_pids: set[int] = {0}
        self._emit({"name": "process_name", "ph": "M", "pid": 0,
                    "args": {"name": "global process set", "start_time_since_epoch_in_micros": started_us}})

    @staticmethod
    def row_name(op: str, name: str) -> str:
        """Horovod's name of an op's tensor: ``allreduce.grad.3`` for ``name="grad.3"`` (a generated name,
        ``allreduce.noname.7``, already is one)."""
        return name if GENERATED_NAME_MARK in name else f"{op}.{name}"

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 1)

    def _row(self, pid: int, row: str) -> int:
        """The trace thread id of ``row`` in process ``pid``, announcing its name the first time."""
        key = (pid, row)
        tid = self._rows.get(key)
        if tid is None:
            tid = self._rows[key] = len(self._rows) + 1
            if pid not in self._named_pids:
                self._named_pids.add(pid)
                self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"process set {pid}"}})
            self._emit({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": row}})
        return tid

    def _emit(self, event: dict[str, Any]) -> None:
        self._pending.append(json.dumps(event, separators=(",", ":")))

    def phase(self, pid: int, row: str, name: str, start: float, end: float, args: Optional[dict] = None) -> None:
        """One complete event ``name`` on ``row`` from ``start`` to ``end`` (``time.perf_counter`` seconds)."""
        with self._lock:
            if self._file is None:
                return
            event = {"name": name, "ph": "X", "pid": pid, "tid": self._row(pid, row), "ts": self._us(start),
                     "dur": max(self._us(end) - self._us(start), 0.0)}
            if args:
                event["args"] = args
            self._emit(event)
            if len(self._pending) >= _FLUSH_EVERY:
                self._flush()

    def cycle(self, pid: int, at: float) -> None:
        """An instant event marking one engine tick with work (only with ``mark_cycles``)."""
        if not self.mark_cycles:
            return
        with self._lock:
            if self._file is not None:
                self._emit({"name": "CYCLE_START", "ph": "i", "s": "p", "pid": pid, "tid": 0, "ts": self._us(at)})

    def _flush(self) -> None:
        if self._pending and self._file is not None:
            self._file.write("".join(line + ",\n" for line in self._pending))
            self._file.flush()
        self._pending = []

    def close(self) -> None:
        """Write what is buffered and close the JSON array; later events are dropped."""
        with self._lock:
            if self._file is None:
                return
            self._flush()
            end = {"name": "TIMELINE_END", "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": self._us(time.perf_counter())}
            self._file.write(json.dumps(end, separators=(",", ":")) + "\n]\n")
            self._file.close()
            self._file = None
        log.debug("timeline written to %s", self.path)
