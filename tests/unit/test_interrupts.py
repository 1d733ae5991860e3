"""Interrupts held back on the main thread while the engine's work there must not stop halfway.

The first tests check the hold itself, with a fresh :class:`InterruptHold` per test and a real SIGINT
(``signal.raise_signal``: its Python handler runs in this thread before the next line). Every test
body catches ``KeyboardInterrupt`` itself, so a hold that leaks one fails that test instead of ending the
pytest session. The last ones interrupt a real size-1 job (``hvd.init()`` with no executor) in a fresh
process, the way Ctrl-C or a notebook's *interrupt kernel* does, at random moments of a training loop.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from hvdray.collective.engine.interrupts import InterruptHold


@pytest.fixture
def hold(python_sigint_handler):
    """A fresh hold, under Python's own SIGINT handler (tests/conftest.py)."""
    return InterruptHold()


def _interrupt() -> None:
    signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("depth", [1, 2])
def test_an_interrupt_inside_sections_is_raised_when_the_outermost_ends(hold, depth):
    reached = []
    try:
        with hold:
            with contextlib.ExitStack() as inner:
                for _ in range(depth - 1):
                    inner.enter_context(hold)
                _interrupt()
                reached.append("after the signal")
            reached.append("inner sections ended")
        reached.append("after the outermost section")
    except KeyboardInterrupt:
        reached.append("KeyboardInterrupt")
    assert reached == ["after the signal", "inner sections ended", "KeyboardInterrupt"]
    assert hold.delivered == 1 and hold.pending is None and hold.depth == 0


def test_outside_a_section_an_interrupt_is_raised_at_once(hold):
    with hold:
        pass  # installs the stand-in
    reached = []
    try:
        _interrupt()
        reached.append("went on")
    except KeyboardInterrupt:
        reached.append("KeyboardInterrupt")
    assert reached == ["KeyboardInterrupt"]
    assert hold.delivered == 1


def test_a_users_own_handler_runs_once_the_section_ends(hold):
    seen = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with hold:
            _interrupt()
            assert seen == []
        assert seen == [signal.SIGINT]
    except KeyboardInterrupt:
        pytest.fail("the user's handler was replaced by Python's default")


def test_an_ignored_sigint_stays_ignored(hold):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with hold:
        _interrupt()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert hold.delivered == 0


def test_other_threads_hold_nothing(hold):
    depths = []

    def enter_from_a_thread():
        with hold:
            depths.append(hold.depth)

    thread = threading.Thread(target=enter_from_a_thread)
    thread.start()
    thread.join()
    assert depths == [0]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # nothing installed from there


def test_release_puts_the_handler_back(hold):
    with hold:
        pass
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    hold.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


_INTERRUPTED_TRAINING = textwrap.dedent(
    """
    import json, os, random, signal, sys, threading, time
    import torch
    import hvdray.torch as hvd
    from hvdray.collective.engine.interrupts import INTERRUPTS

    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(int(sys.argv[1]))
    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x = torch.randn(16, 32)
    ones = torch.ones(100)
    report = {"interrupts": 0, "errors": []}
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()  # from the first submission on, SIGINT goes through hvdray's stand-in, which counts it
    for trial in range(int(sys.argv[2])):
        timer = threading.Timer(random.uniform(0.0, 0.02), os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            while True:  # a training loop, and a blocking op of its own, until Ctrl-C
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
                hvd.allreduce(ones)
        except KeyboardInterrupt:
            report["interrupts"] += 1
        except Exception as exc:
            report["errors"].append(f"{type(exc).__name__}: {exc}")
            break
        timer.join()
    # the job goes on as if nothing happened: a whole step, and a blocking op
    try:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        report["sum after"] = hvd.allreduce(ones, name="after", op=hvd.Sum).sum().item()
    except Exception as exc:
        report["errors"].append(f"after: {type(exc).__name__}: {exc}")
    report["delivered"] = INTERRUPTS.delivered
    report["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print("REPORT " + json.dumps(report))
    hvd.shutdown()
    """
)


@pytest.mark.parametrize("seed", [1, 2])
def test_ctrl_c_at_any_moment_of_training_leaves_a_working_job(seed):
    """Without the hold, an interrupt that lands in a caller's tick ends the engine ("collective
    communication failed"), and one that lands between a gradient's submission and its handle being kept
    makes the next step's zero_grad refuse or submit a name twice: seen within the first three of these
    interrupts."""
    trials = 25
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_TRAINING, str(seed), str(trials)],
        capture_output=True, text=True, timeout=180,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(lines[0][len("REPORT "):])
    assert report["errors"] == []
    assert report["interrupts"] == trials == report["delivered"]
    assert report["sum after"] == 100.0 and report["finite"]
