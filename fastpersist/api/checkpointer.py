"""``Checkpointer``: asynchronous checkpoints in a training loop that cannot be torn.

    checkpointer = fastpersist.Checkpointer(optimizer)                # pipelined by default
    for step, batch in enumerate(loader):
        loss = model(batch).sum(); loss.backward()
        optimizer.step()                                              # waits for a pending save first
        optimizer.zero_grad()
        if step % 100 == 0:
            checkpointer.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, "ckpt.pt")
    checkpointer.close()                                              # waits, raises any error

A pipelined save reads the live tensors while the next forward and backward
passes run. The only thing that changes the saved state in a training loop is
the optimizer step (and, during the forward pass, the running statistics of
normalization layers): the checkpointer registers an optimizer step pre-hook
(and a forward pre-hook on those layers of ``model``, when given) that waits
for the pending save first. The save therefore overlaps forward and backward
and never sees a half-updated state; if something else modifies a tensor
anyway, the save fails with ``TensorModifiedError`` and commits nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from fastpersist.api import futures

__all__ = ["Checkpointer"]


def _normalization_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.nn.modules.batchnorm import _NormBase

    return [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats]


class Checkpointer:
    """Runs :func:`fastpersist.async_save` and waits for it before the state changes.

    Args:
        optimizers: an optimizer or several; each gets a step pre-hook that
            waits for the pending save (pipelined mode) and raises its error.
        model: optional; normalization layers with running statistics get a
            forward pre-hook that waits (in training mode) before they update.
        mode: ``"pipelined"`` or ``"snapshot"`` (default: setting ``async_mode``).
            In snapshot mode nothing needs to wait: the hooks only raise the
            errors of saves that have finished.
        **settings: ``fastpersist.config`` overrides for every save.

    Raises (from ``save``, ``wait``, the hooks and ``close``): what the failed
    save raised, at the latest before the next optimizer step.
    """

    def __init__(
        self,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
        *,
        model: torch.nn.Module | None = None,
        mode: str | None = None,
        **settings: Any,
    ):
        self.mode = mode
        self.settings = settings
        self._pending: list[futures.SaveFuture] = []
        self._hooks = []
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
        if model is not None:
            for layer in _normalization_layers(model):
                self._hooks.append(layer.register_forward_pre_hook(self._before_forward))

    def detach(self) -> None:
        """Removes every hook (pending saves are not waited for)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def save(self, obj: object, path: str | os.PathLike[str], **settings: Any) -> futures.SaveFuture:
        """Starts an async save of ``obj`` to ``path``; raises the error of an earlier save first."""
        self._surface_errors()
        future = futures.async_save(obj, path, mode=self.mode, **{**self.settings, **settings})
        self._pending.append(future)
        return future

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

    def _needs_wait(self) -> bool:
        return any(f.mode == "pipelined" for f in self._pending if not f.done())

    def _before_step(self, optimizer, args, kwargs) -> None:
        if self._needs_wait():
            self.wait()
        else:
            self._surface_errors()

    def _before_forward(self, module, args) -> None:
        if module.training and self._needs_wait():
            self.wait()

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
                future._finished.wait()
