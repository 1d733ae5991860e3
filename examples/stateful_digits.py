"""Train step by step with a stateful executable: the model lives on the workers between calls.

``executor.start(executable_cls=DigitsTrainer)`` builds one trainer per worker; each
``executor.execute(lambda trainer: trainer.train_epoch())`` runs one more epoch on the same workers, so
the driver decides between epochs (here: lower the learning rate halfway). A live progress bar and a
metrics history are fed by what the workers report; ``--plot-dir`` saves the history as PNG, CSV and JSON.
Exits non-zero if the final test accuracy is below ``--min-accuracy``.

    python examples/stateful_digits.py --num-workers 2 --epochs 10 --plot-dir /tmp/digits
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hvdray import MetricsHistory, ProgressBar, RayExecutor, init_ray, ray_logger


class DigitsTrainer:
    """One per worker: its shard of the digits data, the model and the distributed optimizer."""

    def __init__(self, lr: float, batch_size: int, seed: int) -> None:
        import numpy as np
        import torch
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        import hvdray.torch as hvd

        hvd.init()
        torch.set_num_threads(1)
        torch.manual_seed(seed + hvd.rank())  # differs on purpose: broadcast_parameters makes them equal
        self.hvd, self.torch = hvd, torch
        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32)
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
        shard = slice(hvd.rank(), None, hvd.size())
        self.x_train, self.y_train = torch.from_numpy(x_train[shard]), torch.from_numpy(y_train[shard])
        self.x_test, self.y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        self.optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=lr * hvd.size(), momentum=0.9),
            named_parameters=self.model.named_parameters(),
        )
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0

    def set_lr(self, lr: float) -> float:
        """New per-worker learning rate (scaled by the number of workers, as at the start)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * self.hvd.size()
        return lr

    def train_epoch(self) -> dict:
        """One pass over this worker's shard; metrics averaged over the workers, reported by rank 0."""
        torch, hvd = self.torch, self.hvd
        self.model.train()
        order = torch.randperm(len(self.x_train), generator=self.generator)
        total, batches = 0.0, 0
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            self.optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(self.x_train[idx]), self.y_train[idx])
            loss.backward()
            self.optimizer.step()
            total, batches = total + loss.item(), batches + 1
        self.model.eval()
        with torch.no_grad():
            accuracy = (self.model(self.x_test).argmax(1) == self.y_test).float().mean().item()
        loss, accuracy = hvd.allreduce(torch.tensor([total / batches, accuracy], dtype=torch.float64)).tolist()
        self.epoch += 1
        record = {"epoch": self.epoch, "loss": loss, "accuracy": accuracy,
                  "lr": self.optimizer.param_groups[0]["lr"] / hvd.size()}
        if hvd.rank() == 0:
            ray_logger.log(record)
        return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.02, help="per-worker learning rate for the first half")
    parser.add_argument("--lr-decay", type=float, default=0.1, help="the learning rate is multiplied by this halfway")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    parser.add_argument("--plot-dir", type=Path, help="save the metrics history here (history.png/.csv/.json)")
    parser.add_argument("--address", default=None, help="Ray address ('auto' for a running cluster; default $RAY_ADDRESS, else a local Ray)")
    args = parser.parse_args(argv)
    init_ray(args.address, num_cpus=max(4, args.num_workers))

    history = MetricsHistory()
    started = time.monotonic()
    with RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=args.num_workers) as executor, \
            ProgressBar(total=args.epochs, desc="digits") as progress:
        executor.start(executable_cls=DigitsTrainer, executable_kwargs=dict(lr=args.lr, batch_size=args.batch_size, seed=args.seed))
        for epoch in range(1, args.epochs + 1):
            if epoch == args.epochs // 2 + 1:
                lr = executor.execute(lambda trainer: trainer.set_lr(args.lr * args.lr_decay))[0]
                progress.bar.write(f"learning rate lowered to {lr:g} on the same workers")
            record = executor.execute(lambda trainer: trainer.train_epoch(), callbacks=[progress, history])[0]
            progress.bar.write(f"epoch {record['epoch']:3d}  loss {record['loss']:.4f}  accuracy {record['accuracy']:.4f}  lr {record['lr']:g}")
    final = history.rows[-1]
    print(f"trained {len(history)} epochs on {args.num_workers} workers in {time.monotonic() - started:.1f} s: "
          f"final loss {final['loss']:.4f}, test accuracy {final['accuracy']:.4f}")
    if args.plot_dir is not None:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        png = args.plot_dir / "history.png"
        history.plot(png)
        print(f"saved {png}, {history.to_csv(args.plot_dir / 'history.csv')}, {history.to_json(args.plot_dir / 'history.json')}")
    if final["accuracy"] < args.min_accuracy:
        print(f"FAILED: accuracy {final['accuracy']:.4f} < --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
