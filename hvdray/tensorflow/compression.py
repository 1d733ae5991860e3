"""Gradient compression on TensorFlow tensors: ``hvd.Compression.fp16`` casts a floating-point tensor to
float16 before it travels and back to its own dtype afterwards, in TensorFlow (eager or inside a graph).

The TensorFlow frontend's ``Compression`` holds these classes; the torch ones of
:mod:`hvdray.collective.compression` are accepted too and mean the same (see :func:`for_tensorflow`).
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from hvdray.collective import compression as _torch_compression


class Compressor:
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Floating-point tensors travel as ``wire_dtype``; integer and bool tensors as they are."""

    wire_dtype: tf.DType = tf.float16

    @classmethod
    def compress(cls, tensor: Any) -> tuple[tf.Tensor, Optional[tf.DType]]:
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating:
            return tf.cast(tensor, cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Optional[tf.DType]) -> tf.Tensor:
        return tf.cast(tensor, ctx) if ctx is not None else tensor


class FP16Compressor(_CastCompressor):
    wire_dtype = tf.float16


class BF16Compressor(_CastCompressor):
    wire_dtype = tf.bfloat16


class Compression:
    """Horovod's ``hvd.Compression.none`` / ``.fp16`` (and ``.bf16``) for TensorFlow tensors."""

    none = Compressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


_TWINS = {
    _torch_compression.Compression.none: Compressor,
    _torch_compression.Compression.fp16: FP16Compressor,
    _torch_compression.Compression.bf16: BF16Compressor,
}


def for_tensorflow(compression: Any) -> Any:
    """The compressor to apply to TensorFlow tensors for ``compression`` (a torch compressor maps to its
    twin; a user's own class with ``compress``/``decompress`` is used as it is)."""
    compression = _TWINS.get(compression, compression)
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression must be one of hvd.Compression.none/.fp16/.bf16, got {compression!r}")
    return compression
