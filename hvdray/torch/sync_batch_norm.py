"""``SyncBatchNorm``: batch statistics computed over the whole global batch, across ranks."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hvdray.collective import context
from hvdray.collective import ops as _c
from hvdray.torch.ops import allreduce


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` whose training statistics span all ranks.

    The per-channel sum, sum of squares and count are allreduced (differentiably), so the backward
    pass is exact for the global batch. In eval mode it behaves like ordinary batch norm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or not context.is_initialized() or context.rank_info().size == 1:
            return super().forward(input)
        if self.momentum is None:
            raise ValueError("SyncBatchNorm needs a numeric momentum")
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        work = input.to(torch.float64) if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.full((1,), work.numel() / channels, dtype=work.dtype)
        local = torch.cat([work.sum(dims), (work * work).sum(dims), count])
        total = allreduce(local, op=_c.Sum)
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels : 2 * channels] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                unbiased = var * (n / (n - 1)) if n > 1 else var
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean.to(self.running_mean.dtype))
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * unbiased.to(self.running_var.dtype))
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (work - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)
