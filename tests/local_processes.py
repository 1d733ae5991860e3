"""Shared by the tests that start Ray from its command line (``ray start``, ``ray up``) or start Ray
drivers as processes of their own: free ports, the processes a test started (found by a marker in their
command line, never by name), ending them by pid, a driver refused by a cluster, and the line writer of
the driver scripts whose output a test reads."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from typing import Optional

import psutil


#: the head of a driver script whose output a test reads: ``say(label, value)`` writes ``label value`` and its
#: newline in one write (``print`` writes its pieces apart, and Ray's log thread can print between them)
SAY_SOURCE = """import sys


def say(label, value):
    sys.stdout.write(f"{label} {value}\\n")
    sys.stdout.flush()

"""


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


def refused(argv: list[str], env: dict[str, str], refusal: str, joined: str, limit_s: float = 120.0) -> str:
    """Run ``argv`` (a driver that tries to join a cluster) until its output shows ``refusal``, the
    cluster's own words for turning it away, and return its output so far.

    A refused Ray driver keeps retrying for 20-30 s before it exits; the refusal shows in its first
    second, so the process is killed (by pid) once it is seen. Fails if the driver prints ``joined``, or
    exits or runs ``limit_s`` without the refusal: a driver that merely cannot connect (a wrong address,
    a dead head) fails for another reason and does not pass."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(limit_s, proc.kill)  # a driver silent for too long: its output ends with it
    timer.start()
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if joined in line:
                raise AssertionError(f"{argv} joined the cluster:\n{''.join(lines)}")
            if refusal in line:
                return "".join(lines)
        raise AssertionError(f"{argv} ended (or ran {limit_s:.0f} s) without {refusal!r}:\n{''.join(lines)}")
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()
