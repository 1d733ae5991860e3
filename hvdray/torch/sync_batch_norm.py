"""``SyncBatchNorm``: batch statistics computed over the whole global batch, across ranks."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hvdray.collective import session
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
        if not self.training or not session.is_initialized() or session.rank_info().size == 1:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        work = input.to(torch.float64) if input.dtype in (torch.float16, torch.bfloat16) else input
        shape = [1, channels] + [1] * (input.dim() - 2)
        # Each rank's mean and centred sum of squares, combined in float64: sum(x*x)/n - mean**2 over the
        # raw values loses all precision in float32 once |mean| >> std.
        rows = work.numel() // channels
        local_mean = work.sum(dims) / max(rows, 1)
        centred = work - local_mean.view(shape)
        m2 = (centred * centred).sum(dims).to(torch.float64)
        m = local_mean.to(torch.float64)
        count = torch.full((1,), float(rows), dtype=torch.float64)
        total = allreduce(torch.cat([m * rows, m2, m * m * rows, count]), op=_c.Sum)
        n = total[-1]
        mean64 = total[:channels] / n
        var64 = (total[channels : 2 * channels] + total[2 * channels : 3 * channels]) / n - mean64 * mean64
        mean, var = mean64.to(work.dtype), var64.to(work.dtype)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                # momentum=None: cumulative moving average, as in torch.nn.BatchNorm
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var64 * (n / (n - 1)) if n > 1 else var64
                self.running_mean.mul_(1 - factor).add_(factor * mean64.to(self.running_mean.dtype))
                self.running_var.mul_(1 - factor).add_(factor * unbiased.to(self.running_var.dtype))
        out = (work - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)
