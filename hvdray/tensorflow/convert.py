"""TensorFlow tensors <-> the CPU torch tensors the collective engine works on, without copies.

Both directions go through DLPack, so torch and TensorFlow share one buffer (every supported dtype,
bfloat16 and 0-d tensors included). A tensor on a GPU is copied to the host; a torch buffer that
TensorFlow could not adopt (not 64-byte aligned: TensorFlow aborts on those) is copied instead.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import torch
from torch.utils import dlpack as _torch_dlpack

#: TensorFlow dtypes the engine can move (Horovod's TensorFlow set), with their torch twins; the reducing ops
#: further need one that Gloo reduces (every one here but int16 and uint16, which allgather, broadcast and
#: alltoall move as bytes).
TORCH_DTYPES: dict[tf.DType, torch.dtype] = {
    tf.float16: torch.float16,
    tf.bfloat16: torch.bfloat16,
    tf.float32: torch.float32,
    tf.float64: torch.float64,
    tf.uint8: torch.uint8,
    tf.int8: torch.int8,
    tf.uint16: torch.uint16,
    tf.int16: torch.int16,
    tf.int32: torch.int32,
    tf.int64: torch.int64,
    tf.bool: torch.bool,
}
_TF_ALIGNMENT = 64  # TensorFlow's allocator alignment


def as_tensor(value: Any, argument: str = "tensor") -> tf.Tensor:
    """``value`` (tensor, variable, array, number) as a tf.Tensor of a dtype the engine supports."""
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{argument} must be a tf.Tensor or convertible to one, got {type(value).__name__}") from exc
    check_dtype(tensor.dtype, argument)
    return tensor


def check_dtype(dtype: tf.DType, argument: str = "tensor") -> None:
    if dtype not in TORCH_DTYPES:
        supported = ", ".join(d.name for d in TORCH_DTYPES)
        raise ValueError(
            f"{argument} has dtype {dtype.name}, which hvdray cannot move; supported: {supported}"
        )


def torch_dtype(dtype: tf.DType) -> torch.dtype:
    check_dtype(dtype)
    return TORCH_DTYPES[dtype]


def to_torch(tensor: tf.Tensor) -> torch.Tensor:
    """An eager tensor as a CPU torch tensor sharing its memory (a GPU tensor is copied to the host)."""
    out = _torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    return out if out.device.type == "cpu" else out.cpu()


def to_tf(tensor: torch.Tensor) -> tf.Tensor:
    """A CPU torch tensor as an eager tf.Tensor, sharing its memory where TensorFlow can adopt it."""
    if not tensor.is_contiguous() or tensor.data_ptr() % _TF_ALIGNMENT:
        tensor = _aligned_copy(tensor)
    return tf.experimental.dlpack.from_dlpack(_torch_dlpack.to_dlpack(tensor))


def _aligned_copy(tensor: torch.Tensor) -> torch.Tensor:
    copy = torch.empty(tensor.shape, dtype=tensor.dtype)  # torch's CPU allocator aligns to 64 bytes
    copy.copy_(tensor)
    return copy
