"""The driver side of ``hvdrayrun``: parse horovodrun-style arguments, start an executor, stream output."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional, Sequence

from hvdray.driver.cluster import init_ray
from hvdray.driver.executor import RayExecutor
from hvdray.runner.script import ScriptFailed, ScriptSpec, format_record, run_script

USAGE = "hvdrayrun -np N [options] python SCRIPT.py [ARGS ...]   (or: python -m MODULE [ARGS ...])"


def build_parser() -> argparse.ArgumentParser:
    """horovodrun's options that mean something on Ray."""
    parser = argparse.ArgumentParser(
        prog="hvdrayrun", usage=USAGE,
        description="Run an unmodified script that calls hvd.init() on Ray workers, one process per rank.",
    )
    parser.add_argument("-np", "--num-proc", dest="np", type=int, help="number of workers (ranks)")
    parser.add_argument("--min-np", type=int, help="elastic: fewest workers (RayExecutor min_workers)")
    parser.add_argument("--max-np", type=int, help="elastic: most workers (RayExecutor max_workers)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs reserved per worker (default 1)")
    parser.add_argument("--use-gpu", action="store_true", help="give every worker a GPU")
    parser.add_argument("--gpus-per-worker", type=float, help="GPUs per worker with --use-gpu (default 1)")
    parser.add_argument("--address", help="Ray cluster address ('auto' for the local node's cluster; "
                                          "default $RAY_ADDRESS, else a new local Ray)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait (timeout_s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="python SCRIPT.py ARGS, or python -m MODULE ARGS")
    return parser


def parse_command(parser: argparse.ArgumentParser, command: Sequence[str]) -> ScriptSpec:
    """``python train.py ARGS`` / ``python -m pkg.mod ARGS`` / ``train.py ARGS`` -> what the workers run."""
    words = list(command)
    if words and os.path.basename(words[0]).startswith("python") and not words[0].endswith(".py"):
        words = words[1:]
    if not words:
        parser.error("no command: give `python SCRIPT.py [ARGS ...]` after the options")
    if words[0] == "-m":
        if len(words) < 2:
            parser.error("`python -m` needs a module name")
        return ScriptSpec(module=words[1], args=tuple(words[2:]), cwd=os.getcwd())
    if words[0].startswith("-"):
        parser.error(f"unsupported python option {words[0]!r}: hvdrayrun runs `python SCRIPT.py` or `python -m MODULE`")
    script = os.path.abspath(words[0])
    if not os.path.isfile(script):
        parser.error(f"script not found: {words[0]}")
    with open(script) as f:
        source = f.read()
    return ScriptSpec(script=script, source=source, args=tuple(words[1:]), cwd=os.getcwd())


def _executor_kwargs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    for name in ("np", "min_np", "max_np"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "-np" if name == "np" else f"--{name.replace('_', '-')}"
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.cpus_per_worker <= 0:
        parser.error(f"--cpus-per-worker must be > 0, got {args.cpus_per_worker}")
    if args.gpus_per_worker is not None and not args.use_gpu:
        parser.error("--gpus-per-worker needs --use-gpu")
    kwargs = {"cpus_per_worker": args.cpus_per_worker, "use_gpu": args.use_gpu, "gpus_per_worker": args.gpus_per_worker}
    if args.min_np is not None or args.max_np is not None:
        # Elastic: -np is the starting size in horovodrun; RayExecutor takes the bounds.
        return {**kwargs, "min_workers": args.min_np or args.np, "max_workers": args.max_np}
    if args.np is None:
        parser.error("-np is required (or --min-np/--max-np for elastic training)")
    return {**kwargs, "num_workers": args.np}


def _print_record(record: dict) -> None:
    for line in format_record(record):
        print(line, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``hvdrayrun``; returns the process exit code (the failing rank's, or 0)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    spec = parse_command(parser, args.command)
    executor_kwargs = _executor_kwargs(parser, args)
    settings = RayExecutor.create_settings(timeout_s=args.timeout)
    try:
        executor = RayExecutor(settings, **executor_kwargs)
    except (ValueError, NotImplementedError) as exc:
        print(f"hvdrayrun: error: {exc}", file=sys.stderr)
        return 2
    workers = args.np or args.max_np or args.min_np
    init_ray(args.address, num_cpus=math.ceil(workers * args.cpus_per_worker), log_to_driver=False)
    try:
        executor.start()
        executor.run(run_script, args=[spec], callbacks=[_print_record])
    except ScriptFailed as exc:
        print(f"hvdrayrun: rank {exc.rank} failed with exit code {exc.exit_code}: {exc.summary}", file=sys.stderr)
        return exc.exit_code if 0 < exc.exit_code < 256 else 1
    except Exception as exc:  # noqa: BLE001 - the launcher's own failures (placement, lost worker)
        print(f"hvdrayrun: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        executor.shutdown()
    return 0
