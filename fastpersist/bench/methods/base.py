"""What a benchmark method is: :class:`SaveMethod`, :class:`LoadMethod`, their registries and context.

A method family (a module of :mod:`fastpersist.bench.methods`) subclasses these
and calls :func:`register` for each method; the runner
(:mod:`fastpersist.bench.runner`) only ever talks to these interfaces.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from fastpersist.bench import measure
from fastpersist.tuning import workloads

__all__ = [
    "BenchContext",
    "SaveMethod",
    "LoadMethod",
    "SAVE_METHODS",
    "LOAD_METHODS",
    "register",
    "torch_load",
    "empty_like_state",
    "fastpersist_api",
]


@dataclasses.dataclass
class BenchContext:
    """What every method may need besides the state and a path.

    Attributes:
        device: where the state lives and where loads must put it.
        dist: rank / world size (from torchrun's environment, else 0 of 1).
        dcp_threads: ``FileSystemWriter(thread_count=...)`` for DCP saves.
        fastpersist_overrides: settings passed to every fastpersist call.
    """

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    dist: measure.DistributedEnv = dataclasses.field(default_factory=measure.DistributedEnv)
    dcp_threads: int = 1
    fastpersist_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


# ============================================================================ methods


class SaveMethod:
    """One way of writing a checkpoint durably.

    Subclasses set ``name`` (registry key), ``label`` (table text) and
    implement :meth:`save` and :meth:`read_back`. The runner calls, per round:
    ``save`` (timed, followed by a timed :func:`measure.fsync_paths` so every
    method pays for durability alike), then ``read_back`` + comparison
    (untimed), and ``cleanup`` at the end of the round.
    """

    name: str = ""
    label: str = ""
    default: bool = True
    """Run when no ``--methods`` are given."""

    def unavailable(self, ctx: BenchContext) -> str | None:
        """Why this method cannot run here, or None."""
        return None

    def target(self, directory: str, ctx: BenchContext) -> str:
        """Where this method writes (a file or a directory), distinct per rank."""
        suffix = f".rank{ctx.dist.rank}" if ctx.dist.world_size > 1 else ""
        return os.path.join(directory, self.name.replace("/", "_") + suffix + self.extension)

    extension: str = ".pt"

    def save(self, state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
        """Writes ``state`` to ``path``; returns extra timings (``blocked_seconds`` for async).

        Returns only when the bytes are durable or the runner's fsync makes them so.
        """
        raise NotImplementedError

    def read_back(self, path: str, state: Any, ctx: BenchContext) -> Any:
        """Loads what :meth:`save` wrote, to ``ctx.device``, for verification."""
        raise NotImplementedError

    def flat(self, loaded: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Tensors and other leaves of a loaded state, keyed as :func:`workloads.flatten_state` keys them.

        ``None`` for the other leaves means the format does not carry them.
        """
        return workloads.flatten_state(loaded)

    def cleanup(self, path: str) -> None:
        measure.remove_path(path)


class LoadMethod:
    """One way of reading a checkpoint written by save method ``source``."""

    name: str = ""
    label: str = ""
    source: str = ""
    default: bool = True

    def unavailable(self, ctx: BenchContext) -> str | None:
        return None

    def load(self, path: str, state: Any, ctx: BenchContext) -> Any:
        """Loads ``path`` completely onto ``ctx.device``.

        ``state`` is the original, for methods that (like DCP) must be told the
        structure; they may use its shapes and dtypes, never its data. Every
        byte must be resident when this returns (touch mmap'd pages).
        """
        raise NotImplementedError

    def flat(self, loaded: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        return workloads.flatten_state(loaded)


SAVE_METHODS: dict[str, SaveMethod] = {}
LOAD_METHODS: dict[str, LoadMethod] = {}


def register(method: SaveMethod | LoadMethod) -> SaveMethod | LoadMethod:
    """Adds a method to its registry (replacing one of the same name)."""
    if isinstance(method, SaveMethod):
        SAVE_METHODS[method.name] = method
    elif isinstance(method, LoadMethod):
        LOAD_METHODS[method.name] = method
    else:
        raise TypeError(f"not a benchmark method: {method!r}")
    return method


def torch_load(path: str, ctx: BenchContext, **kw: Any) -> Any:
    return torch.load(path, map_location=ctx.device, weights_only=True, **kw)


def empty_like_state(state: Any, device: torch.device | None = None) -> Any:
    """Same structure, freshly allocated (untouched) tensors; other leaves copied."""
    if isinstance(state, torch.Tensor):
        return torch.empty(state.shape, dtype=state.dtype, device=state.device if device is None else device)
    if isinstance(state, dict):
        return {k: empty_like_state(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v, device) for v in state]
    if isinstance(state, tuple):
        return tuple(empty_like_state(v, device) for v in state)
    return state


def fastpersist_api() -> tuple[Any, str | None]:
    try:
        import fastpersist

        fastpersist.save, fastpersist.load  # noqa: B018 - probe the public API
        return fastpersist, None
    except Exception as e:  # noqa: BLE001 - ImportError, AttributeError, or an error building the native module
        return None, f"fastpersist.save is not importable yet ({type(e).__name__}: {e})"
