"""Broadcasting a model's parameters and an optimizer's state from one rank to all."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from hvdray.collective import session
from hvdray.collective import ops as _c
from hvdray.torch.optimizer import _DistributedMixin

Params = Union[dict[str, Any], Iterable[Any]]


def broadcast_parameters(params: Params, root_rank: int) -> None:
    """Overwrite every tensor in ``params`` with root's value, in place.

    ``params`` is a ``state_dict()``, ``named_parameters()``, or a list of tensors or (name, tensor) pairs.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise ValueError(f"params must be a state_dict, named_parameters() or a list, got {type(params).__name__}")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = []
    with torch.no_grad():
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                continue  # state_dict entries such as _extra_state are not tensors
            target = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            handles.append(
                _c.broadcast_async(target, root_rank, f"broadcast.{name}" if name is not None else None, inplace=True)
            )
    for handle in handles:
        _c.synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Optional[Any] = None) -> None:
    """Make every rank's optimizer state (buffers and hyper-parameters) equal to root's.

    As in Horovod, an optimizer without state yet is given it first: every trainable parameter gets a zero
    gradient (left in ``.grad``; sparse for ``SparseAdam``, and for ``SGD`` on the sparse embeddings of
    ``model``) and the wrapped optimizer takes one local step. Root's ``state_dict`` layout is then sent as
    a small object; its tensors follow as in-place broadcasts.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("optimizer: cannot broadcast torch.optim.LBFGS state (its state is not a tensor state_dict)")
    if not optimizer.state:
        _initialize_state(optimizer, model)
    is_root = session.rank_info("broadcast_optimizer_state").rank == root_rank
    tensors: list[torch.Tensor] = []
    layout = _replace_tensors(optimizer.state_dict(), tensors) if is_root else None
    layout = _c.broadcast_object(layout, root_rank, name="broadcast_optimizer_state.layout")
    if not is_root:
        tensors = []
        state = _restore_tensors(layout, tensors)
    handles = [
        _c.broadcast_async(t, root_rank, f"broadcast_optimizer_state.{i}", inplace=True) for i, t in enumerate(tensors)
    ]
    for handle in handles:
        _c.synchronize(handle)
    if not is_root:
        optimizer.load_state_dict(state)


def _initialize_state(optimizer: torch.optim.Optimizer, model: Optional[Any]) -> None:
    """Horovod's state initialisation: zero gradients and one step of the wrapped optimizer, locally (a
    DistributedOptimizer's own step would reduce, and wait for ranks that do not call this)."""
    sparse = {
        id(p) for m in (model.modules() if model is not None else ())
        if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()
    }
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                    isinstance(optimizer, torch.optim.SGD) and id(p) in sparse
                ):
                    p.grad = p.grad.to_sparse()
    if isinstance(optimizer, _DistributedMixin):
        super(_DistributedMixin, optimizer).step()
    else:
        optimizer.step()


class _TensorSlot:
    """Where a tensor was, with what root's tensor looks like."""

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index, self.shape, self.dtype = index, tuple(tensor.shape), tensor.dtype


def _replace_tensors(obj: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach().contiguous())
        return _TensorSlot(len(out) - 1, obj)
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace_tensors(v, out) for v in obj)
    return obj


def _restore_tensors(obj: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        out.append(torch.empty(obj.shape, dtype=obj.dtype))
        return out[-1]
    if isinstance(obj, dict):
        return {k: _restore_tensors(v, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_restore_tensors(v, out) for v in obj)
    return obj
