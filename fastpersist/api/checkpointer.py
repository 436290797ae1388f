"""``Checkpointer``: asynchronous checkpoints in a training loop that cannot be torn.

    checkpointer = fastpersist.Checkpointer(optimizer)                # pipelined by default
    for step, batch in enumerate(loader):
        loss = model(batch).sum(); loss.backward()
        optimizer.step()                                              # waits until a pending save has read the state
        optimizer.zero_grad()
        if step % 100 == 0:
            checkpointer.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, "ckpt.pt")
    checkpointer.close()                                              # waits, raises any error

A pipelined save reads the live tensors while the next forward and backward
passes run. The only thing that changes the saved state in a training loop is
the optimizer step (and, during the forward pass, the running statistics of
normalization layers): the checkpointer registers an optimizer step pre-hook
(and a forward pre-hook on those layers of ``model``, when given) that waits
until the pending save has *read* the state: its last device-to-host copy is
queued, and the step's kernels are ordered after it on the GPU. The write
itself goes on behind the step. For a checkpoint that fits the staging ring
(``buffer_size * buffer_count``, 512 MiB by default) the reads are queued
within milliseconds of the save's start; a larger one is read as fast as the
storage takes the ring's earlier windows. The save never sees a
half-updated state; if something else modifies a tensor before the release,
the save fails with ``TensorModifiedError`` and commits nothing.

In snapshot mode the device-to-host copies into the staging area run on a
side stream beside the next forward pass (not before it, as a bare
``async_save(mode="snapshot")`` orders them): the same hooks order the
optimizer step after the copies (``overlap_snapshots=False`` orders the copies
before the caller's next kernels instead, as ``async_save`` does, so that any
in-place change after ``save`` returns is safe; so does a checkpointer with no
optimizer to hook).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from fastpersist import config
from fastpersist.api import futures

__all__ = ["Checkpointer"]

_COLLECTIVE = ("group", "layout", "writers", "divergence", "per_rank", "timeout")
"""Options of a collective save among the settings: not settings of the memory to prepare."""


def _normalization_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.nn.modules.batchnorm import _NormBase

    return [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats]


class Checkpointer:
    """Runs :func:`fastpersist.async_save` and waits for it before the state changes.

    Args:
        optimizers: an optimizer or several; each gets a step pre-hook that
            waits until the pending save has read the state (see the module
            docstring) and raises the errors of saves that failed.
        model: optional; normalization layers with running statistics get a
            forward pre-hook that waits (in training mode) before they update.
        mode: ``"pipelined"`` or ``"snapshot"`` (default: setting ``async_mode``).
            In snapshot mode the hooks order the step after the
            device-to-host copies; the CPU waits only until they are queued
            (by the save thread when it was idle, see docs/async.md).
        overlap_snapshots: (snapshot mode) run the device-to-host copies beside
            the next forward pass, the step ordered after them (default);
            False: the caller's stream waits for them at once (their time
            is in docs/async.md), and the state may change in place by any
            means as soon as ``save`` returns.
        group: under data-parallel training, the process group whose ranks
            all call :meth:`save` with the same path: each save is then a
            collective one (:func:`fastpersist.async_save` with ``group=``),
            every rank writing its share of rank 0's checkpoint in the
            background. The hooks hold each rank's state only until its share
            has been read (pipelined) or copied (snapshot).
        **settings: ``fastpersist.config`` overrides for every save, and the
            collective save's ``layout``, ``writers``, ``divergence``,
            ``per_rank`` and ``timeout``.

    Raises (from ``save``, ``wait``, the hooks and ``close``): what the failed
    save raised, at the latest before the next optimizer step.
    """

    def __init__(
        self,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
        *,
        model: torch.nn.Module | None = None,
        mode: str | None = None,
        overlap_snapshots: bool = True,
        group: Any = None,
        **settings: Any,
    ):
        self.mode = mode
        self.overlap_snapshots = overlap_snapshots
        self.group = group
        self.settings = settings
        self._pending: list[futures.SaveFuture] = []
        self._hooks = []
        self._hooks_step = False  # an optimizer's step pre-hook releases the state (so snapshots need not)
        self.attach(optimizers, model=model)

    def attach(
        self,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
        *,
        model: torch.nn.Module | None = None,
    ) -> None:
        """Adds the waiting hooks to more optimizers (and a model's normalization layers)."""
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        for optimizer in optimizers:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
            self._hooks_step = True
        if model is not None:
            for layer in _normalization_layers(model):
                self._hooks.append(layer.register_forward_pre_hook(self._before_forward))

    def detach(self) -> None:
        """Removes every hook; pending saves are released first (the state may change) but not waited for."""
        self._release()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._hooks_step = False

    def save(self, obj: object, path: str | os.PathLike[str], **settings: Any) -> futures.SaveFuture:
        """Starts an async save of ``obj`` to ``path``; raises the error of an earlier save first."""
        self._surface_errors()
        options = {**self.settings, **settings}
        if self.group is not None:
            options.setdefault("group", self.group)
        if options.get("reuse_replaced", config.get("reuse_replaced")) == "auto":
            options["reuse_replaced"] = "always"  # saves of one path every few steps (Settings.reuse_replaced)
        future = (futures.hooked_async_save if self._releases else futures.async_save)(
            obj, path, mode=self.mode, **options
        )
        self._pending.append(future)
        return future

    def prepare(self, obj: object, **settings: Any) -> int:
        """Allocates and pins now what saving ``obj`` will need, so the first save costs what later ones do.

        Call it once with the state you will save, after the optimizer has its
        state (Adam's moments appear at the first step): its size is what
        matters; the values are not kept. Without it the first
        save allocates and locks its staging memory on the spot (docs/async.md
        says how long that takes). Returns the bytes reserved.
        """
        options = {k: v for k, v in {**self.settings, **settings}.items() if k not in _COLLECTIVE}
        return futures.prepare(obj, mode=self.mode, **options)

    def wait(self) -> None:
        """Waits for every save started here; raises the first error."""
        pending, self._pending = self._pending, []
        first = None
        for future in pending:
            error = future.exception()
            if first is None and error is not None:
                first = error
        if first is not None:
            raise first

    def _surface_errors(self) -> None:
        """Raises the first error of the finished saves (each reported once); keeps the others pending."""
        finished = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        errors = [f.exception() for f in finished]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    @property
    def _releases(self) -> bool:
        """Whether snapshots may leave the caller's stream free: a step pre-hook will release them."""
        return self._hooks_step and self.overlap_snapshots

    def _release(self) -> None:
        """Lets the state change: each pending save has read it (its copies ordered before what comes next)."""
        for future in self._pending:
            future.release_reads()

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._release()
        self._surface_errors()

    def _before_forward(self, module, args) -> None:
        if module.training:
            self._release()

    def close(self) -> None:
        """Waits for pending saves (raising the first error) and removes the hooks."""
        self.detach()
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.detach()
            # The exception already propagating wins; a save's error stays unchecked, so it is
            # still reported (at the next async_save or at exit), not swallowed here.
            pending, self._pending = self._pending, []
            for future in pending:
                future.settle()
