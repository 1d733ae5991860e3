"""Running a collective on TensorFlow tensors: at once in eager mode, as a ``tf.py_function`` in a graph.

Inside ``tf.function`` (Keras' compiled train step included) the collective becomes a
``tf.py_function`` node with its static output shapes restored, so that Keras can keep compiling
around it. Every rank must reach its collectives in the same order, but a graph's executor may run
independent nodes in any order; so each function graph chains its hvdray nodes with control
dependencies in the order they were created, which is the program's order and the same on every rank.
(A ``py_function`` holds one of the executor's threads until its collective completes; without the
chain, ranks running several collectives at once in different orders could hold every thread and wait
for each other forever.)

A TensorFlow 1 graph, run piecewise by ``Session.run``, is chained too, so running one node runs the
collectives created before it again (the cost of a synchronous ``py_function``); its unnamed
collectives are named when the graph is built, from the graph's unique node names (the same on every
rank that builds the same graph), as Horovod names them, so those reruns always match across ranks.

In a graph, TensorFlow turns an exception raised inside a ``py_function`` into an error by its Python
class alone (``ValueError`` becomes ``InvalidArgumentError``, anything else ``UnknownError``) and has no
op that raises an error of a chosen kind. Horovod raises ``FailedPreconditionError`` when ranks disagree
on a tensor, in graphs too; so a mismatch leaves the node as a message, and the node's outputs wait
for a ``ReadFile`` of ``/dev/null`` followed by ``/`` and that message. Reading a path below a file
fails with ``ENOTDIR``, which TensorFlow reports as ``FailedPreconditionError`` with the path, and so the
message, in its text (``/dev/null/<message>; Not a directory``). Without a message the op reads
``/dev/null`` itself: nothing, at once.
"""

from __future__ import annotations

import inspect
import re
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import tensorflow as tf

from hvdray.tensorflow.errors import as_tensorflow_error

try:  # private, but the only way to tell an XLA-compiled function before XLA fails on py_function
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:  # pragma: no cover - a TensorFlow without it: XLA reports the problem itself
    GraphOrParentsInXlaContext = None

Kernel = Callable[[list[tf.Tensor]], list[tf.Tensor]]

_last_node: "weakref.WeakKeyDictionary[tf.Graph, tf.Operation]" = weakref.WeakKeyDictionary()


def leave_to_python(namespace: dict[str, Any], names: Iterable[str]) -> None:
    """Have autograph call the functions among ``names`` in a module's ``namespace`` as they are
    (``tf.autograph.experimental.do_not_convert``) when a user's ``tf.function`` calls them: they build
    graph nodes with plain Python and need no conversion. Converted, each of them and every helper it
    calls became a generated module on the first trace (38 for allreduce, allgather, broadcast, rank and
    size_op), each written to a temporary file that stays behind when the process is killed."""
    for name in names:
        if inspect.isfunction(namespace[name]):
            namespace[name] = tf.autograph.experimental.do_not_convert(namespace[name])


def session_graph() -> bool:
    """True while a TensorFlow 1 graph (run by a ``Session``, not a ``tf.function``) is being built."""
    return not tf.executing_eagerly() and not tf.compat.v1.get_default_graph().building_function


def build_name(name: Optional[str], what: str) -> Optional[str]:
    """``name``; for an unnamed collective in a TensorFlow 1 graph, a name fixed when the graph is built."""
    if name is None and session_graph():
        return tf.compat.v1.get_default_graph().unique_name(f"hvdray.{what}")
    return name


def run(
    kernel: Kernel,
    inputs: Sequence[tf.Tensor],
    out_dtypes: Sequence[tf.DType],
    out_shapes: Sequence[tf.TensorShape],
    what: str,
) -> list[tf.Tensor]:
    """``kernel(inputs)`` on eager tensors: now, or, while a graph is being built, each time it runs.
    Its errors are raised as Horovod's TensorFlow ops raise them (see errors.py)."""
    kernel = _horovod_errors(kernel)
    if tf.executing_eagerly():
        return list(kernel(list(inputs)))
    graph = tf.compat.v1.get_default_graph()
    if GraphOrParentsInXlaContext is not None and GraphOrParentsInXlaContext(graph):
        raise ValueError(
            f"hvdray's {what} cannot run inside an XLA-compiled function (jit_compile=True): its collectives "
            "run on the host. Compile the model with jit_compile=False (or use tf.function(jit_compile=False))"
        )
    shapes = [tf.TensorShape(s) for s in out_shapes]

    @tf.autograph.experimental.do_not_convert
    def node(*eager: tf.Tensor) -> list[tf.Tensor]:
        try:
            results = list(kernel(list(eager)))
        except tf.errors.FailedPreconditionError as exc:  # raised below, by the graph, as this type
            return [tf.zeros([0], dtype) for dtype in out_dtypes] + [tf.constant(_failed_precondition_path(exc))]
        for i, (result, shape) in enumerate(zip(results, shapes)):
            if not shape.is_compatible_with(result.shape):  # the graph was told this shape
                raise ValueError(f"hvdray {what}: output {i} has shape {result.shape}, the graph expects {shape}")
        return results + [tf.constant(_NOTHING_FAILED)]

    previous = _last_node.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        *results, failure = tf.py_function(
            node, list(inputs), [*out_dtypes, tf.string], name=f"Hvdray{what.title().replace('_', '')}"
        )
    # the outputs take the read's (empty) contents as data: Grappler would turn a read that only a control
    # dependency waits for into a NoOp
    nothing = tf.strings.length(tf.io.read_file(failure))
    outputs = [tf.reshape(result, tf.shape(result) + nothing) for result in results]
    for output, shape in zip(outputs, shapes):
        output.set_shape(shape)
    _last_node[graph] = outputs[0].op if outputs else None
    return outputs


_NOTHING_FAILED = "/dev/null"
_PATH_MAX_BYTES = 3800  # below Linux's PATH_MAX (4096): a longer path fails as InvalidArgumentError
_DOT_COMPONENT = re.compile(r"(?<=/)\.\.?(?=/|$)")  # TensorFlow's path cleaning would drop or apply them


def _failed_precondition_path(exc: tf.errors.FailedPreconditionError) -> str:
    """A path whose ``ReadFile`` fails as ``FailedPreconditionError`` carrying ``exc``'s message."""
    path = f"{_NOTHING_FAILED}/{exc.message}".replace("\0", "")
    path = _DOT_COMPONENT.sub(lambda dots: "\u2024" * len(dots.group()), path).encode()
    if len(path) > _PATH_MAX_BYTES:
        path = path[: _PATH_MAX_BYTES - 3].decode(errors="ignore").encode() + "\u2026".encode()
    return path.decode()


def _horovod_errors(kernel: Kernel) -> Kernel:
    def translated(inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        try:
            return kernel(inputs)
        except Exception as exc:  # noqa: BLE001 - re-raised, as the type Horovod raises where it has one
            translated_exc = as_tensorflow_error(exc)
            if translated_exc is exc:
                raise
            raise translated_exc from exc

    return translated
