"""``hvd.elastic`` for PyTorch: the worker-side elastic API plus ``TorchState`` and ``ElasticSampler``."""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Iterator, Optional

import torch

from hvdray.collective import session
from hvdray.collective import ops as _c
from hvdray.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run
from hvdray.torch.functions import broadcast_optimizer_state, broadcast_parameters

__all__ = [
    "ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run",
]


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the current ranks and, after a reset, over the new ones, skipping the samples
    already processed this epoch (by any rank). Call ``record_batch`` after each batch and ``set_epoch``
    at the start of each epoch; a ``TorchState`` holding the sampler commits and syncs its progress."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet, a new shuffle."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark the samples of this rank's batch ``batch_idx`` (of ``batch_size``) as processed."""
        start = batch_idx * batch_size
        self.record_indices(self.indices[start : start + batch_size])

    def record_indices(self, indices: Any) -> None:
        """Mark these dataset indices processed this epoch, so a reset does not hand them out again."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the indices processed in it: what ``TorchState`` commits and syncs."""
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` and re-shard the rest of the epoch over the current ranks."""
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-shard what is left of this epoch over the current ranks (called after every elastic reset)."""
        self.num_replicas = _current_size()
        self.rank = _current_rank()
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.remaining_indices = remaining
        self.num_samples = int(math.ceil(len(remaining) / self.num_replicas)) if remaining else 0
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._shard()

    def _shard(self) -> list[int]:
        padded = list(self.remaining_indices)
        if padded:
            padded += padded[: self.total_size - len(padded)]  # equal length on every rank
        return padded[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _current_rank() -> int:
    return session.rank_info("ElasticSampler").rank if session.is_initialized() else 0


def _current_size() -> int:
    return session.rank_info("ElasticSampler").size if session.is_initialized() else 1


class TorchState(ObjectState):
    """A model, an optimizer, ``ElasticSampler``s and any picklable attributes (``epoch=0``, ...) as one
    elastic state: committed in memory, restored after a failure, and broadcast to new workers."""

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        self._saved_model: Optional[dict[str, Any]] = None
        self._saved_optimizer: Optional[dict[str, Any]] = None
        self._saved_samplers: dict[str, dict[str, Any]] = {}
        super().__init__(**{k: v for k, v in kwargs.items() if k not in self._samplers})

    def save(self) -> None:
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        self._saved_samplers = {name: s.state_dict() for name, s in self._samplers.items()}
        super().save()

    def restore(self) -> None:
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        from hvdray.torch.optimizer import discard_in_flight  # imported here: dir(hvdray.torch.elastic) stays as it was

        discard_in_flight(self.optimizer)  # a DistributedOptimizer caught mid-step
        for name, state in self._saved_samplers.items():
            self._samplers[name].load_state_dict(state)
        super().restore()

    def _saved_copy(self) -> dict[str, Any]:
        return {**super()._saved_copy(), "model": self._saved_model, "optimizer": self._saved_optimizer,
                "samplers": self._saved_samplers}

    def _load_copy(self, saved: dict[str, Any]) -> None:
        self._saved_model, self._saved_optimizer = saved["model"], saved["optimizer"]
        self._saved_samplers = dict(saved["samplers"])
        super()._load_copy(saved)

    def _sync_from(self, root_rank: int) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=root_rank)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=root_rank)
        for name, sampler in self._samplers.items():
            # every rank processed different samples: the union is what the whole job has done
            processed = _c.allgather_object(sampler.processed_indices, name=f"hvdray.elastic.sampler.{name}")
            epoch = _c.broadcast_object(sampler.epoch, root_rank, name=f"hvdray.elastic.sampler_epoch.{name}")
            sampler.load_state_dict({"epoch": epoch, "processed_indices": set().union(*processed)})
        super()._sync_from(root_rank)
