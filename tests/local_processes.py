"""Shared by the end-to-end tests that start Ray from its command line (``ray start``, ``ray up``): free
ports, the processes a test started (found by a marker in their command line, never by name) and
ending them by pid."""

from __future__ import annotations

import os
import socket
from typing import Optional

import psutil


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def processes_using(marker: str, user: Optional[str] = None) -> list[psutil.Process]:
    """Processes whose command line mentions ``marker`` (e.g. the temp dir a test gave Ray), or that run
    as ``user``, with all their children; never this process."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline", "username"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or ()) or (user and proc.info["username"] == user):
                for p in [proc, *proc.children(recursive=True)]:
                    found[p.pid] = p
        except psutil.Error:
            continue
    found.pop(os.getpid(), None)
    return list(found.values())


def kill(processes: list[psutil.Process]) -> None:
    """Kill each process by pid and wait (up to 10 s) for them to be gone."""
    for proc in processes:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=10)
