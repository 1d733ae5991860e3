"""Train a small MLP on scikit-learn's bundled digits data with hvdray on Ray.

Runs on an embedded local Ray cluster by default, or on an existing one with ``--address auto``.
Prints per-epoch loss and accuracy (averaged over all workers) and exits non-zero if the final test
accuracy is below ``--min-accuracy``.

    python examples/pytorch_digits.py --num-workers 2 --epochs 10
"""

from __future__ import annotations

import argparse
import sys
import time

from hvdray import RayExecutor, init_ray, ray_logger


def train(epochs: int, lr: float, batch_size: int, seed: int) -> dict:
    """Runs on every worker: shard the data by rank, train with DistributedOptimizer, report metrics."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(seed + hvd.rank())  # different on purpose: broadcast_parameters makes them equal

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    shard = slice(hvd.rank(), None, hvd.size())  # each rank trains on its own 1/size of the data
    x_train, y_train = torch.from_numpy(x_train[shard]), torch.from_numpy(y_train[shard])
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(seed)

    history = []
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=generator)
        total_loss, batches = 0.0, 0
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            total_loss, batches = total_loss + loss.item(), batches + 1
        model.eval()
        with torch.no_grad():
            correct = (model(x_test).argmax(1) == y_test).float().mean()
        metrics = hvd.allreduce(torch.tensor([total_loss / batches, correct.item()], dtype=torch.float64))
        record = {"epoch": epoch + 1, "loss": metrics[0].item(), "accuracy": metrics[1].item()}
        history.append(record)
        if hvd.rank() == 0:
            ray_logger.log(record)
    return {"rank": hvd.rank(), "size": hvd.size(), "nodes": hvd.cross_size(), "history": history}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.02, help="per-worker learning rate (scaled by size)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    parser.add_argument("--address", default=None, help="Ray address ('auto' for a running cluster; default $RAY_ADDRESS, else a local Ray)")
    args = parser.parse_args(argv)

    init_ray(args.address, num_cpus=max(4, int(args.num_workers * args.cpus_per_worker)))

    def show(record: dict) -> None:
        print(f"epoch {record['epoch']:3d}  loss {record['loss']:.4f}  accuracy {record['accuracy']:.4f}", flush=True)

    settings = RayExecutor.create_settings(timeout_s=60)
    started = time.monotonic()
    with RayExecutor(settings, num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker) as executor:
        executor.start()
        results = executor.run(train, args=[args.epochs, args.lr, args.batch_size, args.seed], callbacks=[show])
    final = results[0]["history"][-1]
    print(
        f"trained on {results[0]['size']} workers on {results[0]['nodes']} node(s) in {time.monotonic() - started:.1f} s: "
        f"final loss {final['loss']:.4f}, test accuracy {final['accuracy']:.4f}"
    )
    if final["accuracy"] < args.min_accuracy:
        print(f"FAILED: accuracy {final['accuracy']:.4f} < --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
