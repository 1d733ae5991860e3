"""Tune the learning rate of a small MLP on scikit-learn's digits data with Bayesian optimisation.

Every Tune trial is a distributed hvdray job (``--num-workers`` workers, each training on its shard of
the data with ``DistributedOptimizer``); ``BayesOptSearch`` proposes the next learning rate from the
accuracies seen so far. Prints every trial and the best one, and exits non-zero if a trial failed or
the best test accuracy is below ``--min-accuracy``.

    python examples/tune_bayesopt.py --num-samples 8 --num-workers 2 --epochs 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ray import tune
from ray.tune.search import ConcurrencyLimiter
from ray.tune.search.bayesopt import BayesOptSearch

from hvdray import init_ray
from hvdray.tune import DistributedTrainableCreator, distributed_checkpoint_dir, report


def train_digits(config: dict) -> None:
    """One trial, on every worker: shard the data by rank, train, report averaged metrics each epoch."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    shard = slice(hvd.rank(), None, hvd.size())
    x_train, y_train = torch.from_numpy(x_train[shard]), torch.from_numpy(y_train[shard])
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    lr = 10 ** config["log10_lr"]
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(config["seed"])

    for epoch in range(config["epochs"]):
        model.train()
        order = torch.randperm(len(x_train), generator=generator)
        total, batches = 0.0, 0
        for start in range(0, len(order), config["batch_size"]):
            idx = order[start : start + config["batch_size"]]
            optimizer.zero_grad()
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        loss, accuracy = hvd.allreduce(torch.tensor([total / batches, accuracy], dtype=torch.float64)).tolist()
        if epoch == config["epochs"] - 1:  # keep the trained model: rank 0 writes, Tune stores it
            with distributed_checkpoint_dir(step=epoch) as path:
                torch.save(model.state_dict(), os.path.join(path, "model.pt"))
        report({"epoch": epoch + 1, "loss": loss, "accuracy": accuracy, "lr": lr})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=8, help="trials (learning rates) to try")
    parser.add_argument("--num-workers", type=int, default=2, help="hvdray workers per trial")
    parser.add_argument("--max-concurrent", type=int, default=1, help="trials at once (BayesOpt learns from each)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    parser.add_argument("--storage", default=None, help="Tune's storage path (default: Ray's, ~/ray_results)")
    parser.add_argument("--address", default=None, help="Ray address ('auto' for a running cluster; default $RAY_ADDRESS, else a local Ray)")
    args = parser.parse_args(argv)

    init_ray(args.address, num_cpus=max(4, args.num_workers * args.max_concurrent))

    trainable = DistributedTrainableCreator(train_digits, num_hosts=1, num_slots=args.num_workers, num_cpus_per_slot=1)
    search = ConcurrencyLimiter(
        BayesOptSearch(random_state=args.seed, random_search_steps=3), max_concurrent=args.max_concurrent
    )
    started = time.monotonic()
    tuner = tune.Tuner(
        trainable,
        param_space={
            "log10_lr": tune.uniform(-4.0, -0.5),
            "epochs": args.epochs, "batch_size": args.batch_size, "seed": args.seed,
        },
        tune_config=tune.TuneConfig(
            metric="accuracy", mode="max", search_alg=search, num_samples=args.num_samples,
            reuse_actors=True,  # the next trial reuses the previous trial's workers
        ),
        run_config=tune.RunConfig(name="tune_bayesopt", storage_path=args.storage and os.path.abspath(args.storage), verbose=0),
    )
    results = tuner.fit()
    print(f"results (trials, checkpoints): {results.experiment_path}")  # kept after the run, for Tuner.restore
    finished = [r for r in results if r.error is None and r.metrics]
    for r in sorted(finished, key=lambda r: r.config["log10_lr"]):
        print(f"trial  lr {10 ** r.config['log10_lr']:.5f}  loss {r.metrics['loss']:.4f}  "
              f"accuracy {r.metrics['accuracy']:.4f}", flush=True)
    if results.errors or not finished:
        for error in results.errors:
            print(f"FAILED: a trial raised {error!r}", file=sys.stderr)
        if not finished:
            print("FAILED: no trial finished", file=sys.stderr)
        return 1
    best = results.get_best_result()
    has_model = best.checkpoint is not None and os.path.exists(os.path.join(best.checkpoint.path, "model.pt"))
    print(
        f"best of {len(finished)} trials on {args.num_workers} workers each ({time.monotonic() - started:.1f} s): "
        f"lr {10 ** best.config['log10_lr']:.5f}, test accuracy {best.metrics['accuracy']:.4f}, "
        f"checkpoint {'saved' if has_model else 'MISSING'}"
    )
    if best.metrics["accuracy"] < args.min_accuracy:
        print(f"FAILED: best accuracy {best.metrics['accuracy']:.4f} < --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    if not has_model:
        print("FAILED: the best trial has no checkpoint", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
