"""hvdray vs raw torch.distributed Gloo vs DDP on Gloo, in the same worker processes.

Every measurement runs inside the same Ray worker actors, alternating the implementations A B A B
(``--repeats`` rounds), so machine noise hits all of them alike; the report gives medians and ratios, and beside
each ratio the lowest and highest of the rounds' own ratios (:func:`harness.rounds_range`).

    python benchmarks/bench.py --workers 2 --repeats 5    # full run (several minutes)
    python benchmarks/bench.py --quick                   # a smoke run (well under two minutes)

Measures (a) at 4, 16, 64 and 256 MB: one core's copy and add speed and, against the memory ideal they
give (``bandwidth.py``), the bus bandwidth of allreduce (in place and out of place), allgather and
broadcast, hvdray and raw Gloo, (b) one step's gradient reduction for
160 x 16 KB tensors and for ResNet-50's 161 parameter shapes, (c) training throughput of a small CNN
and an MLP on scikit-learn's digits with ``DistributedOptimizer`` vs DDP, with 1 and ``--workers``
workers (alternating round by round), and the scaling efficiency between them, beside the ceiling: each
worker training alone with a plain optimizer, exchanging nothing, and (d) the
time from starting workers to the first finished allreduce (hvdray's ``RayExecutor`` vs plain Ray
actors with ``init_process_group``), and (e) the CPU an idle engine thread uses. Horovod itself is not measured: its Gloo controller needs its own
launcher and cannot join workers that hvdray started (``meta.horovod`` says whether it is installed).
Writes ``bench.json``, ``bench.md`` (the table the README quotes) and ``bench.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import ray
import ray.cloudpickle

import bandwidth
import bench_shm
from harness import MODELS, alternate, rounds_range, setup_raw_gloo, timed, training_round

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

RESULTS = Path("benchmarks") / "results"
SECTIONS = ("bandwidth", "steps", "training", "start", "idle", "shm")


def resnet50_gradient_shapes() -> list[tuple[int, ...]]:
    """The 161 parameter shapes of torchvision's ResNet-50, built without torchvision."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for blocks, width in ((3, 64), (4, 128), (6, 256), (3, 512)):
        for block in range(blocks):
            shapes += [(width, in_ch, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(width * 4, width, 1, 1), (width * 4,), (width * 4,)]
            if block == 0:
                shapes += [(width * 4, in_ch, 1, 1), (width * 4,), (width * 4,)]
            in_ch = width * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


# -- what runs inside every worker ----------------------------------------------------------------
def _many_small_round(shapes: list[tuple[int, ...]], iterations: int) -> dict[str, float]:
    """One step's gradient reduction: raw Gloo per tensor and hand-fused, DDP's buckets, hvdray with one
    async allreduce per gradient and with one ``grouped_allreduce`` of all of them
    (``DistributedOptimizer(groups=1)``), and ``DistributedOptimizer``'s backward pass and
    ``synchronize()`` on the same parameters, beside DDP's backward pass."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import hvdray.torch as hvd

    grads = [torch.ones(s) for s in shapes]
    flat = torch.ones(sum(g.numel() for g in grads))

    class Parameters(torch.nn.Module):
        """A module whose parameters have the given shapes; its backward yields all-ones gradients."""

        def __init__(self) -> None:
            super().__init__()
            self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

        def forward(self) -> torch.Tensor:
            return sum(p.sum() for p in self.params)

    ddp = DistributedDataParallel(Parameters())
    net = Parameters()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0), op=hvd.Sum,
                                         named_parameters=net.named_parameters())

    def per_tensor() -> None:
        for g in grads:
            dist.all_reduce(g)

    def hand_fused() -> None:
        dist.all_reduce(flat)

    def ddp_backward() -> None:  # includes a trivial backward pass; DDP reduces inside it
        ddp.zero_grad(set_to_none=False)
        ddp().backward()

    def hvdray_step() -> None:
        handles = [hvd.allreduce_async_(g, op=hvd.Sum, name=f"bench.g{i}") for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)

    def hvdray_grouped_step() -> None:
        hvd.synchronize(hvd.grouped_allreduce_async_(grads, op=hvd.Sum, name="bench.group"))

    def hvdray_optimizer_backward() -> None:  # the same trivial backward pass; the hooks submit the gradients
        optimizer.zero_grad(set_to_none=False)
        net().backward()
        optimizer.synchronize()

    return {
        "raw gloo per tensor": timed(per_tensor, iterations),
        "raw gloo hand-fused": timed(hand_fused, iterations),
        "DDP (gloo) backward": timed(ddp_backward, iterations),
        "hvdray": timed(hvdray_step, iterations),
        "hvdray grouped": timed(hvdray_grouped_step, iterations),
        "hvdray DistributedOptimizer backward": timed(hvdray_optimizer_backward, iterations),
    }


def _idle_round(seconds: float) -> dict[str, float]:
    """Percent of one core the engine thread (and the whole worker process) uses while no op is submitted."""
    from hvdray.collective import session

    engine = session.engine()
    engine_clock = time.pthread_getcpuclockid(engine._thread.ident)
    time.sleep(1.0)  # let the engine back off to its idle tick
    thread_before, process_before = time.clock_gettime(engine_clock), time.process_time()
    time.sleep(seconds)
    thread_used = time.clock_gettime(engine_clock) - thread_before
    process_used = time.process_time() - process_before
    return {"hvdray engine thread": 100 * thread_used / seconds, "whole worker process": 100 * process_used / seconds}


def training_rows(record: Any, executors: dict[int, Any], repeats: int, quick: bool) -> None:
    """Samples per second of every model in :data:`MODELS` with DDP and ``DistributedOptimizer`` for each
    number of workers (``executors``: workers -> an executor with that many), alternating the executors
    round by round, and the scaling efficiency from the fewest to the most workers (rate with w workers
    over w/v times the rate with v, from the same round)."""
    fewest, most = min(executors), max(executors)
    for model in MODELS:
        label = {"cnn": "CNN", "mlp": "MLP"}[model]
        rates: dict[int, dict[str, list[float]]] = {w: {} for w in executors}
        for _ in range(repeats):
            for workers, executor in executors.items():
                for impl, value in executor.run(training_round, args=[5 if quick else 40, 64, model])[0].items():
                    rates[workers].setdefault(impl, []).append(value)
        for workers, samples in rates.items():
            plural = "s" if workers > 1 else ""
            record(f"training throughput ({label} on digits, batch 64/worker), {workers} worker{plural}", samples,
                   "samples/s", "DDP (gloo)", True)
        if most > fewest:
            efficiency = {impl: [100 * m / (most / fewest * f) for m, f in zip(rates[most][impl], rates[fewest][impl])]
                          for impl in rates[most]}
            record(f"scaling efficiency {fewest} -> {most} workers ({label})", efficiency, "%", "DDP (gloo)", True)


# -- driver -----------------------------------------------------------------------------------------
def _hvdray_start_to_first_allreduce(workers: int) -> float:
    from hvdray import RayExecutor

    def first() -> float:
        import torch

        import hvdray.torch as hvd

        hvd.init()
        return hvd.allreduce(torch.ones(1)).item()

    started = time.perf_counter()
    with RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=workers) as ex:
        ex.run(first)
        took = time.perf_counter() - started
    return took


@ray.remote(num_cpus=1)
class _PlainWorker:
    """A bare Ray actor that joins a torch.distributed Gloo group: the baseline for start-up time."""

    def address(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return f"tcp://{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    def first_allreduce(self, address: str, rank: int, size: int) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size)
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        dist.destroy_process_group()
        return tensor.item()


def _raw_start_to_first_allreduce(workers: int) -> float:
    started = time.perf_counter()
    actors = [_PlainWorker.remote() for _ in range(workers)]
    address = ray.get(actors[0].address.remote())
    ray.get([a.first_allreduce.remote(address, r, workers) for r, a in enumerate(actors)])
    took = time.perf_counter() - started
    for actor in actors:
        ray.kill(actor)
    return took


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write JSON, markdown and PNG results; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="benchmarks/bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--quick", action="store_true", help="few iterations and small sizes (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--address", default="local", help="Ray address (default: start a local instance)")
    parser.add_argument("--no-shm-rows", action="store_true", help="skip the shared-memory transport's rows")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="which sections to measure (all): (a) bandwidth, (b) steps, (c) training, "
                             "(d) start, (e) idle, and the shared-memory rows (shm)")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2")
    if args.quick:
        args.repeats, args.sizes_mb = 2, [4]

    from hvdray import RayExecutor

    if args.address == "local":
        ray.init(address="local", num_cpus=max(4, args.workers + 1), include_dashboard=False)
    else:
        ray.init(address=args.address)
    rows: list[dict[str, Any]] = []

    def record(
        section: str, samples: dict[str, list[float]], unit: str, baseline: Optional[str], higher_is_better: bool
    ) -> None:
        base = statistics.median(samples[baseline]) if baseline else None
        for impl, values in samples.items():
            median = statistics.median(values)
            ratio = None if base is None else (median / base) if higher_is_better else (base / median)
            rows.append({"section": section, "impl": impl, "median": median, "unit": unit,
                         "samples": values, "vs": baseline, "speed ratio": ratio})
            versus = "" if ratio is None else f"{ratio:6.2f}x vs {baseline}" + (
                rounds_range(values, samples[baseline], higher_is_better) if impl != baseline else "")
            print(f"{section:42s} {impl:38s} {median:12.4g} {unit:10s} {versus}", flush=True)

    started = time.perf_counter()
    try:
        with RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=args.workers) as ex:
            ex.run(setup_raw_gloo)
            n = args.workers
            if "bandwidth" in args.sections:
                bandwidth.bandwidth_rows(record, ex, n, args.sizes_mb, args.repeats, args.quick)
            if "steps" in args.sections:
                small = [(4096,)] * 160  # 160 x 16 KB of float32
                record("step of 160 x 16 KB gradients",
                       alternate(ex, _many_small_round, [small, 3 if args.quick else 20], args.repeats),
                       "s", "raw gloo hand-fused", higher_is_better=False)
                record("step of ResNet-50's 161 gradients", alternate(
                    ex, _many_small_round, [resnet50_gradient_shapes(), 2 if args.quick else 5], args.repeats),
                    "s", "raw gloo hand-fused", higher_is_better=False)
            if "training" in args.sections:
                with RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=1) as single:
                    single.run(setup_raw_gloo)
                    training_rows(record, {1: single, n: ex}, args.repeats, args.quick)
            if "idle" in args.sections:
                record("idle CPU (no ops submitted)", alternate(ex, _idle_round, [1.0 if args.quick else 5.0], 1),
                       "% of a core", None, higher_is_better=False)
        if "start" in args.sections:
            starts: dict[str, list[float]] = {"raw gloo (Ray actors + init_process_group)": [], "hvdray": []}
            for _ in range(1 if args.quick else 3):
                starts["raw gloo (Ray actors + init_process_group)"].append(_raw_start_to_first_allreduce(args.workers))
                starts["hvdray"].append(_hvdray_start_to_first_allreduce(args.workers))
            record("start to first allreduce", starts, "s", "raw gloo (Ray actors + init_process_group)",
                   higher_is_better=False)
        if not args.no_shm_rows and "shm" in args.sections:
            bench_shm.shared_memory_rows(record, [2] if args.quick else [2, 4], args.repeats, args.quick)
    finally:
        ray.shutdown()

    args.out.mkdir(parents=True, exist_ok=True)
    shown = argv if argv is not None else sys.argv[1:]
    meta = {"workers": args.workers, "repeats": args.repeats, "command": " ".join(["python benchmarks/bench.py", *shown]),
            "seconds": round(time.perf_counter() - started, 1),
            "horovod": "installed, not measured" if importlib.util.find_spec("horovod") else "not installed"}
    (args.out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / "bench.md").write_text(_markdown(rows, meta))
    _chart(rows, args.out / "bench.png")
    print(f"wrote {args.out}/bench.json, bench.md, bench.png in {meta['seconds']} s")
    return 0


def _markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"`{meta['command']}` — {meta['workers']} workers on one node, medians of {meta['repeats']} alternating rounds.",
        "",
        "| measurement | implementation | median | unit | speed vs baseline |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for r in rows:
        versus = f"{r['speed ratio']:.2f}x vs {r['vs']}" if r["vs"] else ""
        lines.append(f"| {r['section']} | {r['impl']} | {r['median']:.4g} | {r['unit']} | {versus} |")
    return "\n".join(lines) + "\n"


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = list(dict.fromkeys(r["section"] for r in rows))
    fig, axes = plt.subplots(len(sections), 1, figsize=(9, 2.0 * len(sections)))
    for ax, section in zip(axes if len(sections) > 1 else [axes], sections):
        mine = [r for r in rows if r["section"] == section and r["vs"]]
        if not mine:
            ax.set_axis_off()
            continue
        ax.barh([r["impl"] for r in mine], [r["speed ratio"] for r in mine], color="#4c72b0")
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{section} (speed vs {mine[0]['vs']})", fontsize=9)
        ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
