"""Elastic training on scikit-learn's bundled digits data: the job follows the Ray cluster's size.

Workers come and go with the cluster's nodes (between ``--min-workers`` and ``--max-workers``); a lost
worker rolls the others back to the last commit and training goes on. Starts an embedded local Ray by
default; joins a cluster only when asked (``--address auto``, or under ``ray job submit``, which sets
``RAY_ADDRESS``). ``--kill-worker-at-epoch``
makes one worker exit mid-epoch once, to watch a recovery. Prints per-epoch progress and exits
non-zero if training fails or the final accuracy is below ``--min-accuracy``.

    python examples/elastic_digits.py --min-workers 1 --max-workers 2 --epochs 8 --kill-worker-at-epoch 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from hvdray import RayExecutor, init_ray, ray_logger


def train(epochs: int, lr: float, batch_size: int, seed: int, kill_at_epoch: int, kill_marker: str) -> dict:
    """Runs on every worker: elastic state, data sharded by an ElasticSampler, one commit per epoch."""
    import os

    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(seed)

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    train_set = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=seed)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, history=[])

    def rescale_lr() -> None:  # the gradient is averaged over a different number of workers now
        for group in optimizer.param_groups:
            group["lr"] = lr * hvd.size()

    state.register_reset_callbacks([rescale_lr])
    loss_fn = torch.nn.CrossEntropyLoss()

    @hvd.elastic.run
    def run_epochs(state) -> list:
        while state.epoch < epochs:
            loader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, sampler=state.sampler)
            model.train()
            total_loss, batches = 0.0, 0
            for batch, (xb, yb) in enumerate(loader):
                optimizer.zero_grad()
                loss = loss_fn(model(xb), yb)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(batch, batch_size)
                total_loss, batches = total_loss + loss.item(), batches + 1
                if state.epoch == kill_at_epoch and hvd.rank() == hvd.size() - 1 and hvd.size() > 1 \
                        and batch == 2 and not os.path.exists(kill_marker):
                    open(kill_marker, "w").close()
                    os._exit(1)  # a crash: the driver notices, the others roll back and go on
            model.eval()
            with torch.no_grad():
                correct = (model(x_test).argmax(1) == y_test).float().mean().item()
            metrics = hvd.allreduce(torch.tensor([total_loss / max(batches, 1), correct], dtype=torch.float64))
            record = {"epoch": state.epoch + 1, "workers": hvd.size(), "loss": metrics[0].item(),
                      "accuracy": metrics[1].item()}
            state.history.append(record)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            if hvd.rank() == 0:
                ray_logger.log(record)
        return state.history

    history = run_epochs(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "history": history}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.02, help="per-worker learning rate (scaled by size)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    parser.add_argument("--kill-worker-at-epoch", type=int, default=-1, help="one worker exits once in this epoch")
    parser.add_argument("--cooldown", type=float, nargs=2, default=(2.0, 10.0),
                        help="seconds a failed node is left out (first failure, longest)")
    parser.add_argument("--address", default=None,
                        help="Ray address ('auto' for a running cluster; default $RAY_ADDRESS, else a local Ray)")
    args = parser.parse_args(argv)

    init_ray(args.address, num_cpus=max(4, int(args.max_workers * args.cpus_per_worker)))

    def show(record: dict) -> None:
        if record.get("event") == "elastic":
            print(f"[driver] {record['previous']} -> {record['state']}: {record['reason']}", flush=True)
        elif "epoch" in record:
            print(f"epoch {record['epoch']:3d}  workers {record['workers']}  loss {record['loss']:.4f}  "
                  f"accuracy {record['accuracy']:.4f}", flush=True)

    settings = RayExecutor.create_settings(timeout_s=30)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="hvdray-elastic-") as scratch, \
                RayExecutor(settings, min_workers=args.min_workers, max_workers=args.max_workers,
                            cpus_per_worker=args.cpus_per_worker, cooldown_range=tuple(args.cooldown),
                            elastic_timeout=120) as executor:
            marker = str(Path(scratch) / "killed")  # makes --kill-worker-at-epoch kill one worker only once
            results = executor.run(
                train,
                args=[args.epochs, args.lr, args.batch_size, args.seed, args.kill_worker_at_epoch, marker],
                callbacks=[show],
            )
    except Exception as exc:  # noqa: BLE001 - a command-line tool reports and exits non-zero
        print(f"FAILED: elastic training did not finish: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    history = results[0]["history"]
    final = history[-1]
    print(
        f"trained {len(history)} epochs, ending on {results[0]['size']} worker(s), in "
        f"{time.monotonic() - started:.1f} s: final loss {final['loss']:.4f}, test accuracy {final['accuracy']:.4f}"
    )
    if [h["epoch"] for h in history] != list(range(1, args.epochs + 1)):
        print(f"FAILED: committed epochs {[h['epoch'] for h in history]} are not 1..{args.epochs}", file=sys.stderr)
        return 1
    if final["accuracy"] < args.min_accuracy:
        print(f"FAILED: accuracy {final['accuracy']:.4f} < --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
