"""The job's facts as TensorFlow ops (``hvd.rank_op()`` ...): int32 scalars read when the op runs, not
when the graph is built, so a graph built before ``hvd.init()`` (or exported) answers for the job it runs in."""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

from hvdray.collective import basics, session
from hvdray.collective.process_sets import global_process_set

#: Horovod's codes that ``process_set_included_op`` returns instead of 0 or 1
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _scalar_op(read: Callable[[], int], name: Optional[str], what: str) -> tf.Tensor:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    if tf.executing_eagerly():
        return tf.constant(read(), tf.int32)

    @tf.autograph.experimental.do_not_convert
    def node() -> tf.Tensor:
        return tf.constant(read(), tf.int32)

    out = tf.py_function(node, [], tf.int32, name=name or what)
    out.set_shape([])
    return tf.stop_gradient(out)  # not differentiable, as Horovod's


def _set_id(process_set_id: int) -> int:
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, int):
        raise TypeError(f"process_set_id must be an int, got {process_set_id!r}")
    return process_set_id


def _process_set_size(process_set_id: int) -> int:
    if process_set_id == global_process_set.process_set_id:
        return basics.size()
    process_set = session.current().process_sets.sets.get(process_set_id) if session.is_initialized() else None
    if process_set is None:
        raise ValueError(f"process_set_id {process_set_id} is not a registered process set")
    return process_set.size()


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank, as an op."""
    return _scalar_op(basics.rank, name, "HvdrayRank")


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank among the processes on its node, as an op."""
    return _scalar_op(basics.local_rank, name, "HvdrayLocalRank")


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of processes (of the process set ``process_set_id``; 0 is every process), as an op."""
    set_id = _set_id(process_set_id)
    return _scalar_op(lambda: _process_set_size(set_id), name, "HvdraySize")


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of processes on this process's node, as an op."""
    return _scalar_op(basics.local_size, name, "HvdrayLocalSize")


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this process belongs to process set ``process_set_id``, 0 if not; Horovod's error codes -1 (not
    initialized) and -3 (no such set) otherwise, as an op."""
    set_id = _set_id(process_set_id)

    def included() -> int:
        if not session.is_initialized():
            return PROCESS_SET_ERROR_INIT
        if set_id == global_process_set.process_set_id:
            return 1
        process_set = session.current().process_sets.sets.get(set_id)
        return PROCESS_SET_ERROR_UNKNOWN_SET if process_set is None else int(process_set.included())

    return _scalar_op(included, name, "HvdrayProcessSetIncluded")
