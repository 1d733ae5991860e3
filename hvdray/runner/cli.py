"""The driver side of ``hvdrayrun``: parse horovodrun's arguments, start an executor, stream output.

horovodrun's options that mean something on Ray set the executor (-np, -H, --min-np ...) or the settings
(--fusion-threshold-mb ...: explicit, so they win over HVDRAY_* and HOROVOD_* variables); the ones that
cannot apply (MPI, jsrun, NCCL) are refused with the reason, and ssh options are accepted with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

from hvdray.driver.cluster import init_ray
from hvdray.driver.executor import RayExecutor
from hvdray.environment import LOG_LEVELS
from hvdray.runner.script import ScriptFailed, ScriptSpec, format_record, run_script

USAGE = "hvdrayrun -np N [options] python SCRIPT.py [ARGS ...]   (or: python -m MODULE [ARGS ...])"


_MPI = "hvdray does not use MPI: its collectives run over Gloo from torch.distributed"
_RAY_STARTS = "Ray starts the workers on its nodes, so hvdrayrun has no hosts to reach"
#: horovodrun options that cannot apply on Ray: (flags, takes a value, why); each is refused with its reason
REFUSED: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("--mpi",), False, _MPI),
    (("--mpi-args",), True, _MPI),
    (("--tcp",), False, _MPI + " (--tcp restricts MPI to TCP)"),
    (("--binding-args",), True, _MPI + " (--binding-args are mpirun's)"),
    (("--mpi-threads-disable", "--no-mpi-threads-disable"), False, _MPI),
    (("--jsrun",), False, "hvdray launches through Ray, not LSF's jsrun"),
    (("--num-nccl-streams",), True, "hvdray's collectives run on the CPU over Gloo (no NCCL)"),
    (("--thread-affinity",), True, "hvdray does not pin its engine thread; Ray places the worker processes"),
    (("--hierarchical-allgather", "--no-hierarchical-allgather"), False,
     "hvdray's allgather across nodes is one Gloo allgather (no hierarchical form)"),
    (("--torus-allreduce", "--no-torus-allreduce"), False,
     "hvdray has no torus allreduce (--hierarchical-allreduce is its multi-node form)"),
    (("--host-discovery-script",), True,
     "elastic hvdrayrun discovers slots from Ray's own cluster state (RayExecutor(settings.discovery) for custom "
     "discovery)"),
    (("--slots-per-host", "--slots"), True, "elastic slots per node come from Ray's free CPUs / --cpus-per-worker"),
    (("--config-file",), True, "not implemented: pass the options on the command line"),
    (("--output-filename",), True, "not implemented: every rank's output is printed with its [rank] prefix"),
)
#: horovodrun options that are accepted and have nothing to do here (a note says so)
IGNORED: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("-p", "--ssh-port"), True, _RAY_STARTS),
    (("-i", "--ssh-identity-file"), True, _RAY_STARTS),
    (("--gloo",), False, "Gloo is what hvdray always uses"),
    (("--log-with-timestamp", "--log-without-timestamp", "--log-hide-timestamp", "--no-log-hide-timestamp"), False,
     "hvdray logs through Python's logging"),
)


class _Refuse(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Optional[str] = None):
        parser.error(f"{option} is not supported by hvdrayrun: {self.help}")


class _Ignore(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Optional[str] = None):
        print(f"hvdrayrun: note: {option} is ignored: {self.help}", file=sys.stderr)


class _CheckBuild(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Optional[str] = None):
        print(check_build_report())
        parser.exit(0)


def check_build_report() -> str:
    """``hvdrayrun --check-build``: what this hvdray can use, as horovodrun lists it."""
    import importlib.util

    from hvdray.collective.build import summary

    frameworks = [(name, importlib.util.find_spec(module) is not None)
                  for name, module in (("PyTorch", "torch"), ("TensorFlow", "tensorflow"))]
    rows = "\n".join(f"    [{'X' if available else ' '}] {name}" for name, available in frameworks + summary())
    return f"hvdray v{_version()}:\n\nAvailable frameworks and controllers/ops:\n{rows}"


def _on_off(group: Any, flag: str, dest: str, help_on: str) -> None:
    """``--flag`` / ``--no-flag`` setting ``dest`` to True / False (None when neither is given)."""
    pair = group.add_mutually_exclusive_group()
    pair.add_argument(f"--{flag}", dest=dest, action="store_const", const=True, help=help_on)
    pair.add_argument(f"--no-{flag}", dest=dest, action="store_const", const=False, help=f"turn {flag} off")


def build_parser() -> argparse.ArgumentParser:
    """horovodrun's options: those that mean something on Ray set the executor or the settings, the rest are refused."""
    parser = argparse.ArgumentParser(
        prog="hvdrayrun", usage=USAGE,
        description="Run an unmodified Horovod script (import horovod.torch or hvdray.torch) on Ray workers, one "
        "process per rank.",
    )
    parser.add_argument("-v", "--version", action="version", version=f"hvdray {_version()}")
    parser.add_argument("-cb", "--check-build", action=_CheckBuild, nargs=0, help="show what hvdray is built with")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, help="number of workers (ranks)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs reserved per worker (default 1)")
    parser.add_argument("--use-gpu", action="store_true", help="give every worker a GPU")
    parser.add_argument("--gpus-per-worker", type=float, help="GPUs per worker with --use-gpu (default 1)")
    parser.add_argument("--address", help="Ray cluster address ('auto' for the local node's cluster; "
                                          "default $RAY_ADDRESS, else a new local Ray)")
    parser.add_argument("--timeout", "--gloo-timeout-seconds", dest="timeout", type=float,
                        help="seconds a collective may wait (timeout_s; default 30)")
    parser.add_argument("--start-timeout", type=float,
                        help="seconds to wait for the cluster to grant the workers (placement_group_timeout_s)")
    parser.add_argument("--network-interfaces", "--network-interface", dest="nics",
                        help="comma-separated network interfaces Gloo may use (nics)")
    parser.add_argument("--verbose", action="store_true", help="hvdray's debug logging (verbose=2)")
    parser.add_argument("--log-level", choices=[level.upper() for level in LOG_LEVELS], type=str.upper,
                        help="TRACE/DEBUG turn on hvdray's debug logging")
    parser.add_argument("--no-horovod-alias", dest="horovod_alias", action="store_false",
                        help="do not map `import horovod...` to hvdray in the workers")
    parser.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                        help="prefix every output line with the time the driver received it")

    hosts = parser.add_argument_group("hosts (the shape of the job on Ray's nodes)")
    exclusive = hosts.add_mutually_exclusive_group()
    exclusive.add_argument("-H", "--hosts", help="HOST:SLOTS,...: as many nodes as hosts, SLOTS workers on each "
                                                 "(the same SLOTS everywhere); Ray picks the nodes")
    exclusive.add_argument("-hostfile", "--hostfile", help="a file of `HOST slots=N` lines, read as -H")

    params = parser.add_argument_group("tunable parameters (settings)")
    params.add_argument("--fusion-threshold-mb", type=float, help="fusion_threshold_mb")
    params.add_argument("--cycle-time-ms", type=float, help="cycle_time_ms")
    params.add_argument("--cache-capacity", type=int, help="cache_capacity")
    params.add_argument("--disable-cache", action="store_true", help="cache_capacity=0")
    _on_off(params, "hierarchical-allreduce", "hierarchical_allreduce", "hierarchical_allreduce=True")
    _on_off(params, "autotune", "autotune", "autotune=True")
    params.add_argument("--autotune-log-file", help="autotune_log_file")
    params.add_argument("--autotune-warmup-samples", type=int, help="autotune_warmup_samples")
    params.add_argument("--autotune-steps-per-sample", type=int, help="autotune_steps_per_sample")
    params.add_argument("--autotune-bayes-opt-max-samples", type=int, help="autotune_bayes_opt_max_samples")
    params.add_argument("--autotune-gaussian-process-noise", type=float, help="autotune_gaussian_process_noise")
    params.add_argument("--timeline-filename", help="timeline_filename")
    _on_off(params, "timeline-mark-cycles", "timeline_mark_cycles", "timeline_mark_cycles=True")
    stall = params.add_mutually_exclusive_group()
    stall.add_argument("--no-stall-check", dest="stall_check", action="store_const", const=False,
                       help="stall_check=False")
    stall.add_argument("--stall-check", dest="stall_check", action="store_const", const=True, help="stall_check=True")
    params.add_argument("--stall-check-warning-time-seconds", type=float, help="stall_warning_s")
    params.add_argument("--stall-check-shutdown-time-seconds", type=float, help="stall_shutdown_s")

    elastic = parser.add_argument_group("elastic")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                         help="fewest workers (RayExecutor min_workers)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                         help="most workers (RayExecutor max_workers)")
    elastic.add_argument("--elastic-timeout", type=float, help="seconds below --min-np before the job fails")
    elastic.add_argument("--reset-limit", type=int, help="membership changes allowed")
    elastic.add_argument("--blacklist-cooldown-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                         help="seconds a failing node is left out, growing from MIN to MAX")

    unavailable = parser.add_argument_group("horovodrun options that do not apply on Ray")
    for flags, takes_value, why in REFUSED:
        unavailable.add_argument(*flags, action=_Refuse, nargs=1 if takes_value else 0, help=why)
    for flags, takes_value, why in IGNORED:
        unavailable.add_argument(*flags, action=_Ignore, nargs=1 if takes_value else 0, help=why)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="python SCRIPT.py ARGS, or python -m MODULE ARGS")
    return parser


def _version() -> str:
    import hvdray

    return hvdray.__version__


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


def parse_hosts(parser: argparse.ArgumentParser, hosts: Optional[str], hostfile: Optional[str]) -> list[int]:
    """Slots per host from ``-H h1:2,h2:2`` or a hostfile of ``h1 slots=2`` lines (a host without slots has 1)."""
    if hostfile is not None:
        try:
            with open(hostfile) as f:
                lines = [line.split("#")[0].strip() for line in f]
        except OSError as exc:
            parser.error(f"--hostfile: cannot read {hostfile}: {exc.strerror}")
        entries = []
        for line in filter(None, lines):
            name, _, rest = line.partition(" ")
            rest = rest.strip()
            if rest and not rest.startswith("slots="):
                parser.error(f"--hostfile: expected `HOST slots=N` lines, got {line!r}")
            entries.append(f"{name}:{rest[len('slots='):]}" if rest else name)
        flag = "--hostfile"
    elif hosts is not None:
        entries, flag = [h.strip() for h in hosts.split(",") if h.strip()], "-H/--hosts"
    else:
        return []
    slots = []
    for entry in entries:
        _, _, count = entry.rpartition(":") if ":" in entry else ("", "", "1")
        if not count.isdigit() or int(count) < 1:
            parser.error(f"{flag}: slots must be an integer >= 1, got {entry!r}")
        slots.append(int(count))
    if not slots:
        parser.error(f"{flag}: no hosts given")
    return slots


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
    elastic = {"reset_limit": args.reset_limit, "cooldown_range": tuple(args.blacklist_cooldown_range or ()) or None}
    if args.min_np is not None or args.max_np is not None:
        # Elastic: -np is the starting size in horovodrun; RayExecutor takes the bounds.
        return {**kwargs, **elastic, "min_workers": args.min_np or args.np, "max_workers": args.max_np}
    for flag, value in (("--reset-limit", args.reset_limit), ("--blacklist-cooldown-range", args.blacklist_cooldown_range),
                        ("--elastic-timeout", args.elastic_timeout)):
        if value is not None:
            parser.error(f"{flag} needs --min-np or --max-np (an elastic run)")
    slots = parse_hosts(parser, args.hosts, args.hostfile)
    if slots:
        total = sum(slots)
        if args.np is not None and args.np > total:
            parser.error(f"-np {args.np} is more than the {total} slots of the hosts given")
        if args.np is None or args.np == total:
            if len(set(slots)) != 1:
                parser.error(f"hosts with different numbers of slots ({slots}): hvdray places the same number of "
                             "workers on each node; give equal slots or use -np alone")
            return {**kwargs, "num_hosts": len(slots), "num_workers_per_host": slots[0]}
    if args.np is None:
        parser.error("-np is required (or -H/--hostfile, or --min-np/--max-np for elastic training)")
    return {**kwargs, "num_workers": args.np}


def settings_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the options give explicitly; the rest come from HVDRAY_*, then HOROVOD_*, then defaults."""
    given = {
        "timeout_s": args.timeout,
        "placement_group_timeout_s": args.start_timeout,
        "nics": [n.strip() for n in args.nics.split(",") if n.strip()] if args.nics else None,
        "fusion_threshold_mb": args.fusion_threshold_mb,
        "cycle_time_ms": args.cycle_time_ms,
        "cache_capacity": 0 if args.disable_cache else args.cache_capacity,
        "hierarchical_allreduce": args.hierarchical_allreduce,
        "autotune": args.autotune,
        "autotune_log_file": args.autotune_log_file,
        "autotune_warmup_samples": args.autotune_warmup_samples,
        "autotune_steps_per_sample": args.autotune_steps_per_sample,
        "autotune_bayes_opt_max_samples": args.autotune_bayes_opt_max_samples,
        "autotune_gaussian_process_noise": args.autotune_gaussian_process_noise,
        "timeline_filename": args.timeline_filename,
        "timeline_mark_cycles": args.timeline_mark_cycles,
        "stall_check": args.stall_check,
        "stall_warning_s": args.stall_check_warning_time_seconds,
        "stall_shutdown_s": args.stall_check_shutdown_time_seconds,
        "elastic_timeout": args.elastic_timeout,
        "verbose": 2 if args.verbose else (LOG_LEVELS[args.log_level.lower()] if args.log_level else None),
    }
    return {name: value for name, value in given.items() if value is not None}


def _printer(timestamps: bool) -> Callable[[dict], None]:
    def print_record(record: dict) -> None:
        stamp = time.strftime("%a %b %d %H:%M:%S %Y") if timestamps else None
        for line in format_record(record):
            print(f"{stamp}{line}" if stamp else line, flush=True)

    return print_record


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``hvdrayrun``; returns the process exit code (the failing rank's, or 0)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    spec = dataclasses.replace(parse_command(parser, args.command), horovod_alias=args.horovod_alias)
    executor_kwargs = _executor_kwargs(parser, args)
    try:
        settings = RayExecutor.create_settings(**settings_kwargs(args))
        if "min_workers" in executor_kwargs:  # the executor's own elastic_timeout wins over the settings'
            executor_kwargs["elastic_timeout"] = settings.elastic_timeout
        executor = RayExecutor(settings, **executor_kwargs)
    except (ValueError, NotImplementedError) as exc:
        print(f"hvdrayrun: error: {exc}", file=sys.stderr)
        return 2
    workers = executor_kwargs.get("num_workers") or (
        executor_kwargs.get("num_hosts", 0) * executor_kwargs.get("num_workers_per_host", 0)
    ) or args.max_np or args.min_np or args.np
    init_ray(args.address, num_cpus=math.ceil(workers * args.cpus_per_worker), log_to_driver=False)
    try:
        executor.start()
        executor.run(run_script, args=[spec], callbacks=[_printer(args.prefix_output_with_timestamp)])
    except ScriptFailed as exc:
        print(f"hvdrayrun: rank {exc.rank} failed with exit code {exc.exit_code}: {exc.summary}", file=sys.stderr)
        return exc.exit_code if 0 < exc.exit_code < 256 else 1
    except KeyboardInterrupt:
        print("hvdrayrun: interrupted; the workers were stopped", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C ended
    except Exception as exc:  # noqa: BLE001 - the launcher's own failures (placement, lost worker)
        print(f"hvdrayrun: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        executor.shutdown()
    return 0
