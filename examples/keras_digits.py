"""Train a small Keras 3 model on scikit-learn's bundled digits data with hvdray on Ray.

Each worker fits on its own shard with ``hvd.DistributedOptimizer``; the callbacks make every worker
start from rank 0's weights, warm the learning rate up, and average the metrics over the workers.
Runs on an embedded local Ray cluster by default, or on an existing one with ``--address auto``.
Prints per-epoch loss and accuracy and exits non-zero if the final test accuracy is below
``--min-accuracy``.

    python examples/keras_digits.py --num-workers 2 --epochs 10
"""

from __future__ import annotations

import argparse
import sys
import time

from hvdray import RayExecutor, init_ray, ray_logger


def train(epochs: int, lr: float, batch_size: int, seed: int) -> dict:
    """Runs on every worker: shard the data by rank, fit with DistributedOptimizer, report metrics."""
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hvdray.tensorflow.keras as hvd

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    keras.utils.set_random_seed(seed + hvd.rank())  # different on purpose: the broadcast callback evens them out

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    shard = slice(hvd.rank(), None, hvd.size())  # each rank trains on its own 1/size of the data
    x_train, y_train = x_train[shard], y_train[shard]

    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])
    scaled_lr = lr * hvd.size()
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

    class Report(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            if hvd.rank() == 0:
                ray_logger.log({"epoch": epoch + 1, "loss": logs["loss"], "accuracy": logs["val_accuracy"]})

    history = model.fit(
        x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=0,
        validation_data=(x_test, y_test),
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),  # before the callbacks that read the metrics
            hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=min(3, epochs)),
            Report(),
        ],
    )
    records = [
        {"epoch": i + 1, "loss": loss, "accuracy": acc}
        for i, (loss, acc) in enumerate(zip(history.history["loss"], history.history["val_accuracy"]))
    ]
    return {"rank": hvd.rank(), "size": hvd.size(), "history": records}


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
        executor.start(extra_env_vars={"TF_CPP_MIN_LOG_LEVEL": "2"})
        results = executor.run(train, args=[args.epochs, args.lr, args.batch_size, args.seed], callbacks=[show])
    final = results[0]["history"][-1]
    print(
        f"trained on {results[0]['size']} workers in {time.monotonic() - started:.1f} s: "
        f"final loss {final['loss']:.4f}, test accuracy {final['accuracy']:.4f}"
    )
    if final["accuracy"] < args.min_accuracy:
        print(f"FAILED: accuracy {final['accuracy']:.4f} < --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
