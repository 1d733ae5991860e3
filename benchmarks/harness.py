"""What every benchmark here shares: the in-worker timing loop, a torch Gloo group beside hvdray's,
the training workload, and the alternating-rounds driver (A B A B, so machine noise hits every
implementation alike).

Benchmarks are scripts outside the package (``python benchmarks/bench.py``); their worker functions
are shipped to Ray workers by value, so the workers need hvdray but not this directory.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def setup_raw_gloo() -> str:
    """Start a torch.distributed Gloo group beside hvdray's (rank 0 picks the port, hvdray shares it)."""
    import socket

    import ray
    import torch
    import torch.distributed as dist

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    if not dist.is_initialized():
        address = None
        if hvd.rank() == 0:
            with socket.socket() as s:
                s.bind((ray.util.get_node_ip_address(), 0))
                address = f"tcp://{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"
        address = hvd.broadcast_object(address, root_rank=0)
        dist.init_process_group("gloo", init_method=address, rank=hvd.rank(), world_size=hvd.size())
    return "ok"


def rounds_range(values: list[float], baseline: list[float], higher_is_better: bool) -> str:
    """`` (rounds LO-HI)``: the lowest and highest of a row's ratios round by round, each against its own round's
    baseline (:func:`alternate` keeps every row's samples in the rounds' order), when there are several rounds;
    else "". How far the machine moved the median of a few rounds."""
    if len(values) < 2 or len(values) != len(baseline):
        return ""
    ratios = [v / b if higher_is_better else b / v for v, b in zip(values, baseline)]
    return f" (rounds {min(ratios):.2f}-{max(ratios):.2f})"


#: untimed calls before each timing, the same for every implementation: DDP builds its buckets in its
#: first step, and hvdray negotiates names in its first step and learns what a step is in its second
WARMUP_CALLS = 3


def timed(fn: Callable[[], Any], iterations: int) -> float:
    import torch.distributed as dist

    for _ in range(WARMUP_CALLS):
        fn()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        fn()
    dist.barrier()
    return (time.perf_counter() - started) / iterations


#: the models ``training_round`` trains: a small CNN and an MLP, plain ``torch.nn`` (no torchvision)
MODELS = ("cnn", "mlp")


#: the training rows' ceiling: every worker trains its own copy and exchanges nothing (what any
#: data-parallel implementation reaches at best with these workers on this machine)
NO_EXCHANGE = "no gradient exchange (ceiling)"


def training_round(steps: int, batch: int, model_name: str = "cnn") -> dict[str, float]:
    """Samples per second of ``model_name`` (:data:`MODELS`) on scikit-learn's digits, with DDP, with
    DistributedOptimizer, and with a plain optimizer that exchanges nothing (:data:`NO_EXCHANGE`)."""
    import torch
    from sklearn.datasets import load_digits
    from torch.nn.parallel import DistributedDataParallel

    import hvdray.torch as hvd

    if model_name not in MODELS:
        raise ValueError(f"model_name must be one of {MODELS}, got {model_name!r}")

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        if model_name == "mlp":
            return torch.nn.Sequential(
                torch.nn.Flatten(), torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                torch.nn.ReLU(), torch.nn.Linear(512, 10),
            )
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, padding=1),
            torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 256),
            torch.nn.ReLU(), torch.nn.Linear(256, 10),
        )

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    shard = torch.arange(hvd.rank(), len(labels), hvd.size())
    images, labels = images[shard], labels[shard]
    loss_fn = torch.nn.CrossEntropyLoss()

    ddp = DistributedDataParallel(model())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    net = model()
    hvd_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), named_parameters=net.named_parameters()
    )
    alone = model()
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.05, momentum=0.9)

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        position = [0]

        def run() -> None:
            start = position[0] % (len(labels) - batch)
            position[0] += batch
            opt.zero_grad()
            loss_fn(m(images[start : start + batch]), labels[start : start + batch]).backward()
            opt.step()

        return run

    return {
        "DDP (gloo)": batch * hvd.size() / timed(step(ddp, ddp_opt), steps),
        "hvdray DistributedOptimizer": batch * hvd.size() / timed(step(net, hvd_opt), steps),
        NO_EXCHANGE: batch * hvd.size() / timed(step(alone, alone_opt), steps),
    }


def alternate(executor: Any, fn: Callable[..., dict[str, float]], args: list[Any], repeats: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, value in executor.run(fn, args=args)[0].items():  # rank 0's view; ranks end together
            samples.setdefault(name, []).append(value)
    return samples


