"""Train the digits MLP on Ray Datasets: every rank streams its own equal shard of the data.

scikit-learn's bundled digits (no download) become two Ray Datasets, ``train`` and ``test``; the
executor splits each into one shard per worker (``executor.run(fn, datasets=...)``) and every worker
reads its shard with ``hvdray.get_dataset_shard(name).iter_torch_batches(...)``. Prints the loss and
test accuracy (over the whole test set) of every epoch and exits non-zero below ``--min-accuracy``.

    python examples/ray_data_digits.py --num-workers 2 --epochs 10
"""

from __future__ import annotations

import argparse
import sys
import time

import hvdray
from hvdray import RayExecutor, init_ray, ray_logger


def digits_datasets(seed: int) -> dict:
    """The digits as Ray Datasets of rows ``{"x": 64 floats, "y": label}``, split 75 / 25 into train and test."""
    import numpy as np
    import ray
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return {
        "train": ray.data.from_items([{"x": row, "y": int(label)} for row, label in zip(x_train, y_train)]),
        "test": ray.data.from_items([{"x": row, "y": int(label)} for row, label in zip(x_test, y_test)]),
    }


def train(epochs: int, lr: float, batch_size: int, seed: int) -> dict:
    """Runs on every worker: read this rank's shards, train with DistributedOptimizer, report metrics."""
    import torch

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(seed + hvd.rank())  # different on purpose: broadcast_parameters makes them equal
    train_shard, test_shard = hvdray.get_dataset_shard("train"), hvdray.get_dataset_shard("test")

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    loss_fn = torch.nn.CrossEntropyLoss()

    history = []
    for epoch in range(epochs):
        model.train()
        total_loss, batches = 0.0, 0
        # every rank gets the same number of rows (equal split), so the same number of steps
        for batch in train_shard.iter_torch_batches(batch_size=batch_size, local_shuffle_buffer_size=256,
                                                     local_shuffle_seed=seed + epoch):
            optimizer.zero_grad()
            loss = loss_fn(model(batch["x"]), batch["y"])
            loss.backward()
            optimizer.step()
            total_loss, batches = total_loss + loss.item(), batches + 1
        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for batch in test_shard.iter_torch_batches(batch_size=256):
                correct += int((model(batch["x"]).argmax(1) == batch["y"]).sum())
                seen += len(batch["y"])
        loss_mean = hvd.allreduce(torch.tensor([total_loss / max(batches, 1)], dtype=torch.float64)).item()
        counts = hvd.allreduce(torch.tensor([correct, seen], dtype=torch.float64), op=hvd.Sum)
        record = {"epoch": epoch + 1, "loss": loss_mean, "accuracy": (counts[0] / counts[1]).item()}
        history.append(record)
        if hvd.rank() == 0:
            ray_logger.log(record)
    return {"rank": hvd.rank(), "size": hvd.size(), "history": history, "test_rows": int(counts[1].item())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.02, help="per-worker learning rate (scaled by size)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    parser.add_argument("--address", default=None, help="Ray address ('auto' for a running cluster; default $RAY_ADDRESS, else a local Ray)")
    args = parser.parse_args(argv)

    # the workers hold one CPU each; Ray Data's read tasks need CPUs of their own beside them
    init_ray(args.address, num_cpus=args.num_workers + 2)

    def show(record: dict) -> None:
        print(f"epoch {record['epoch']:3d}  loss {record['loss']:.4f}  accuracy {record['accuracy']:.4f}", flush=True)

    settings = RayExecutor.create_settings(timeout_s=60)
    started = time.monotonic()
    with RayExecutor(settings, num_workers=args.num_workers) as executor:
        results = executor.run(train, args=[args.epochs, args.lr, args.batch_size, args.seed], callbacks=[show],
                               datasets=digits_datasets(args.seed))
    final = results[0]["history"][-1]
    print(
        f"trained on {results[0]['size']} workers from Ray Datasets in {time.monotonic() - started:.1f} s: "
        f"final loss {final['loss']:.4f}, test accuracy {final['accuracy']:.4f} over {results[0]['test_rows']} rows"
    )
    if final["accuracy"] < args.min_accuracy:
        print(f"FAILED: accuracy {final['accuracy']:.4f} < --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
