"""The worker side of ``hvdrayrun``: run a script as ``__main__`` and stream its output to the driver.

The script runs inside the worker actor process (so its ``hvd.init()`` joins the executor's job), with
the ``horovod`` import alias on (unless a real Horovod is installed there), ``sys.argv`` set, its directory first on ``sys.path`` and the driver's working directory as its own.
Its ``sys.stdout``/``sys.stderr`` go line by line through the ``ray_logger`` channel to the driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import runpy
import sys
import tempfile
import threading
import traceback
from typing import Iterator, Optional, Sequence

from hvdray import alias, ray_logger
from hvdray.collective.errors import caused_by_peer

STREAM_KEY = "hvdrayrun_stream"  # records carrying this key are script output, not user metrics


@dataclasses.dataclass(frozen=True)
class ScriptSpec:
    """What to run: ``python SCRIPT ARGS`` (``source`` travels along for nodes without the file) or ``python -m MODULE ARGS``."""

    args: tuple[str, ...]
    script: Optional[str] = None
    source: Optional[str] = None
    module: Optional[str] = None
    cwd: Optional[str] = None
    horovod_alias: bool = True  # `import horovod.torch` gets hvdray.torch (hvdray/alias.py)


class ScriptFailed(Exception):
    """The script raised or exited non-zero on one rank; carries its exit code and the error's last line."""

    def __init__(self, rank: int, exit_code: int, summary: str, caused_by_peer: bool = False) -> None:
        super().__init__(rank, exit_code, summary, caused_by_peer)
        self.rank, self.exit_code, self.summary = rank, exit_code, summary
        self.caused_by_peer = caused_by_peer  # the script failed because another rank did: not the root cause

    def __str__(self) -> str:
        return f"rank {self.rank} exited with code {self.exit_code}: {self.summary}"


class _LineStream(io.TextIOBase):
    """A text stream that sends complete lines to the driver through ``ray_logger``.

    Lines written within ``BATCH_S`` of each other travel as one record, so a chatty script costs at
    most a few Ray calls per second; a timer sends a batch that no later write picks up.
    """

    BATCH_S = 0.1

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._partial = ""
        self._lines: list[str] = []
        self._timer: Optional[threading.Timer] = None
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            *complete, self._partial = (self._partial + text).split("\n")
            self._lines.extend(complete)
            if self._lines and self._timer is None:
                self._timer = threading.Timer(self.BATCH_S, self._send_lines)
                self._timer.daemon = True
                self._timer.start()
        return len(text)

    def _send_lines(self) -> None:
        with self._lock:  # held while sending, so close() cannot overtake a batch in flight
            self._timer = None
            self._send(self._lines)
            self._lines = []

    def _send(self, lines: list[str]) -> None:
        if lines:
            ray_logger.log({STREAM_KEY: self.name, "text": "\n".join(lines)})

    def flush(self) -> None:
        """Nothing to do: complete lines leave within ``BATCH_S``; an unfinished line waits for its end."""

    def close(self) -> None:
        """Send everything written so far, an unfinished last line included (the stream stays usable)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._send(self._lines + ([self._partial] if self._partial else []))
            self._lines, self._partial = [], ""

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return "utf-8"


@contextlib.contextmanager
def _as_main(spec: ScriptSpec, path: Optional[str]) -> Iterator[None]:
    """argv, sys.path, cwd and stdout/stderr as the script expects them; all restored afterwards."""
    argv, path_entries, cwd, stdout, stderr = sys.argv, list(sys.path), os.getcwd(), sys.stdout, sys.stderr
    out, err = _LineStream("stdout"), _LineStream("stderr")
    sys.stdout, sys.stderr = out, err  # first, so that a warning of the alias reaches the driver
    aliased = spec.horovod_alias and not alias.is_installed() and alias.install()
    sys.argv = [path or spec.module or "", *spec.args]
    if spec.cwd and os.path.isdir(spec.cwd):
        os.chdir(spec.cwd)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)) if path else os.getcwd())
    try:
        yield
    finally:
        if aliased:
            alias.uninstall()
        out.close()
        err.close()
        sys.argv, sys.path[:], sys.stdout, sys.stderr = argv, path_entries, stdout, stderr
        os.chdir(cwd)


def _script_path(spec: ScriptSpec, tmp: str) -> Optional[str]:
    """The script on this node: the driver's file if this node has it, else a copy of the shipped source."""
    if spec.script is None:
        return None
    if os.path.isfile(spec.script):
        return spec.script
    copy = os.path.join(tmp, os.path.basename(spec.script))
    with open(copy, "w") as f:
        f.write(spec.source or "")
    return copy


def run_script(spec: ScriptSpec) -> int:
    """Run on every worker: the script as ``__main__``; 0 on success, raises :class:`ScriptFailed` otherwise."""
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    with tempfile.TemporaryDirectory(prefix="hvdrayrun-") as tmp:
        path = _script_path(spec, tmp)
        exit_code, summary, after_peer = 0, "", False
        with _as_main(spec, path):
            try:
                if path is not None:
                    runpy.run_path(path, run_name="__main__")
                else:
                    runpy.run_module(spec.module, run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                exit_code, summary = _exit_code(exc.code), f"SystemExit({exc.code!r})"
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
            except BaseException as exc:  # noqa: BLE001 - reported to the driver as this rank's failure
                _print_script_traceback(exc)
                exit_code, summary = 1, "".join(traceback.format_exception_only(type(exc), exc)).strip()
                after_peer = caused_by_peer(exc)
    if exit_code != 0:
        raise ScriptFailed(rank, exit_code, summary, after_peer)
    return 0


def _print_script_traceback(exc: BaseException) -> None:
    """The traceback as if the script had run alone: the frames of this module and of runpy left out."""
    report = traceback.TracebackException.from_exception(exc)
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if frame.filename not in (__file__, runpy.__file__, "<frozen runpy>")]
    )
    print("".join(report.format()), end="", file=sys.stderr)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    return 1


def format_record(record: dict) -> Sequence[str]:
    """The driver's lines for one record: ``[rank]<stdout>:text`` as horovodrun prints them."""
    rank = record.get("rank", "?")
    if STREAM_KEY in record:
        return [f"[{rank}]<{record[STREAM_KEY]}>:{line}" for line in str(record["text"]).split("\n")]
    fields = ", ".join(f"{k}={v}" for k, v in record.items() if k != "rank")
    return [f"[{rank}]<log>:{fields}"]
