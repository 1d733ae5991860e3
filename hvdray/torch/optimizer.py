"""``DistributedOptimizer``: gradients are allreduced from backward hooks, overlapping the backward pass.

Each parameter's gradient is submitted to the engine the moment autograd finishes accumulating it;
``step()`` waits for the reductions (``synchronize``) and then runs the wrapped optimizer's update.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch

from hvdray.collective import ops as _c
from hvdray.collective.compression import Compression
from hvdray.collective.engine.interrupts import INTERRUPTS
from hvdray.collective.gradient_groups import GroupSpec, consecutive_runs, group_of_positions, resolve_groups
from hvdray.collective.process_sets import ProcessSet, check_registered, global_process_set


class _DistributedMixin:
    """Mixed in front of the wrapped optimizer's own class; state lives in ``_hvd_*`` attributes."""

    def _hvd_setup(
        self,
        named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]],
        compression: Any,
        backward_passes_per_step: int,
        op: _c.ReduceOp,
        gradient_predivide_factor: float,
        sparse_as_dense: bool,
        process_set: Any,
        groups: GroupSpec,
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
                raise ValueError("named_parameters must be (name, parameter) pairs, as model.named_parameters() gives")
            names = [n for n, _ in named]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"named_parameters has duplicate names: {duplicates}")
            by_param = {id(p): n for n, p in named}
            unnamed = [i for i, p in enumerate(params) if id(p) not in by_param]
            if unnamed:
                raise ValueError(
                    f"named_parameters was given, but {len(unnamed)} optimizer parameter(s) are not in it "
                    f"(positions {unnamed[:5]}); pass the named_parameters of the model the optimizer trains"
                )
            self._hvd_names = {id(p): f"allreduce.{by_param[id(p)]}" for p in params}
        else:
            self._hvd_names = {id(p): f"allreduce.parameter.{i}" for i, p in enumerate(params)}
        if op == _c.Average:
            self._hvd_scale = (1.0 / gradient_predivide_factor, float(gradient_predivide_factor))
        else:
            self._hvd_scale = (1.0, 1.0)
        self._hvd_op = op
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_process_set = process_set
        self._hvd_params = [p for p in params if p.requires_grad]
        self._hvd_delay = {id(p): backward_passes_per_step for p in self._hvd_params}
        # gradients allreduced together: each group in one grouped_allreduce once all of its are ready
        self._hvd_groups = _parameter_groups(groups, self._hvd_params)
        self._hvd_group_of = {id(p): i for i, group in enumerate(self._hvd_groups) for p in group}
        self._hvd_group_ready = [0] * len(self._hvd_groups)
        # id(param) -> (wire tensor, handle, compression context, index in its group's result or None)
        self._hvd_handles: dict[int, tuple[torch.Tensor, _c.OpHandle, Any, Optional[int]]] = {}
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        self._hvd_interrupts_before_step = INTERRUPTS.delivered  # an interrupt since then stopped this step
        # a rank outside the process set reduces nothing: its step() applies its own gradients (Horovod's)
        self._hvd_member = process_set is global_process_set or process_set.included()
        self._hvd_hooks = (
            [p.register_post_accumulate_grad_hook(self._hvd_on_grad) for p in self._hvd_params]
            if self._hvd_member else []
        )

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's (private, but read by its users' tests) map of each parameter to its reduction name."""
        return {p: self._hvd_names[id(p)].removeprefix("allreduce.") for group in self.param_groups
                for p in group["params"]}

    def _hvd_on_grad(self, p: torch.Tensor) -> None:
        with INTERRUPTS:  # an op submitted and its handle kept, or neither: Ctrl-C raises after the hook's work
            self._hvd_count_grad(p)

    def _hvd_count_grad(self, p: torch.Tensor) -> None:
        key = id(p)
        if key in self._hvd_handles or self._hvd_delay[key] <= 0:
            raise AssertionError(
                "gradients were computed more than backward_passes_per_step times before step(); raise "
                "backward_passes_per_step to accumulate gradients locally"
            )
        self._hvd_delay[key] -= 1
        if self._hvd_delay[key] == 0:
            group = self._hvd_group_of.get(key)
            if group is None:
                self._hvd_submit(p)
            else:
                self._hvd_group_ready[group] += 1
                if self._hvd_group_ready[group] == len(self._hvd_groups[group]):
                    self._hvd_submit_group(group)

    def _hvd_wire(self, p: torch.Tensor, grouped: bool = False) -> tuple[torch.Tensor, Any]:
        """``p``'s gradient as it travels (compressed, contiguous, dense), and what decompressing it needs."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            if grouped and not self._hvd_sparse_as_dense:
                raise ValueError(
                    f"gradient of {self._hvd_names[id(p)]!r} is sparse and in a group; pass sparse_as_dense=True to "
                    "DistributedOptimizer, or leave the parameter out of groups"
                )
            grad = grad.to_dense()  # reduced dense, made sparse again in synchronize() (Horovod's sparse_as_dense)
        wire, ctx = self._hvd_compression.compress(grad)
        return (wire if wire.is_contiguous() else wire.contiguous()), ctx

    def _hvd_submit(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse and not self._hvd_sparse_as_dense:
            if self._hvd_op == _c.Adasum:
                raise ValueError(f"gradient of {self._hvd_names[id(p)]!r} is sparse; op=hvd.Adasum needs dense "
                                 "gradients (pass sparse_as_dense=True)")
            handle = _c.sparse_allreduce_async(p.grad, self._hvd_names[id(p)], self._hvd_op, self._hvd_process_set)
            self._hvd_handles[id(p)] = (None, handle, None, None)  # every rank's entries, allgathered
            return
        wire, ctx = self._hvd_wire(p)
        pre, post = self._hvd_scale
        handle = _c.allreduce_async(
            wire, self._hvd_names[id(p)], self._hvd_op, pre, post, output=wire, process_set=self._hvd_process_set
        )
        self._hvd_handles[id(p)] = (wire, handle, ctx, None)

    def _hvd_submit_group(self, group: int) -> None:
        params = self._hvd_groups[group]
        wires, ctxs = zip(*(self._hvd_wire(p, grouped=True) for p in params))
        pre, post = self._hvd_scale
        handle = _c.grouped_allreduce_async(
            list(wires), f"grouped.{self._hvd_names[id(params[0])]}", self._hvd_op, pre, post, inplace=True,
            process_set=self._hvd_process_set,
        )
        for i, (p, wire, ctx) in enumerate(zip(params, wires, ctxs)):
            self._hvd_handles[id(p)] = (wire, handle, ctx, i)
        self._hvd_group_ready[group] = 0

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (submitting any a hook did not) and write results to ``.grad``."""
        if not self._hvd_member:
            self._hvd_synchronized = True
            return
        with INTERRUPTS:
            for p in self._hvd_params:
                if id(p) not in self._hvd_handles:
                    group = self._hvd_group_of.get(id(p))
                    if group is None:
                        self._hvd_submit(p)
                    else:  # the whole group, as on a rank where every hook of it fired (unused ones reduce zeros)
                        self._hvd_submit_group(group)
        by_id = {id(p): p for p in self._hvd_params}
        grouped: dict[int, list[torch.Tensor]] = {}  # id(handle) -> a group's results
        try:
            for key, (wire, handle, ctx, index) in self._hvd_handles.items():
                if index is None:
                    reduced = _c.synchronize(handle)
                else:
                    results = grouped.get(id(handle))
                    if results is None:
                        results = grouped[id(handle)] = _c.synchronize(handle)
                    reduced = results[index]
                p = by_id[key]
                if wire is None:  # a sparse gradient, reduced sparse
                    p.grad = reduced
                elif p.grad.is_sparse:  # sparse_as_dense: sparse again for the update, as in Horovod
                    p.grad = self._hvd_compression.decompress(reduced, ctx).to_sparse()
                elif reduced is not p.grad:
                    p.grad.copy_(self._hvd_compression.decompress(reduced, ctx))
        except KeyboardInterrupt:
            # the reductions go on, on every rank: the handles stay, and the next synchronize(), step() or
            # zero_grad() waits for them (writing a result to .grad twice writes the same values)
            raise
        except BaseException:
            self._hvd_reset_step()
            raise
        self._hvd_reset_step()
        self._hvd_synchronized = True

    def _hvd_reset_step(self) -> None:
        self._hvd_handles.clear()
        self._hvd_interrupts_before_step = INTERRUPTS.delivered
        for p in self._hvd_params:
            self._hvd_delay[id(p)] = self._hvd_passes
        self._hvd_group_ready = [0] * len(self._hvd_groups)

    def _hvd_discard_in_flight(self) -> None:
        """Forget gradient reductions of a ring that broke (an elastic restore rolls the step back)."""
        self._hvd_reset_step()
        self._hvd_synchronized = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Use around ``step()`` after calling ``synchronize()`` yourself (e.g. to clip gradients)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn(  # starts with Horovod's wording, which callers match on
                    "optimizer.step() called without optimizer.skip_synchronize() after optimizer.synchronize(): "
                    "gradients are reduced again. Wrap step() in `with optimizer.skip_synchronize():`.",
                    stacklevel=2,
                )
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_handles:
            if INTERRUPTS.delivered == self._hvd_interrupts_before_step:
                raise AssertionError(
                    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                    "optimizer.synchronize(); the gradients are still being reduced"
                )
            # Ctrl-C stopped this step after some of its gradients were submitted: the peers run the step's
            # reductions whatever this rank does next, so finish them here (submitting the rest), then drop
            # them with the other gradients, and the next step starts clean on every rank
            self.synchronize()
            self._hvd_synchronized = False
        return super().zero_grad(set_to_none)


def discard_in_flight(optimizer: Any) -> None:
    """Forget the gradient reductions a ``DistributedOptimizer`` has in flight on a ring that broke (an
    elastic restore rolls the step back); any other optimizer has none."""
    if isinstance(optimizer, _DistributedMixin):
        optimizer._hvd_discard_in_flight()


_classes: dict[type, type] = {}


def DistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: _c.ReduceOp = _c.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Make ``optimizer`` average (or sum) gradients across ranks before each ``step()``.

    The optimizer object itself is turned into its distributed form and returned, so schedulers and
    references made before wrapping keep working. With ``process_set``, gradients are reduced among
    that set's ranks only (every rank of the set must wrap its optimizer with the same set).

    ``groups`` (Horovod's): an int ``k`` splits the parameters, in the optimizer's order, into ``k``
    groups of consecutive parameters; a list of lists of parameters groups those (the rest go one by
    one). A group's gradients are submitted as one ``grouped_allreduce`` once all of them are ready: one
    call instead of one per gradient. ``num_groups`` is Horovod's older spelling of an int ``groups``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("optimizer is already a DistributedOptimizer")
    op = _c.resolve_op(op)
    if op not in (_c.Average, _c.Sum, _c.Adasum):
        raise ValueError(f"DistributedOptimizer supports op=hvd.Average, hvd.Sum or hvd.Adasum, got {op.name.lower()}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) or (
        backward_passes_per_step < 1
    ):
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    if not isinstance(gradient_predivide_factor, (int, float)) or gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be a number > 0, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != _c.Average:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression must be one of hvd.Compression.*, got {compression!r}")
    group_spec = resolve_groups(groups, num_groups)
    if process_set is not global_process_set:
        check_registered(process_set)  # a rank outside the set is fine: it reduces nothing
    base = type(optimizer)
    cls = _classes.get(base)
    if cls is None:
        cls = _classes[base] = type(f"Distributed{base.__name__}", (_DistributedMixin, base), {})
    optimizer.__class__ = cls
    try:
        optimizer._hvd_setup(
            named_parameters, compression, backward_passes_per_step, op, float(gradient_predivide_factor),
            sparse_as_dense, process_set, group_spec,
        )
    except BaseException:
        optimizer.__class__ = base  # a rejected named_parameters leaves the optimizer as it was
        raise
    _repatch_scheduler_step(optimizer, cls)
    return optimizer


def _parameter_groups(groups: GroupSpec, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """The resolved ``groups`` (see gradient_groups.py) as tuples of the optimizer's trainable ``params``."""
    if isinstance(groups, int):
        return [tuple(params[a:b]) for a, b in consecutive_runs(len(params), groups)]
    group_of_positions(  # every listed parameter is the optimizer's, and in one group only
        groups, params, "a trainable parameter of the optimizer (pass the same torch.nn.Parameter objects the "
        "optimizer holds)",
    )
    return [tuple(group) for group in groups]


def _repatch_scheduler_step(optimizer: torch.optim.Optimizer, cls: type) -> None:
    """An LR scheduler built before wrapping put a ``step`` on the instance that calls the *original*
    class's ``step`` (bypassing the reduction); point it at the distributed ``step`` instead."""
    patched = optimizer.__dict__.get("step")
    if patched is None or not getattr(patched, "_wrapped_by_lr_sched", False):
        return
    opt_ref = weakref.ref(optimizer)

    @functools.wraps(cls.step)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # what the scheduler's own wrapper records
        return cls.step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]
