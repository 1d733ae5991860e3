"""Gradient compression: cast to a 16-bit float before communication, back afterwards."""

from __future__ import annotations

from typing import Any, Optional

import torch


class Compressor:
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Floating-point tensors travel as ``wire_dtype`` and come back in their own dtype."""

    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.dtype]]:
        if tensor.is_floating_point() and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Optional[torch.dtype]) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class FP16Compressor(_CastCompressor):
    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    wire_dtype = torch.bfloat16


class Compression:
    """Horovod's ``hvd.Compression.none`` / ``.fp16`` (and ``.bf16``)."""

    none = Compressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
