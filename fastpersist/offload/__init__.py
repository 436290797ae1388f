"""Offloaded inference: run a model larger than the device by streaming its weights from the checkpoint.

``fastpersist.offload.dispatch(model, checkpoint, ...)`` reads the
checkpoint's tensor index (safetensors, sharded safetensors, or a torch /
fastpersist state dict file; :mod:`~fastpersist.offload.index`), matches it
with the model, plans which modules stay resident under the memory budget
and which are streamed (:mod:`~fastpersist.offload.plan`), and installs the
forward wrappers that stream them (:mod:`~fastpersist.offload.runtime`). The weights
are read in place: no second copy on disk, no full load into host memory.
See docs/offload.md.
"""

from __future__ import annotations

import argparse
import os

import torch

from fastpersist import config
from fastpersist.offload.index import TensorSource, read_index
from fastpersist.offload.plan import OffloadPlanError, bind_tensors, declared_ties, place, split_units
from fastpersist.offload.runtime import CheckpointChangedError, Offloaded, OffloadStats

__all__ = ["CheckpointChangedError", "OffloadPlanError", "OffloadStats", "Offloaded", "TensorSource", "dispatch"]


def _bytes(value: int | str | None, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return config.size_argument(value)
        except (argparse.ArgumentTypeError, ValueError) as e:  # the command lines' size syntax
            raise ValueError(f"{what} must be a byte count or a size like '20GiB', got {value!r}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a byte count (int >= 0) or a size like '20GiB', got {value!r}")
    return value


def _tie_weights(model: torch.nn.Module) -> None:
    """Ties what the model says to tie, as transformers' ``from_pretrained`` does before loading.

    A transformers model built under ``accelerate.init_empty_weights()`` is
    not tied (that context wraps each parameter assigned to a module in a new
    ``Parameter``, undoing the tie made while building), while
    ``save_pretrained`` stored the tied tensor once: without this, the other
    name would be missing from the checkpoint.
    """
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def dispatch(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike[str],
    device: str | torch.device = "cuda",
    max_gpu_memory: int | str | None = None,
    max_host_memory: int | str | None = None,
    *,
    slots: int = 3,
    unit_bytes: int | str | None = None,
) -> torch.nn.Module:
    """Makes ``model`` run on ``device`` with its weights read from ``checkpoint``, streamed where they do not fit.

    Args:
        model: any module, typically built on the meta device (its
            parameters' values are ignored; their shapes and dtypes must
            match the checkpoint's). Non-persistent buffers (not saved in
            checkpoints) must hold values: build with
            ``accelerate.init_empty_weights()`` or on the CPU. Its
            ``tie_weights()``, where it has one (transformers models), is
            called first; weights it declares tied
            (:func:`~fastpersist.offload.plan.declared_ties`) and saved
            under one of their names are found through that name.
        checkpoint: a safetensors file, a directory of sharded safetensors
            with its ``*.safetensors.index.json`` (or that index), or a torch
            zip file of a state dict (``torch.save`` / ``fastpersist.save``).
        device: ``"cuda"`` (``"cuda:N"``) or ``"cpu"``.
        max_gpu_memory: with CUDA, the bytes of device memory the weights may
            use (resident weights plus the streaming slots); ``None``: all
            weights resident (a plain load onto the device).
        max_host_memory: with CUDA, the host tier: streamed weights are kept
            in pinned host memory after their first read, up to this many
            bytes, so later passes copy them from there instead of reading
            the disk. With ``device="cpu"``, the budget of the weights in host
            memory (resident plus slots), like ``max_gpu_memory``.
        slots: streaming slots (one module runs in one while the next ones
            load into the others); at least 1, 3 by default.
        unit_bytes: largest module streamed as one unit (default: 1/32 of the
            model, at least its largest leaf module).

    Returns:
        ``model``, ready to run: ``model(...)`` and ``model.generate(...)``
        give the outputs of the model fully loaded on ``device``. Its
        ``fastpersist_offload`` attribute is the :class:`Offloaded` state
        (``stats()``, ``describe()``, ``close()``).

    Raises:
        OffloadPlanError: missing or extra keys, shape or dtype mismatches,
            non-persistent buffers on the meta device (all named), or a
            budget below the minimum (which it gives).
        FileNotFoundError, CorruptCheckpointError, UnsupportedObjectError:
            the checkpoint cannot be indexed.
        UnsafeCheckpointPathError: a sharded index names a shard outside
            its directory (nothing is opened; a ``CorruptCheckpointError``).
        ValueError: bad arguments.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    previous = getattr(model, "fastpersist_offload", None)
    if previous is not None and not previous.closed:
        raise ValueError("this model is already dispatched: call model.fastpersist_offload.close() first")
    target = torch.device(device)
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError('device="cuda" needs a CUDA GPU; use device="cpu" to stream into host memory')
        target = torch.device("cuda", torch.cuda.current_device() if target.index is None else target.index)
    elif target.type != "cpu":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    gpu_budget = _bytes(max_gpu_memory, "max_gpu_memory")
    host_budget = _bytes(max_host_memory, "max_host_memory")
    if target.type == "cpu" and gpu_budget is not None:
        raise ValueError('max_gpu_memory is for device="cuda"; with device="cpu" the budget is max_host_memory')

    index = read_index(checkpoint)
    _tie_weights(model)
    groups, kept = bind_tensors(model, index, declared_ties(model))
    units, pinned = split_units(model, groups, _bytes(unit_bytes, "unit_bytes"))
    first = next(model.parameters(), None)
    budget = gpu_budget if target.type == "cuda" else host_budget
    resident, streamed, count, slot_bytes = place(units, pinned, first, budget, slots)
    offloaded = Offloaded(
        model,
        target,
        [pinned, *resident] if pinned.bindings else resident,
        streamed,
        count,
        slot_bytes,
        kept,
        (host_budget or 0) if target.type == "cuda" else 0,
        config.settings(),
    )
    if previous is not None:
        previous.forget()
    model.fastpersist_offload = offloaded
    return model
