"""``hvdray.tensorflow`` and ``hvdray.tensorflow.keras`` on two real Ray workers with real TensorFlow.

* Every op, eagerly and inside ``tf.function`` (static shapes, gradients), against numpy; bad
  arguments and cross-rank mismatches fail clearly.
* ``model.fit`` with ``DistributedOptimizer`` on 2 workers, each on half of every batch, ends with the
  weights of plain Keras on the whole batch in one process (float64, tight tolerance), also when
  the workers start from different weights and ``BroadcastGlobalVariablesCallback`` evens them out.
* ``DistributedGradientTape`` returns the average (or sum) of every rank's gradients: dense, sparse
  (``tf.IndexedSlices``) and ``None`` gradients, eagerly and inside ``tf.function``.
* ``MetricAverageCallback`` and the learning-rate callbacks do what Horovod's do.

Two workers are shared by the whole module (TensorFlow takes seconds to import, so one module, one
worker group); each test is one ``run`` that batches many checks. Inputs are built from (key, rank)
by :func:`_make` on the workers and rebuilt on the driver, which computes what every rank must
receive with numpy only; the single-process Keras references run on rank 0 with plain Keras, so the
driver never imports TensorFlow.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray.cloudpickle

from hvdray import RayExecutor

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module

SIZE = 2
BATCH, STEPS, EPOCHS, LR = 8, 4, 3, 0.1  # model.fit: 4 batches of 8 per epoch
FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["uint8", "int8", "int32", "int64"]
OPS = ["average", "sum", "min", "max", "product"]
TOL = {"float32": 1e-5, "float64": 1e-12, "float16": 1e-2, "bfloat16": 5e-2}


@pytest.fixture(scope="module")
def ex(ray_local):
    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60)
    executor = RayExecutor(settings, num_workers=SIZE)
    executor.start(extra_env_vars={"TF_CPP_MIN_LOG_LEVEL": "2"})
    yield executor
    executor.shutdown()


# -- shared by driver and workers ---------------------------------------------------------------
def _make(key: str, rank: int, dtype: str, shape: tuple) -> np.ndarray:
    """Deterministic small values (exact in bfloat16, no integer overflow in sums and products)."""
    import zlib

    import numpy as np

    rng = np.random.default_rng([zlib.crc32(key.encode()), rank])
    n = int(np.prod(shape))
    if dtype == "bool":
        values = rng.random(n) < 0.5
    elif dtype in ("float32", "float64", "float16", "bfloat16"):
        values = rng.integers(-8, 9, n) / 4.0
    elif dtype == "uint8":
        values = rng.integers(0, 10, n)
    else:
        values = rng.integers(-9, 10, n)
    return np.asarray(values).astype("float32" if dtype == "bfloat16" else dtype).reshape(shape)


def _setup():
    """One TensorFlow thread per worker (the machine is small), then ``hvd.init()``."""
    import tensorflow as tf
    import torch

    import hvdray.tensorflow as hvd

    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    except RuntimeError:
        pass  # already set by an earlier test in this worker
    torch.set_num_threads(1)
    hvd.init()
    return tf, hvd


def _tf(key, rank, dtype, shape):
    import tensorflow as tf

    return tf.cast(tf.constant(_make(key, rank, dtype, shape)), dtype)


def _out(t) -> np.ndarray:
    """A result as numpy (bfloat16, which numpy lacks, as float32)."""
    import tensorflow as tf

    return (tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t).numpy()


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"


# -- driver-side reference ----------------------------------------------------------------------
def _reduce(values: list, op: str, dtype: str) -> np.ndarray:
    stack = np.stack([v.astype(np.float64) if dtype in FLOATS else v.astype(np.int64) for v in values])
    if op == "average":
        total = stack.sum(0)  # an integer average rounds toward zero, as Horovod's
        return stack.mean(0) if dtype in FLOATS else np.sign(total) * (np.abs(total) // len(values))
    return {"sum": stack.sum, "min": stack.min, "max": stack.max, "product": stack.prod}[op](0)


def _close(got, want, dtype, what):
    tol = TOL.get(dtype, 0)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


# -- eager ops ----------------------------------------------------------------------------------
def _eager_ops() -> dict:
    tf, hvd = _setup()
    r = hvd.rank()
    ops = {"average": hvd.Average, "sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}
    out = {"rank": r, "size": hvd.size(), "local": (hvd.local_rank(), hvd.local_size())}
    for dtype in FLOATS + INTS:
        for op in OPS:
            res = hvd.allreduce(_tf(f"ar.{dtype}", r, dtype, (2, 3)), op=ops[op])
            out[f"allreduce.{dtype}.{op}"] = (res.dtype.name, tuple(res.shape), _out(res))
    for op in ("min", "max"):
        out[f"allreduce.bool.{op}"] = _out(hvd.allreduce(_tf("ar.bool", r, "bool", (5,)), op=ops[op]))
    x = _tf("forms", r, "float64", (4,))
    out["average_false"] = _out(hvd.allreduce(x, average=False))
    out["scaled"] = _out(hvd.allreduce(x, prescale_factor=0.5, postscale_factor=3.0, name="scaled"))
    out["fp16"] = _out(hvd.allreduce(tf.cast(x, tf.float32), compression=hvd.Compression.fp16)), "float32"
    out["scalar"] = _out(hvd.allreduce(tf.constant(float(r + 1))))
    out["variable"] = _out(hvd.allreduce(tf.Variable(x)))
    grouped = hvd.grouped_allreduce([_tf("g0", r, "float32", (2, 3)), _tf("g1", r, "int64", (4,)), x], op=hvd.Sum)
    out["grouped"] = [_out(t) for t in grouped]
    for dtype in ("float32", "bfloat16", "int32", "bool"):
        out[f"allgather.{dtype}"] = _out(hvd.allgather(_tf(f"ag.{dtype}", r, dtype, (r + 1, 2))))
    out["broadcast"] = _out(hvd.broadcast(_tf("bc", r, "float64", (3,)), root_rank=1))
    out["broadcast.int8"] = _out(hvd.broadcast(_tf("bc8", r, "int8", (2, 2)), 0))
    sent = _tf("a2a", r, "float32", (3, 2))
    out["alltoall"] = [_out(t) for t in hvd.alltoall(sent, splits=[1, 2] if r == 0 else [2, 1])]
    out["alltoall.even"] = _out(hvd.alltoall(_tf("a2a.even", r, "int32", (4,))))
    out["reducescatter"] = _out(hvd.reducescatter(_tf("rs", r, "float32", (5, 2))))
    out["reducescatter.sum"] = _out(hvd.reducescatter(_tf("rs.sum", r, "int64", (4,)), op=hvd.Sum))
    hvd.barrier()
    out["objects"] = (hvd.broadcast_object({"from": r}, root_rank=1), hvd.allgather_object(("rank", r)))
    plain = tf.Variable(_tf("bv", r, "float32", (2, 2)))
    import keras

    kvar = keras.Variable(_make("kv", r, "float64", (3,)))
    hvd.broadcast_variables([plain, kvar], root_rank=1)
    out["broadcast_variables"] = (plain.numpy(), kvar.numpy())

    # the engine sees TensorFlow's memory and TensorFlow adopts the engine's: no copies on the CPU
    from hvdray.tensorflow.convert import to_tf, to_torch

    t = tf.random.uniform([1024])
    back = to_torch(t) * 2
    out["zero_copy"] = (
        to_torch(t).data_ptr() == np.asarray(t).ctypes.data,
        np.asarray(to_tf(back)).ctypes.data == back.data_ptr(),
    )
    return out


def test_eager_ops_match_numpy(ex):
    res = ex.run(_eager_ops)
    assert [o["rank"] for o in res] == [0, 1] and all(o["size"] == SIZE for o in res)
    for r, o in enumerate(res):
        for dtype in FLOATS + INTS:
            inputs = [_make(f"ar.{dtype}", k, dtype, (2, 3)) for k in range(SIZE)]
            for op in OPS:
                got_dtype, shape, got = o[f"allreduce.{dtype}.{op}"]
                assert got_dtype == dtype and shape == (2, 3), (dtype, op)
                _close(got, _reduce(inputs, op, dtype), dtype, f"rank {r} allreduce {dtype} {op}")
        bools = [_make("ar.bool", k, "bool", (5,)) for k in range(SIZE)]
        assert (o["allreduce.bool.min"] == np.logical_and(*bools)).all()
        assert (o["allreduce.bool.max"] == np.logical_or(*bools)).all()
        xs = [_make("forms", k, "float64", (4,)) for k in range(SIZE)]
        _close(o["average_false"], sum(xs), "float64", "average=False sums")
        _close(o["scaled"], sum(x * 0.5 for x in xs) * 3.0 / SIZE, "float64", "pre/postscale")
        _close(o["fp16"][0], sum(xs) / SIZE, "float16", "fp16 compression")
        _close(o["scalar"], 1.5, "float64", "0-d tensor")
        _close(o["variable"], sum(xs) / SIZE, "float64", "tf.Variable input")
        grouped = [("g0", "float32", (2, 3)), ("g1", "int64", (4,)), ("forms", "float64", (4,))]
        for got, (key, dtype, shape) in zip(o["grouped"], grouped):
            _close(got, _reduce([_make(key, k, dtype, shape) for k in range(SIZE)], "sum", dtype), dtype, key)
        for dtype in ("float32", "bfloat16", "int32", "bool"):
            want = np.concatenate([_make(f"ag.{dtype}", k, dtype, (k + 1, 2)) for k in range(SIZE)])
            np.testing.assert_array_equal(o[f"allgather.{dtype}"], want)
        np.testing.assert_array_equal(o["broadcast"], _make("bc", 1, "float64", (3,)))
        np.testing.assert_array_equal(o["broadcast.int8"], _make("bc8", 0, "int8", (2, 2)))
        sends = [_make("a2a", k, "float32", (3, 2)) for k in range(SIZE)]
        splits = [[1, 2], [2, 1]]
        parts = [sends[k][sum(splits[k][:r]) : sum(splits[k][: r + 1])] for k in range(SIZE)]
        np.testing.assert_array_equal(o["alltoall"][0], np.concatenate(parts))
        np.testing.assert_array_equal(o["alltoall"][1], [splits[k][r] for k in range(SIZE)])
        even = [_make("a2a.even", k, "int32", (4,)) for k in range(SIZE)]
        np.testing.assert_array_equal(o["alltoall.even"], np.concatenate([e[2 * r : 2 * r + 2] for e in even]))
        full = sum(_make("rs", k, "float32", (5, 2)) for k in range(SIZE)) / SIZE
        _close(o["reducescatter"], full[:3] if r == 0 else full[3:], "float32", "reducescatter rows 3+2")
        total = sum(_make("rs.sum", k, "int64", (4,)) for k in range(SIZE))
        np.testing.assert_array_equal(o["reducescatter.sum"], total[2 * r : 2 * r + 2])
        assert o["objects"] == ({"from": 1}, [("rank", 0), ("rank", 1)])
        np.testing.assert_array_equal(o["broadcast_variables"][0], _make("bv", 1, "float32", (2, 2)))
        np.testing.assert_array_equal(o["broadcast_variables"][1], _make("kv", 1, "float64", (3,)))
        assert o["zero_copy"] == (True, True)


# -- inside tf.function, with gradients -----------------------------------------------------------
def _graph_ops() -> dict:
    tf, hvd = _setup()
    r = hvd.rank()
    shapes = {}

    @tf.function
    def step(x, c):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            ar = hvd.allreduce(x)
            ag = hvd.allgather(x[: r + 1])
            bc = hvd.broadcast(x, root_rank=0)
            a2a, received = hvd.alltoall(x, splits=tf.constant([1, 2] if r == 0 else [2, 1]))
            rs = hvd.reducescatter(x, op=hvd.Sum)
            gr = hvd.grouped_allreduce([x, 2.0 * x], op=hvd.Sum)
            losses = {
                "allreduce": tf.reduce_sum(c * ar),
                "allgather": tf.reduce_sum(ag * ag),
                "broadcast": tf.reduce_sum(c * bc),
                "alltoall": tf.reduce_sum(a2a * a2a),
                "reducescatter": tf.reduce_sum(rs * rs),
                "grouped": tf.reduce_sum(gr[0] * c) + tf.reduce_sum(gr[1]),
            }
        shapes.update(ar=ar.shape, ag=ag.shape, bc=bc.shape, a2a=a2a.shape, received=received.shape, rs=rs.shape)
        grads = {k: tape.gradient(v, x) for k, v in losses.items()}
        return {"ar": ar, "ag": ag, "bc": bc, "a2a": a2a, "received": received, "rs": rs, "gr": gr[1]}, grads

    x = tf.constant(_make("gx", r, "float64", (3, 2)))
    c = tf.constant(_make("gc", r, "float64", (3, 2)))
    runs = [step(x, c) for _ in range(2)]  # the second call runs the traced graph again
    values, grads = runs[-1]
    return {
        "shapes": {k: s.as_list() for k, s in shapes.items()},
        "same_twice": all(np.array_equal(runs[0][0][k].numpy(), runs[1][0][k].numpy()) for k in values),
        "values": {k: v.numpy() for k, v in values.items()},
        "grads": {k: g.numpy() for k, g in grads.items()},
    }


def test_ops_inside_tf_function_with_static_shapes_and_gradients(ex):
    res = ex.run(_graph_ops)
    xs = [_make("gx", k, "float64", (3, 2)) for k in range(SIZE)]
    cs = [_make("gc", k, "float64", (3, 2)) for k in range(SIZE)]
    splits = [[1, 2], [2, 1]]
    for r, o in enumerate(res):
        assert o["shapes"] == {
            "ar": [3, 2], "ag": [None, 2], "bc": [3, 2], "a2a": [None, 2], "received": [SIZE], "rs": [None, 2]
        }
        assert o["same_twice"]
        v, g = o["values"], o["grads"]
        _close(v["ar"], sum(xs) / SIZE, "float64", "allreduce")
        np.testing.assert_array_equal(v["ag"], np.concatenate([xs[k][: k + 1] for k in range(SIZE)]))
        np.testing.assert_array_equal(v["bc"], xs[0])
        recv = [xs[k][sum(splits[k][:r]) : sum(splits[k][: r + 1])] for k in range(SIZE)]
        np.testing.assert_array_equal(v["a2a"], np.concatenate(recv))
        np.testing.assert_array_equal(v["received"], [splits[k][r] for k in range(SIZE)])
        total = sum(xs)
        _close(v["rs"], total[:2] if r == 0 else total[2:], "float64", "reducescatter")
        _close(v["gr"], 2 * total, "float64", "grouped_allreduce")
        # Horovod's gradients: the backward op of each collective, run across ranks
        _close(g["allreduce"], sum(cs) / SIZE, "float64", "d allreduce")
        ag_all = np.concatenate([xs[k][: k + 1] for k in range(SIZE)])
        rows = slice(sum(k + 1 for k in range(r)), sum(k + 1 for k in range(r + 1)))
        want = np.zeros((3, 2))
        want[: r + 1] = 2 * ag_all[rows]  # every rank's loss is sum(allgather**2); Horovod averages its gradient
        _close(g["allgather"], want, "float64", "d allgather")
        _close(g["broadcast"], sum(cs) / SIZE if r == 0 else np.zeros((3, 2)), "float64", "d broadcast")
        # alltoall: rank k's loss is sum(a2a_k**2); the gradient for x_r's rows sent to k is 2 * those rows
        _close(g["alltoall"], 2 * xs[r], "float64", "d alltoall")
        rs_all = np.concatenate([total[:2], total[2:]])
        # Horovod's gradient of a Sum reducescatter: every rank's upstream gradient gathered, times size()
        _close(g["reducescatter"], SIZE * 2 * rs_all, "float64", "d reducescatter")
        _close(g["grouped"], sum(cs) + 2 * SIZE, "float64", "d grouped_allreduce")


# -- errors ---------------------------------------------------------------------------------------
def _errors() -> dict:
    tf, hvd = _setup()
    r = hvd.rank()
    x = tf.constant([1.0, 2.0])
    out = {
        "int16": _error(lambda: hvd.allreduce(tf.constant([1], tf.int16))),
        "string": _error(lambda: hvd.allreduce("abc")),
        "op": _error(lambda: hvd.allreduce(x, op="median")),
        "op_and_average": _error(lambda: hvd.allreduce(x, op=hvd.Sum, average=True)),
        "bool_average": _error(lambda: hvd.allreduce(tf.constant([True]))),
        "root": _error(lambda: hvd.broadcast(x, root_rank=SIZE)),
        "process_set": _error(lambda: hvd.allgather(x, process_set="evens")),
        "name": _error(lambda: hvd.allreduce(x, name="")),
        "compression": _error(lambda: hvd.allreduce(x, compression="zip")),
        "scalar_allgather": _error(lambda: hvd.allgather(tf.constant(1.0))),
        "splits_length": _error(lambda: hvd.alltoall(x, splits=[1, 0, 1])),
        "splits_type": _error(lambda: hvd.alltoall(x, splits=[0.5, 1.5])),
        "grouped_not_list": _error(lambda: hvd.grouped_allreduce(x)),
        "session": _error(lambda: hvd.broadcast_object(1, session=object())),
        "variables": _error(lambda: hvd.broadcast_variables([x], root_rank=0)),
        "tape": _error(lambda: hvd.DistributedGradientTape(object())),
        "tape_op": _error(lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Max)),
        "init_args": _error(lambda: hvd.init(comm=[0, 1])),
    }
    # a shape that differs between ranks fails on every rank, eagerly and inside tf.function
    out["mismatch"] = _error(lambda: hvd.allreduce(tf.zeros([r + 1]), name="mismatched"))

    @tf.function(jit_compile=True)
    def compiled(t):
        return hvd.allreduce(t)

    out["xla"] = _error(lambda: compiled(x))

    @tf.function
    def in_graph(t):
        return hvd.allreduce(t, name="mismatched.graph")

    out["mismatch_graph"] = _error(lambda: in_graph(tf.zeros([r + 2])))
    with tf.Graph().as_default():
        dtype_mismatch = hvd.allgather(tf.zeros([2], tf.float32 if r else tf.int32), name="mismatched/../v1")
        with tf.compat.v1.Session() as sess:
            out["mismatch_session"] = _error(lambda: sess.run(dtype_mismatch))
    out["still_works"] = hvd.allreduce(x, op=hvd.Sum).numpy()
    out["int_prescale"] = hvd.allreduce(tf.constant([3]), op=hvd.Sum, prescale_factor=2.0).numpy()
    return out


def test_bad_arguments_and_mismatches_fail_clearly(ex):
    res = ex.run(_errors)
    expected = {
        "int16": ("ValueError", "dtype int16"),  # moved by allgather/broadcast/alltoall, never reduced
        "string": ("ValueError", "dtype string"),
        "op": ("ValueError", "op must be"),
        "op_and_average": ("ValueError", "average="),
        "bool_average": ("ValueError", "bool"),
        "root": ("ValueError", "root_rank"),
        "process_set": ("TypeError", "process_set"),
        "name": ("ValueError", "name"),
        "compression": ("TypeError", "compression"),
        "scalar_allgather": ("ValueError", "scalar"),
        "splits_length": ("ValueError", "splits"),
        "splits_type": ("TypeError", "splits"),
        "grouped_not_list": ("TypeError", "tensors"),
        "session": ("ValueError", "session"),
        "variables": ("TypeError", "variables[0]"),
        "tape": ("TypeError", "gradtape"),
        "tape_op": ("ValueError", "op="),
        "init_args": ("ValueError", "comm"),
        "mismatch": ("TensorMismatchError", "mismatched shapes"),
        "xla": ("ValueError", "jit_compile"),
        "mismatch_graph": ("FailedPreconditionError", "mismatched shapes"),  # as Horovod's ops raise it
        # a TensorFlow 1 graph's Session.run: the same type, dtypes named as TensorFlow names them, and the
        # name's ".." shown as look-alike dots (a path component "..", see bridge.py, would eat the one before)
        "mismatch_session": ("FailedPreconditionError", "'mismatched/\u2024\u2024/v1': rank 0 has tf.int32"),
    }
    for out in res:
        for key, (kind, text) in expected.items():
            assert out[key].startswith(kind + ":") and text in out[key], f"{key}: {out[key]}"
        assert "torch." not in out["int16"]  # dtypes are named as TensorFlow names them
        # scale factors apply to integer tensors too, as in Horovod (the result keeps its dtype)
        assert out["int_prescale"].dtype == np.int32 and out["int_prescale"].tolist() == [6 * SIZE]
        np.testing.assert_array_equal(out["still_works"], [2.0, 4.0])


# -- Keras ---------------------------------------------------------------------------------------
def _setup_keras():
    import keras

    tf, _ = _setup()
    import hvdray.tensorflow.keras as hvd

    return tf, keras, hvd


def _model(keras, seed: int):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((4,), dtype="float64"),
        keras.layers.Dense(6, activation="tanh", dtype="float64"),
        keras.layers.Dense(2, dtype="float64"),
    ])


def _data(rank: int = 0, scale: float = 1.0):
    g = np.random.default_rng(7 + rank)
    x = g.normal(size=(STEPS * BATCH, 4))
    return x, scale * np.stack([np.sin(x).sum(1), x[:, 0] * x[:, 1]], 1)


def _shard(a: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Rank's half of every batch: what plain Keras sees as batch s, rank r sees as its own batch s."""
    per = BATCH // size
    return np.concatenate([a[s * BATCH + rank * per : s * BATCH + (rank + 1) * per] for s in range(STEPS)])


# -- model.fit against one process ----------------------------------------------------------------
CASES = {
    "sgd_same_start": {"optimizer": "sgd"},
    "sgd_different_start": {"optimizer": "sgd", "different_start": True},
    "adam_different_start": {"optimizer": "adam", "different_start": True},
}


def _optimizer(keras, kind: str):
    return keras.optimizers.Adam(0.01) if kind == "adam" else keras.optimizers.SGD(LR)


def _fit(cases: dict) -> dict:
    tf, keras, hvd = _setup_keras()
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    out = {}
    for name, case in cases.items():
        model = _model(keras, 100 + (r if case.get("different_start") else 0))
        start = [w.numpy() for w in model.weights]
        opt = hvd.DistributedOptimizer(_optimizer(keras, case["optimizer"]))
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if case.get("different_start") else []
        model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=callbacks)
        out[name] = {"start": start, "final": [w.numpy() for w in model.weights], "class": type(opt).__name__}
        if r == 0:  # the reference: plain Keras, one process, whole batches, rank 0's starting weights
            ref = _model(keras, 0)
            ref.set_weights(start)
            ref.compile(optimizer=_optimizer(keras, case["optimizer"]), loss="mse", jit_compile=False)
            ref.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
            out[name]["reference"] = [w.numpy() for w in ref.weights]

    # an Embedding's gradient is a tf.IndexedSlices (reduced by allgather); two steps per tf.function call
    ids = np.random.default_rng(11).integers(0, 10, size=(STEPS * BATCH, 3))

    def embedding_model():
        keras.utils.set_random_seed(1)
        return keras.Sequential([
            keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4, dtype="float64"),
            keras.layers.Flatten(), keras.layers.Dense(2, dtype="float64"),
        ])

    model = embedding_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse", steps_per_execution=2)
    model.fit(_shard(ids, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=EPOCHS, shuffle=False, verbose=0)
    out["embedding"] = {"final": [w.numpy() for w in model.weights]}
    if r == 0:
        ref = embedding_model()
        ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        ref.fit(ids, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        out["embedding"]["reference"] = [w.numpy() for w in ref.weights]
    return out


def test_fit_on_two_workers_matches_one_process_on_the_whole_batch(ex):
    res = ex.run(_fit, args=[CASES])
    for name, case in CASES.items():
        ref = res[0][name]["reference"]
        for r in range(SIZE):
            got = res[r][name]
            assert got["class"] == "Distributed" + {"adam": "Adam"}.get(case["optimizer"], "SGD")
            for i, (w, want) in enumerate(zip(got["final"], ref)):
                np.testing.assert_allclose(w, want, rtol=1e-10, atol=1e-10, err_msg=f"{name} rank {r} weight {i}")
            assert all(np.array_equal(a, b) for a, b in zip(got["final"], res[0][name]["final"])), name
        # the comparison is not vacuous: training moved the weights, and the starts really differed
        assert not np.allclose(ref[0], res[0][name]["start"][0], atol=1e-3), name
        starts_differ = not np.array_equal(res[0][name]["start"][0], res[1][name]["start"][0])
        assert starts_differ == bool(case.get("different_start")), name
    for r in range(SIZE):
        for i, (w, want) in enumerate(zip(res[r]["embedding"]["final"], res[0]["embedding"]["reference"])):
            np.testing.assert_allclose(w, want, rtol=1e-10, atol=1e-10, err_msg=f"embedding rank {r} weight {i}")


# -- DistributedGradientTape ---------------------------------------------------------------------
def _tapes() -> dict:
    tf, keras, hvd = _setup_keras()
    import hvdray.tensorflow as hvd_tf

    r = hvd.rank()
    g = np.random.default_rng(3 + r)
    x = tf.constant(g.normal(size=(5, 3)))
    idx = tf.constant([0, 2, 2] if r == 0 else [1, 2])
    w = tf.Variable(np.linspace(-1, 1, 6).reshape(3, 2))
    emb = tf.Variable(np.arange(8.0).reshape(4, 2) / 4)
    unused = tf.Variable([1.0, 2.0], dtype=tf.float64)
    variables = [w, emb, unused]

    def loss():
        return tf.reduce_sum(tf.tanh(x @ w)) + tf.reduce_sum(tf.gather(emb, idx) ** 2)

    def dense(grads):
        return [None if v is None else tf.convert_to_tensor(v).numpy() for v in grads]

    def kinds(grads):
        return [type(v).__name__ for v in grads]

    with tf.GradientTape() as tape:
        value = loss()
    out = {"local": dense(tape.gradient(value, variables))}

    def distributed(**kwargs):
        with tf.GradientTape() as tape:
            value = loss()
        grads = hvd_tf.DistributedGradientTape(tape, **kwargs).gradient(value, variables)
        return dense(grads), kinds(grads)

    out["average"] = distributed()
    # Horovod's groups: count the grouped allreduces (tensors per call) each form makes
    from hvdray.tensorflow import ops as tf_ops

    grouped, calls = tf_ops.grouped_allreduce, []

    def counted(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return grouped(tensors, *args, **kwargs)

    tf_ops.grouped_allreduce = counted
    for key, kwargs in (("groups_int", {"groups": 2}), ("num_groups", {"num_groups": 1}),
                        ("groups_lists", {"groups": [[emb]]})):
        calls.clear()
        reduced, reduced_kinds = distributed(sparse_as_dense=True, **kwargs)
        out[key] = (reduced, reduced_kinds, list(calls))
    tf_ops.grouped_allreduce = grouped
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), name="grouped", groups=[[w]])
    before = w.numpy()
    with tf.GradientTape() as tape:
        value = loss()
    opt.apply_gradients(zip(tape.gradient(value, [w]), [w]))
    out["apply_step_groups"] = (before - w.numpy()) / 0.5
    w.assign(before)  # the checks below take gradients at the starting point
    with tf.GradientTape() as tape:
        value = loss()
    out["groups_foreign"] = _error(lambda: hvd_tf.DistributedGradientTape(tape, groups=[[tf.Variable(1.0)]]).gradient(
        value, variables))
    out["sum"] = distributed(op=hvd_tf.Sum)
    out["dense"] = distributed(sparse_as_dense=True)
    out["predivide"] = distributed(gradient_predivide_factor=4.0)
    out["fp16"] = distributed(compression=hvd_tf.Compression.fp16)

    @tf.function
    def in_graph():
        with hvd_tf.DistributedGradientTape(tf.GradientTape()) as tape:  # wrapped before use
            value = loss()
        return tape.gradient(value, {"w": w, "emb": emb})

    graph = in_graph()
    out["graph"] = {k: tf.convert_to_tensor(v).numpy() for k, v in graph.items()}

    # a custom training step with DistributedOptimizer outside model.fit
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), name="custom")
    before = w.numpy()
    with tf.GradientTape() as tape:
        value = loss()
    opt.apply_gradients(zip(tape.gradient(value, [w]), [w]))
    out["apply_step"] = (before - w.numpy()) / 0.5

    # a model saved with a DistributedOptimizer loads with its optimizer distributed and its state kept
    import os
    import tempfile

    model = _model(keras, 9)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss="mse")
    xs, ys = _data(r)  # different data on each rank
    model.fit(xs[:8], ys[:8], batch_size=8, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    loaded.fit(xs[8:16], ys[8:16], batch_size=8, verbose=0)
    optimizer = loaded.optimizer
    weights = [w.numpy() for w in loaded.weights]
    out["load_model"] = (type(optimizer).__name__, int(optimizer.iterations.numpy()), weights)

    out["errors"] = {
        "not_optimizer": _error(lambda: hvd.DistributedOptimizer(object())),
        "twice": _error(lambda: hvd.DistributedOptimizer(opt)),
        "passes": _error(lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(gradient_accumulation_steps=3), backward_passes_per_step=2)),
        "passes_zero": _error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)),
        "op": _error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Max)),
        "predivide_sum": _error(
            lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum, gradient_predivide_factor=2.0)
        ),
        "tape_twice": _error(lambda: hvd_tf.DistributedGradientTape(hvd_tf.DistributedGradientTape(tf.GradientTape()))),
        "groups_negative": _error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), groups=-1)),
        "groups_empty": _error(lambda: hvd_tf.DistributedGradientTape(tf.GradientTape(), groups=[[w], []])),
        "groups_and_num_groups": _error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), num_groups=2, groups=2)),
        "root_type": _error(lambda: hvd.callbacks.BroadcastGlobalVariablesCallback("0")),
        "warmup_epochs": _error(lambda: hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=0)),
        "initial_lr": _error(lambda: hvd.callbacks.LearningRateScheduleCallback(None, 0.5)),
    }
    # Horovod's Keras value ops: value first, name second
    out["keras_ops"] = (
        hvd.allreduce(float(r), "keras.allreduce").numpy(),
        hvd.allreduce(float(r + 1), "keras.sum", average=False).numpy(),
        hvd.allgather([r], "keras.allgather").numpy(),
        hvd.broadcast([r, r], 1, "keras.broadcast").numpy(),
    )
    return out


def test_distributed_gradient_tape_averages_every_ranks_gradients(ex):
    res = ex.run(_tapes)
    local = [o["local"] for o in res]
    assert local[0][2] is None  # the unused variable has no gradient
    mean = [(a + b) / SIZE for a, b in zip(local[0][:2], local[1][:2])]
    assert not np.allclose(local[0][0], local[1][0])  # ranks really had different gradients
    for r, o in enumerate(res):
        for key, want in (("average", mean), ("dense", mean), ("predivide", mean), ("sum", [m * SIZE for m in mean])):
            grads, kinds = o[key]
            assert grads[2] is None, key
            for i in range(2):
                np.testing.assert_allclose(grads[i], want[i], rtol=1e-12, atol=1e-12, err_msg=f"rank {r} {key} {i}")
            assert (kinds[1] == "IndexedSlices") == (key != "dense"), (key, kinds)  # sparse stays sparse
        np.testing.assert_allclose(o["fp16"][0][0], mean[0], rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(o["graph"]["w"], mean[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(o["graph"]["emb"], mean[1], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(o["apply_step"], mean[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(o["apply_step_groups"], mean[0], rtol=1e-12, atol=1e-12)
        # groups: the same averages, in one grouped allreduce per group (w and emb dense; unused has none)
        for key, want_calls in (("groups_int", [1, 1]), ("num_groups", [2]), ("groups_lists", [1, 1])):
            grads, kinds, calls = o[key]
            assert calls == want_calls, (key, calls)
            assert grads[2] is None and kinds[1] != "IndexedSlices", key
            for i in range(2):
                np.testing.assert_allclose(grads[i], mean[i], rtol=1e-12, atol=1e-12, err_msg=f"rank {r} {key} {i}")
        assert o["groups_foreign"].startswith("ValueError:") and "groups[0][0]" in o["groups_foreign"]
        errors = o["errors"]
        for key, (kind, text) in {
            "not_optimizer": ("TypeError", "optimizer"),
            "twice": ("ValueError", "already"),
            "passes": ("ValueError", "gradient_accumulation_steps"),
            "passes_zero": ("ValueError", "backward_passes_per_step"),
            "op": ("ValueError", "op="),
            "predivide_sum": ("ValueError", "gradient_predivide_factor"),
            "tape_twice": ("ValueError", "already"),
            "groups_negative": ("ValueError", "groups"),
            "groups_empty": ("ValueError", "groups[1]"),
            "groups_and_num_groups": ("ValueError", "num_groups"),
            "root_type": ("TypeError", "root_rank"),
            "warmup_epochs": ("ValueError", "warmup_epochs"),
            "initial_lr": ("ValueError", "initial_lr"),
        }.items():
            assert errors[key].startswith(kind + ":") and text in errors[key], f"{key}: {errors[key]}"
        name, iterations, weights = o["load_model"]
        assert (name, iterations) == ("DistributedSGD", 2)
        assert all(np.array_equal(a, b) for a, b in zip(weights, res[0]["load_model"][2]))  # still averaged
        assert o["keras_ops"][0] == pytest.approx(0.5) and o["keras_ops"][1] == pytest.approx(3.0)
        assert o["keras_ops"][2].tolist() == [0, 1] and o["keras_ops"][3].tolist() == [1, 1]


# -- callbacks -----------------------------------------------------------------------------------
def _callbacks() -> dict:
    tf, keras, hvd = _setup_keras()
    r = hvd.rank()
    out = {}

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs, self.batches = [], []

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append(dict(logs))

        def on_train_batch_begin(self, batch, logs=None):
            opt = self.model.optimizer
            self.batches.append((float(opt.learning_rate.numpy()), [m.numpy() for m in getattr(opt, "momentums", [])]))

    # metric averaging: each rank trains on its own data, with its own validation data
    x, y = _data(r, scale=1.0 + r)
    model = _model(keras, 5)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse", metrics=["mae"])
    raw, averaged = Record(), Record()
    history = model.fit(
        x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x[:8], y[:8]),
        callbacks=[raw, hvd.callbacks.MetricAverageCallback(), averaged],
    )
    out["metrics"] = {"raw": raw.epochs, "averaged": averaged.epochs, "history": history.history}

    # warmup: from initial_lr / size to initial_lr over 2 epochs, batch by batch, with momentum correction
    before, after = Record(), Record()
    model = _model(keras, 6)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[before, warmup, after])
    out["warmup"] = {"before": before.batches, "after": after.batches, "lr_log": history.history["lr"]}

    # staircase schedule: initial_lr * 0.5 ** epoch for epochs 1 and 2 only
    seen = Record()
    model = _model(keras, 7)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.2, multiplier=0.5, start_epoch=1, end_epoch=3)
    model.fit(x[:16], y[:16], batch_size=8, epochs=4, verbose=0, callbacks=[schedule, seen])
    out["schedule"] = [lr for lr, _ in seen.batches]

    # a schedule object cannot be overwritten: a clear error when training starts
    model = _model(keras, 8)
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(decay)), loss="mse")
    warm = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1)
    out["schedule_error"] = _error(lambda: model.fit(x[:8], y[:8], epochs=1, verbose=0, callbacks=[warm]))
    return out


def test_metric_average_and_learning_rate_callbacks(ex):
    res = ex.run(_callbacks)
    # metrics: the callback replaces each rank's metrics by the average over ranks, for every later callback
    raw = [o["metrics"]["raw"] for o in res]
    assert raw[0][0]["loss"] != pytest.approx(raw[1][0]["loss"])
    for o in res:
        for epoch in range(2):
            averaged = o["metrics"]["averaged"][epoch]
            assert set(averaged) == {"loss", "mae", "val_loss", "val_mae"}
            for key, value in averaged.items():
                assert value == pytest.approx((raw[0][epoch][key] + raw[1][epoch][key]) / SIZE, rel=1e-6), key
                assert o["metrics"]["history"][key][epoch] == pytest.approx(value, rel=1e-6), key

    # warmup: lr(epoch, batch) = 0.4 / size * ((epoch + (batch + 1) / steps) * (size - 1) / 2 + 1), then 0.4
    steps = STEPS * BATCH // 8
    for o in res:
        before, after = o["warmup"]["before"], o["warmup"]["after"]
        assert len(after) == 3 * steps
        for i, ((lr0, m0), (lr1, m1)) in enumerate(zip(before, after)):
            epoch, batch = divmod(i, steps)
            want = 0.4 / SIZE * ((epoch + (batch + 1) / steps) * (SIZE - 1) / 2 + 1) if epoch < 2 else 0.4
            assert lr1 == pytest.approx(want, rel=1e-6), (epoch, batch)
            for a, b in zip(m0, m1):  # momentum correction: buffers scaled by new_lr / old_lr
                np.testing.assert_allclose(b, a * (lr1 / lr0), rtol=1e-5, atol=1e-7)
        assert any(np.abs(m).max() > 0 for _, ms in before[1:] for m in ms)  # the buffers were not all zero
        assert o["warmup"]["lr_log"][-1] == pytest.approx(0.4, rel=1e-6)
        assert o["schedule"] == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05], rel=1e-6)
        assert o["schedule_error"].startswith("ValueError:") and "learning_rate" in o["schedule_error"]


# -- Horovod's TensorFlow names and semantics (issue #21) -----------------------------------------
def _horovod_tensorflow() -> dict:
    tf, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    out = {}

    @tf.function
    def job_facts():
        return [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(),
                hvd.process_set_included_op(0), hvd.process_set_included_op(99)]

    out["job_ops"] = ([int(t) for t in job_facts()], int(hvd.rank_op()), int(hvd.size_op()))
    # grouped allgather / reducescatter: values, int16 and uint16 moved as they are, Horovod's gradients
    parts = [_tf("gag.a", r, "float64", (r + 1, 2)), tf.constant(_make("gag.b", r, "int16", (2,)), tf.int16),
             tf.constant(_make("gag.c", r, "uint8", (3,)).astype("uint16"), tf.uint16)]
    out["grouped_allgather"] = [_out(t) for t in hvd.grouped_allgather(parts)]
    out["grouped_allgather.empty"] = hvd.grouped_allgather([])
    out["broadcast.int16"] = _out(hvd.broadcast(parts[1], root_rank=1))
    out["alltoall.uint16"] = _out(hvd.alltoall(tf.constant([r, r + 10], tf.uint16)))
    rs_in = [_tf("grs.a", r, "float64", (4, 2)), _tf("grs.b", r, "float32", (3,))]
    out["grouped_reducescatter"] = [_out(t) for t in hvd.grouped_reducescatter(rs_in, op=hvd.Sum)]

    @tf.function
    def grouped_grads(a, b):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([a, b])
            gathered = hvd.grouped_allgather([a, b])
            scattered = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
            ag_loss = tf.reduce_sum(gathered[0] ** 2) + tf.reduce_sum(gathered[1])
            rs_loss = tf.reduce_sum(scattered[0] ** 2) + tf.reduce_sum(scattered[1])
        return tape.gradient(ag_loss, [a, b]), tape.gradient(rs_loss, [a, b]), gathered, scattered

    a, b = _tf("gg.a", r, "float64", (2, 2)), _tf("gg.b", r, "float64", (4,))
    ag_grads, rs_grads, gathered, scattered = grouped_grads(a, b)
    out["grouped_grads"] = ([_out(g) for g in ag_grads], [_out(g) for g in rs_grads],
                            [_out(t) for t in gathered], [_out(t) for t in scattered])
    # broadcast_ writes root's values into the variables and returns them
    v1, v2 = tf.Variable(_tf("b_.1", r, "float32", (2,))), tf.Variable(_tf("b_.2", r, "int32", (3,)))
    returned = hvd.broadcast_([v1, v2], root_rank=1)
    out["broadcast_"] = ([_out(t) for t in returned], v1.numpy(), v2.numpy())
    # broadcast_global_variables: a TensorFlow 1 graph's globals; eager mode has none and says so
    out["bgv_eager"] = _error(lambda: hvd.broadcast_global_variables(0))
    with tf.Graph().as_default():
        g = tf.compat.v1.Variable(tf.constant([float(r), float(r) + 0.5]))
        bcast = hvd.broadcast_global_variables(1)
        t = tf.ones([2]) * float(r + 1)
        bcast_grad = tf.gradients(hvd.broadcast(t, root_rank=0), t, tf.fill([2], float(r + 1)))[0]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)
            out["bgv_graph"] = sess.run(g)
            # a broadcast's gradient in a Session: the non-root's allreduce must run too (its result is zeros)
            out["broadcast_grad_graph"] = sess.run(bcast_grad)
    # Compression.fp16 on TensorFlow tensors: floats travel as float16, integers as they are
    wire, ctx = hvd.Compression.fp16.compress(tf.constant([1.5, 2.5], tf.float64))
    iwire, ictx = hvd.Compression.fp16.compress(tf.constant([3], tf.int32))
    out["fp16"] = (wire.dtype.name, hvd.Compression.fp16.decompress(wire, ctx).dtype.name, iwire.dtype.name,
                   hvd.Compression.fp16.decompress(iwire, ictx).dtype.name)
    out["fp16_allreduce"] = _out(hvd.allreduce(tf.constant([1.0 + r, 3.0], tf.float64), op=hvd.Sum,
                                               compression=hvd.Compression.fp16))
    out["fp16_grouped"] = [_out(t) for t in hvd.grouped_allreduce(
        [tf.constant([1.0 + r]), tf.constant([2], tf.int64)], op=hvd.Sum, compression=hvd.Compression.fp16)]
    # IndexedSlices: alone or among dense tensors, allgathered; unsupported ops raise NotImplementedError
    slices = tf.IndexedSlices(tf.constant([[1.0 + r, 2.0]]), tf.constant([r]), dense_shape=tf.constant([3, 2]))
    mixed = hvd.grouped_allreduce([slices, tf.constant([2.0 * r])], op=hvd.Average)
    out["sparse_grouped"] = (type(mixed[0]).__name__, _out(mixed[0].values), _out(mixed[0].indices), _out(mixed[1]))
    out["sparse_errors"] = [_error(lambda: hvd.allreduce(slices, op=hvd.Max)),
                            _error(lambda: hvd.allreduce(slices, op=hvd.Sum, prescale_factor=0.5)),
                            _error(lambda: hvd.grouped_allreduce([slices], op=hvd.Adasum))]
    # Horovod's exception types: a cross-rank mismatch, a bad argument found when the op runs
    kinds = {}
    for key, call in {
        "shape": lambda: hvd.allreduce(tf.zeros([r + 1]), name="tf.mismatch.shape"),
        "dtype": lambda: hvd.allgather(tf.zeros([2], tf.float32 if r else tf.float64), name="tf.mismatch.dtype"),
        "root": lambda: hvd.broadcast(tf.zeros([2]), root_rank=r, name="tf.mismatch.root"),
        "splits": lambda: hvd.alltoall(tf.zeros([4]), splits=tf.constant([1, 1])),
        "uneven": lambda: hvd.alltoall(tf.zeros([3])),
    }.items():
        try:
            call()
            kinds[key] = "nothing raised"
        except Exception as exc:  # noqa: BLE001 - the test inspects the types
            kinds[key] = (isinstance(exc, tf.errors.FailedPreconditionError),
                          isinstance(exc, tf.errors.InvalidArgumentError), isinstance(exc, hvd.TensorMismatchError),
                          isinstance(exc, ValueError), str(exc))
    out["error_types"] = kinds
    out["after_errors"] = _out(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum))
    return out


def test_horovod_tensorflow_names_and_semantics(ex):
    res = ex.run(_horovod_tensorflow)
    for r, o in enumerate(res):
        assert o["job_ops"] == ([r, SIZE, r, SIZE, 1, -3], r, SIZE)
        ga = o["grouped_allgather"]
        np.testing.assert_array_equal(ga[0], np.concatenate([_make("gag.a", k, "float64", (k + 1, 2)) for k in range(SIZE)]))
        np.testing.assert_array_equal(ga[1], np.concatenate([_make("gag.b", k, "int16", (2,)) for k in range(SIZE)]))
        assert ga[1].dtype == np.int16 and ga[2].dtype == np.uint16
        np.testing.assert_array_equal(ga[2], np.concatenate([_make("gag.c", k, "uint8", (3,)) for k in range(SIZE)]))
        assert o["grouped_allgather.empty"] == []
        np.testing.assert_array_equal(o["broadcast.int16"], _make("gag.b", 1, "int16", (2,)))
        assert o["alltoall.uint16"].dtype == np.uint16 and o["alltoall.uint16"].tolist() == ([0, 1] if r == 0 else [10, 11])
        sums = [sum(_make(k, q, d, s) for q in range(SIZE)) for k, d, s in (("grs.a", "float64", (4, 2)), ("grs.b", "float32", (3,)))]
        _close(o["grouped_reducescatter"][0], sums[0][2 * r : 2 * r + 2], "float64", "grouped reducescatter a")
        _close(o["grouped_reducescatter"][1], sums[1][:2] if r == 0 else sums[1][2:], "float32", "grouped reducescatter b")
        ag_grads, rs_grads, gathered, scattered = o["grouped_grads"]
        a_all = np.concatenate([_make("gg.a", k, "float64", (2, 2)) for k in range(SIZE)])
        # allgather: the upstream gradient (the same on every rank) averaged, this rank's rows of it
        _close(ag_grads[0], 2 * a_all[2 * r : 2 * r + 2], "float64", "d grouped allgather a")
        _close(ag_grads[1], np.ones(4), "float64", "d grouped allgather b")
        # reducescatter Sum: every rank's upstream gradient gathered, times size()
        rs_a = np.concatenate([2 * res[k]["grouped_grads"][3][0] for k in range(SIZE)])
        _close(rs_grads[0], SIZE * rs_a, "float64", "d grouped reducescatter a")
        _close(rs_grads[1], SIZE * np.ones(4), "float64", "d grouped reducescatter b")
        returned, v1, v2 = o["broadcast_"]
        for got in (returned[0], v1):
            np.testing.assert_array_equal(got, _make("b_.1", 1, "float32", (2,)))
        for got in (returned[1], v2):
            np.testing.assert_array_equal(got, _make("b_.2", 1, "int32", (3,)))
        assert o["bgv_eager"].startswith("RuntimeError:") and "broadcast_variables" in o["bgv_eager"]
        np.testing.assert_array_equal(o["bgv_graph"], [1.0, 1.5])
        # upstream gradients 1 and 2, averaged on the root (rank 0), zeros elsewhere
        np.testing.assert_array_equal(o["broadcast_grad_graph"], [1.5, 1.5] if r == 0 else [0.0, 0.0])
        assert o["fp16"] == ("float16", "float64", "int32", "int32")
        np.testing.assert_array_equal(o["fp16_allreduce"], [3.0, 6.0])
        assert o["fp16_allreduce"].dtype == np.float64
        np.testing.assert_array_equal(o["fp16_grouped"][0], [3.0])
        assert o["fp16_grouped"][1].dtype == np.int64 and o["fp16_grouped"][1].tolist() == [4]
        kind, values, indices, dense = o["sparse_grouped"]
        assert kind == "IndexedSlices"
        np.testing.assert_allclose(values, [[0.5, 1.0], [1.0, 1.0]])  # every rank's rows, averaged over 2 ranks
        assert indices.tolist() == [0, 1]
        np.testing.assert_allclose(dense, [1.0])
        for message in o["sparse_errors"]:
            assert message.startswith("NotImplementedError:"), message
        kinds = o["error_types"]
        # (FailedPrecondition, InvalidArgument, hvd.TensorMismatchError, ValueError, message)
        for key in ("shape", "dtype", "root"):
            assert kinds[key][:4] == (True, False, True, True), (key, kinds[key])
        for key in ("splits", "uneven"):
            assert kinds[key][:4] == (False, True, False, True), (key, kinds[key])
        assert "tf.mismatch.shape" in kinds["shape"][4] and "splits" in kinds["splits"][4]
        np.testing.assert_array_equal(o["after_errors"], [float(SIZE)])


def _horovod_training() -> dict:
    tf, keras, hk = _setup_keras()
    import hvdray.tensorflow as hvd

    r, n = hvd.rank(), hvd.size()
    out = {}
    # PartialDistributedGradientTape: the local layer's gradients stay this rank's (divided by size)
    keras.utils.set_random_seed(3)
    shared, local = keras.layers.Dense(2, dtype="float64"), keras.layers.Dense(1, dtype="float64")
    x = tf.constant(_make("pt.x", r, "float64", (4, 3)))
    shared.build((None, 3))
    local.build((None, 2))
    variables = shared.trainable_weights + local.trainable_weights
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(local(shared(x)) ** 2)
    plain = [g.numpy() for g in tape.gradient(loss, variables)]
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=local)
    out["partial_tape"] = (plain, [g.numpy() for g in tape.gradient(loss, variables)])
    local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, variables)
    out["local_and_global"] = (len(local_pairs), len(global_pairs))
    # SyncBatchNormalization: the statistics of every rank's batch together
    xb = tf.constant(_make("sbn", r, "float32", (4, 3)))
    sync_bn, bn = hvd.SyncBatchNormalization(axis=1, momentum=0.5), keras.layers.BatchNormalization(axis=1, momentum=0.5)
    whole = hvd.allgather(xb)
    out["sync_bn"] = (sync_bn(xb, training=True).numpy(), bn(whole, training=True).numpy()[4 * r : 4 * r + 4],
                      sync_bn.moving_mean.numpy(), bn.moving_mean.numpy(), sync_bn.moving_variance.numpy(),
                      bn.moving_variance.numpy())
    # Keras backward_passes_per_step: every 2nd step applies the sum (or mean) of 2 steps' averaged gradients
    for average in (False, True):
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                      average_aggregated_gradients=average)
        var = keras.Variable([0.0])
        seen = []
        for _ in range(4):
            opt.apply([tf.constant([float(r + 1)])], [var])
            seen.append(float(var.numpy()[0]))
        out[f"passes.{average}"] = seen
    # register_local_var / PartialDistributedOptimizer: those variables' gradients are not reduced
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(1.0))
    own, common = keras.Variable([0.0]), keras.Variable([0.0])
    opt.register_local_var(own)
    opt.apply([tf.constant([float(r + 1)]), tf.constant([float(r + 1)])], [own, common])
    out["local_var"] = (float(own.numpy()[0]), float(common.numpy()[0]))
    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    layer.build((None, 1))
    popt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[layer])
    other = keras.Variable([0.0])
    popt.apply([tf.constant([[float(r + 1)]]), tf.constant([float(r + 1)])], [layer.kernel, other])
    out["partial_optimizer"] = (float(layer.kernel.numpy()[0, 0]), float(other.numpy()[0]))
    # BroadcastGlobalVariablesCallback(local_variables=...): those keep each rank's own values
    model = _model(keras, 100 + r)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse", jit_compile=False)
    kept = model.layers[0].kernel
    before = [w.numpy() for w in model.weights]
    callback = hk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[kept])
    callback.set_model(model)
    callback.on_train_begin()
    out["callback_local"] = (before, [w.numpy() for w in model.weights], [w.path for w in model.weights], kept.path)
    # TensorFlow 1 DistributedOptimizer in a graph: reduced gradients; backward_passes_per_step=4
    with tf.Graph().as_default():
        class Constant(tf.compat.v1.train.Optimizer):
            def __init__(self):
                super().__init__(use_locking=False, name="constant")
                self.variable = tf.Variable([0.0])

            def compute_gradients(self, *args, **kwargs):
                return [(tf.constant([float(r + 1)]), self.variable)]

            def _resource_apply_dense(self, grad, var, apply_state=None):
                return var.assign_add(grad)

        opt = hvd.DistributedOptimizer(Constant(), backward_passes_per_step=4, average_aggregated_gradients=True)
        step = tf.compat.v1.get_variable("step", initializer=tf.constant(0, tf.int64), trainable=False)
        update = opt.apply_gradients(opt.compute_gradients(), global_step=step)
        w = tf.compat.v1.Variable([1.0, 2.0])
        sgd = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
        train = sgd.apply_gradients(sgd.compute_gradients(tf.reduce_sum(w * float(r + 1)), var_list=[w]))
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()])
            values = []
            for _ in range(8):
                sess.run(update)
                values.append(float(sess.run(opt._optimizer.variable)[0]))
            sess.run(train)
            out["tf1"] = (values, int(sess.run(step)), sess.run(w).tolist())
    return out


def test_horovod_training_names(ex):
    res = ex.run(_horovod_training)
    mean = (1.0 + 2.0) / SIZE  # the ranks' gradients are rank + 1
    for r, o in enumerate(res):
        plain, partial = o["partial_tape"]
        for i in range(2):  # the shared layer's kernel and bias: averaged over the ranks
            want = sum(res[k]["partial_tape"][0][i] for k in range(SIZE)) / SIZE
            np.testing.assert_allclose(partial[i], want, rtol=1e-12, err_msg=f"shared {i}")
        for i in range(2, 4):  # the local layer's: this rank's own, divided by size (Horovod's scale_local_gradients)
            np.testing.assert_allclose(partial[i], plain[i] / SIZE, rtol=1e-12, err_msg=f"local {i}")
        assert not np.allclose(res[0]["partial_tape"][0][2], res[1]["partial_tape"][0][2])
        assert o["local_and_global"] == (2, 2)
        out, want, mm, want_mm, mv, want_mv = o["sync_bn"]
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(mm, want_mm, rtol=1e-5, atol=1e-6)
        # Keras' own BN uses the unbiased batch variance for its moving variance only if told; both divide by N
        np.testing.assert_allclose(mv, want_mv, rtol=1e-4, atol=1e-5)
        assert o["passes.False"] == [0.0, -2 * mean, -2 * mean, -4 * mean]
        assert o["passes.True"] == [0.0, -mean, -mean, -2 * mean]
        assert o["local_var"] == (-(r + 1) / SIZE, -mean)
        assert o["partial_optimizer"] == (-(r + 1) / SIZE, -mean)
        before, after, paths, kept = o["callback_local"]
        for i, path in enumerate(paths):
            want = before[i] if path == kept else res[0]["callback_local"][0][i]
            np.testing.assert_array_equal(after[i], want, err_msg=path)
        assert not np.array_equal(res[0]["callback_local"][1][0], res[1]["callback_local"][1][0])
        values, steps, w = o["tf1"]
        assert values == [0.0, 0.0, 0.0, mean, mean, mean, mean, 2 * mean] and steps == 8
        assert w == [1.0 - mean, 2.0 - mean]
