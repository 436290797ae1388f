"""PyTorch Lightning integration: CheckpointIO plugins, a ModelCheckpoint drop-in, a DDP sharded-save hook.

    from fastpersist.integrations.lightning import FastPersistCheckpoint
    trainer = Trainer(callbacks=[FastPersistCheckpoint(dirpath="ckpts", save_top_k=2, save_last=True)])

or, keeping your own callbacks::

    from fastpersist.integrations.lightning import FastPersistCheckpointIO, AsyncFastPersistCheckpointIO
    trainer = Trainer(plugins=[FastPersistCheckpointIO()])          # also Fabric(plugins=[...])

Lightning is imported when one of the names below is first used, never by
``import fastpersist``. Both distributions work: ``lightning`` (preferred
when both are installed) and ``pytorch_lightning``; :func:`for_package`
gives the classes built for a named one. See docs/lightning.md.

Names: ``FastPersistCheckpointIO``, ``AsyncFastPersistCheckpointIO``,
``FastPersistCheckpoint``, ``FastPersistDDPStrategy``,
``install_sharded_save(strategy)``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import types
import warnings
from typing import Any

import fastpersist
from fastpersist.api import futures
from fastpersist.api.checkpointer import Checkpointer
from fastpersist.io import targets

__all__ = [
    "FastPersistCheckpointIO",  # noqa: F822 (built lazily by __getattr__)
    "AsyncFastPersistCheckpointIO",  # noqa: F822 (built lazily by __getattr__)
    "FastPersistCheckpoint",  # noqa: F822 (built lazily by __getattr__)
    "FastPersistDDPStrategy",  # noqa: F822 (built lazily by __getattr__)
    "install_sharded_save",  # noqa: F822 (built lazily by __getattr__)
    "for_package",
    "save_supports_group",
]

log = logging.getLogger("fastpersist")

_PACKAGES = {
    # distribution -> (pytorch part, fabric part)
    "lightning": ("lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
}


def save_supports_group() -> bool:
    """Whether ``fastpersist.save`` takes ``group=`` (data-parallel sharded saves)."""
    try:
        return "group" in inspect.signature(fastpersist.save).parameters
    except (TypeError, ValueError):
        return False


_REPLICATED = ("state_dict", "optimizer_states", "lr_schedulers")
"""A Lightning checkpoint's keys that hold replicated state under DDP: differences there are divergence."""


def _collective(checkpoint: dict[str, Any], group: Any, divergence: str) -> dict[str, Any]:
    """A collective save's options for a Lightning checkpoint: every key but the replicated ones is per rank."""
    per_rank = tuple(k for k in checkpoint if isinstance(k, str) and k not in _REPLICATED)
    return {"group": group, "divergence": divergence, "per_rank": per_rank}


def _is_local(path: Any) -> bool:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return "://" not in text or text.startswith("file://")


def _in_store(path: Any) -> bool:
    """Whether fastpersist reads and writes ``path`` in a store itself (io.targets: S3 through boto3, the other
    URLs through fsspec); ``file://`` paths are local files."""
    return not _is_local(path) and targets.resolve(str(path)).remote


def _local(path: Any) -> str:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return text[len("file://") :] if text.startswith("file://") else text


def _settings_from(storage_options: Any, owner: str) -> dict[str, Any]:
    if storage_options is None:
        return {}
    if isinstance(storage_options, dict):
        return dict(storage_options)
    # Lightning's own wording first (code matches on it), then what we do accept.
    raise TypeError(
        "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
        f" is not supported for `{owner}`. Please implement your custom `CheckpointIO`"
        " to define how you'd like to use `storage_options`. (fastpersist takes a dict of its settings here,"
        f" for example {{'fsync': False}}; got {type(storage_options).__name__})"
    )


def _to_host(storage: Any, location: str) -> Any:
    """Lightning's default ``map_location`` (``TorchCheckpointIO``): leave every storage on the CPU."""
    return storage


_BYPASSING = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAStrategy", "SingleDeviceXLAStrategy")


def _bypasses_checkpoint_io(strategy: Any) -> str | None:
    """The strategy's class name if it saves sharded state itself, without CheckpointIO."""
    for cls in type(strategy).__mro__:
        if cls.__name__ in _BYPASSING:
            return cls.__name__
    return None


@functools.cache
def for_package(package: str) -> types.SimpleNamespace:
    """The integration classes built on ``package`` (``"lightning"`` or ``"pytorch_lightning"``).

    Raises:
        ImportError: that package is not installed (``pip install fastpersist[lightning]``).
    """
    if package not in _PACKAGES:
        raise ValueError(f"package must be one of {sorted(_PACKAGES)}, got {package!r}")
    pytorch_name, fabric_name = _PACKAGES[package]
    try:
        pl = importlib.import_module(pytorch_name)
        fabric_io = importlib.import_module(fabric_name + ".plugins.io.checkpoint_io")
        cloud_io = importlib.import_module(fabric_name + ".utilities.cloud_io")
        strategies = importlib.import_module(pytorch_name + ".strategies")
    except ImportError as e:
        raise ImportError(
            f"fastpersist's Lightning integration needs {package!r}: pip install fastpersist[lightning] ({e})"
        ) from e
    return _build(pl, fabric_io.CheckpointIO, cloud_io, strategies)


def _default_package() -> str:
    for package in ("lightning", "pytorch_lightning"):
        try:
            importlib.import_module(_PACKAGES[package][0])
            return package
        except ImportError:
            continue
    raise ImportError("fastpersist's Lightning integration needs Lightning: pip install fastpersist[lightning]")


def __getattr__(name: str) -> Any:
    if name in (
        "FastPersistCheckpointIO",
        "AsyncFastPersistCheckpointIO",
        "FastPersistCheckpoint",
        "FastPersistDDPStrategy",
        "install_sharded_save",
    ):
        return getattr(for_package(_default_package()), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The public classes are built once per Lightning package (``lightning``, ``pytorch_lightning``) by
# _build, each from one of the mixins below and that package's base class. The mixins hold every
# method; the attributes that name a package's classes or modules (``_cloud_io``,
# ``_checkpoint_io_class``, ...) are set by _build on the class it makes.


class _CheckpointIOMixin:
    """Lightning CheckpointIO that saves with ``fastpersist.save`` and loads with ``fastpersist.load``.

    Files are ordinary torch checkpoints (``torch.load`` reads them).
    Saves are atomic and durable. ``s3://bucket/key`` paths use
    fastpersist's object-store saves and loads (docs/object-storage.md);
    other non-local paths go through Lightning's own fsspec code.

    Args:
        **settings: ``fastpersist.config`` overrides for every save and load.
    """

    _cloud_io: Any  # the package's ``fabric.utilities.cloud_io`` module

    def __init__(self, **settings: Any) -> None:
        super().__init__()
        overrides, _ = fastpersist.config.split_overrides("FastPersistCheckpointIO", settings, allow_other=False)
        fastpersist.config.resolve(overrides)  # an unknown name or a bad value raises here, not at the first save
        self.settings = settings

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        storage_options: Any | None = None,
        *,
        group: Any = None,
        divergence: str = "warn",
    ) -> None:
        """Saves ``checkpoint`` to ``path`` (asynchronous saves: queues it, see ``_write_local``).

        Args:
            storage_options: None, or a dict of fastpersist settings for this save.
            group: a process group whose ranks all call this (sharded save,
                see :func:`install_sharded_save`); the file holds global
                rank 0's checkpoint, as Lightning's own rank-0 save does.
            divergence: with ``group``: what to do about tensors whose
                values differ between ranks (``"warn"``, ``"error"``,
                ``"ignore"``; see ``fastpersist.save``).

        Raises:
            TypeError: ``storage_options`` is not a dict.
            OSError: the save failed; the previous file at ``path`` is intact.
                Asynchronous saves: an earlier save or removal failed.
        """
        self._surface()
        settings = {**self.settings, **_settings_from(storage_options, type(self).__name__)}
        collective = {} if group is None else _collective(checkpoint, group, divergence)
        if not _is_local(path):
            self._wait()  # remote saves are synchronous, after what is pending
            if _in_store(path):
                fastpersist.save(checkpoint, str(path), **collective, **settings)
            else:
                self._cloud_io._atomic_save(checkpoint, path)
            return
        path = _local(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._write_local(checkpoint, path, collective, settings)

    def _write_local(self, checkpoint: dict[str, Any], path: str, collective: dict, settings: dict) -> None:
        fastpersist.save(checkpoint, path, **collective, **settings)

    def _surface(self) -> None:
        """Raises the error of an earlier save or removal that failed in the background (none here)."""

    def _wait(self) -> None:
        """Waits for every pending save and removal; raises the first error (none pending here)."""

    def load_checkpoint(
        self, path: Any, map_location: Any | None = _to_host, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Loads the checkpoint at ``path`` (``FileNotFoundError`` if it is missing), after pending saves.

        ``map_location`` defaults to Lightning's own (``lambda storage, loc:
        storage``): every tensor comes back on the CPU, whatever device it
        was saved from (under DDP a file saved on rank 0 names ``cuda:0``,
        which is not rank 1's device).
        """
        self._wait()
        settings = {k: v for k, v in self.settings.items() if k not in ("async_mode", "async_max_pending")}
        if _in_store(path):
            return fastpersist.load(str(path), map_location=map_location, weights_only=weights_only, **settings)
        if not _is_local(path):
            return self._cloud_io._load(path, map_location=map_location, weights_only=weights_only)
        path = _local(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return fastpersist.load(path, map_location=map_location, weights_only=weights_only, **settings)

    def remove_checkpoint(self, path: Any) -> None:
        """Removes the checkpoint file (or directory) at ``path``; nothing if it does not exist."""
        if _in_store(path):
            from fastpersist.distributed.objectstore import remove_checkpoint

            remove_checkpoint(str(path))  # and the part objects, if a collective save wrote it
            log.debug("removed checkpoint %s", path)
            return
        fs = self._cloud_io.get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
            log.debug("removed checkpoint %s", path)

    def teardown(self) -> None:
        """Waits for every pending save and removal; raises the first error."""
        self._wait()


class _AsyncCheckpointIOMixin(_CheckpointIOMixin):
    """Like :class:`FastPersistCheckpointIO`, but ``save_checkpoint`` returns before the file is written.

    Safe where Lightning's ``AsyncCheckpointIO`` is not: no clone of the
    state on the GPU. In ``snapshot`` mode (the default) the state is
    copied into a reusable pinned host area (size of one checkpoint) and
    training may change it at once. In ``pipelined`` mode nothing is
    copied; the optimizers must then be attached (:meth:`attach`; the
    :class:`FastPersistCheckpoint` callback does it) so that each
    ``optimizer.step()`` waits until the pending save has read the state
    (not until it is written); a change anyway fails that save
    (``TensorModifiedError``), never writes a torn file.

    ``remove_checkpoint`` of a path runs after the pending saves (in
    order, on the background thread); ``load_checkpoint`` waits for
    pending saves first. A failed save is raised by the next
    ``save_checkpoint`` or by ``teardown``. Saves to remote paths are
    synchronous, after the pending ones.

    Under DDP with the sharded hook (:func:`install_sharded_save`) every
    rank calls ``save_checkpoint`` with the group: each save is an
    asynchronous collective one (``fastpersist.async_save(...,
    group=...)``), every rank writing its share of rank 0's checkpoint in
    the background. :attr:`last_stats` holds this rank's figures for the
    last one that finished.

    Args:
        mode: ``"snapshot"`` or ``"pipelined"``.
        **settings: ``fastpersist.config`` overrides.
    """

    def __init__(self, mode: str = "snapshot", **settings: Any) -> None:
        super().__init__(async_mode=mode, **settings)
        self.mode = mode
        # Lightning's callbacks (EMA, SWA, ...) may change the state in place between a save and the
        # next optimizer step: the snapshot's copies are ordered before the caller's next kernels.
        self._checkpointer = Checkpointer(mode=mode, overlap_snapshots=False)
        self._removals: list[futures.SaveFuture] = []
        self.last_stats: Any = None  # a collective save's SaveStats, once one finished

    def attach(self, optimizers: Any = (), model: Any = None) -> None:
        """Makes ``optimizer.step()`` (and norm layers' forward) wait for a pending pipelined save."""
        self._checkpointer.attach(optimizers, model=model)

    def detach(self) -> None:
        """Removes the hooks that :meth:`attach` added."""
        self._checkpointer.detach()

    def _write_local(self, checkpoint: dict[str, Any], path: str, collective: dict, settings: dict) -> None:
        future = self._checkpointer.save(checkpoint, path, **{**settings, **collective})
        if collective:
            future.add_done_callback(self._keep_stats)

    def _keep_stats(self, future: Any) -> None:
        if future.stats is not None:
            self.last_stats = future.stats

    def _surface(self) -> None:
        removals, self._removals = self._removals, [f for f in self._removals if not f.done()]
        for removal in removals:
            if removal.done():
                removal.result()
        self._checkpointer._surface_errors()

    def _wait(self) -> None:
        removals, self._removals = self._removals, []
        try:
            self._checkpointer.wait()
        finally:
            errors = [f.exception() for f in removals]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def remove_checkpoint(self, path: Any) -> None:
        if not _is_local(path):
            self._wait()
            super().remove_checkpoint(path)
            return
        # Lightning removes old top-k files right after asking for a new save: run the removal
        # on the save thread, after every write already queued (of this path too).
        self._removals.append(futures.run_in_order(lambda: _remove(_local(path)), _local(path)))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        import shutil

        shutil.rmtree(path)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _rank_zero_warn(message: str) -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
    except Exception:  # noqa: BLE001
        pass
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _install_sharded_save(strategy: Any, divergence: str, checkpoint_io_class: type) -> Any:
    """Lets every data-parallel rank write its slice of each checkpoint (DDP).

    Lightning calls CheckpointIO on global rank 0 only; after this call the
    strategy's ``save_checkpoint`` runs on every rank and calls
    ``fastpersist.save(checkpoint, path, group=WORLD)`` collectively: the
    file holds global rank 0's checkpoint (what Lightning's own save
    writes: rank 0's Timer state, its unsynchronized metrics), and each
    rank writes the byte ranges of it that it holds identically (the
    replicated weights and optimizer state). With
    :class:`AsyncFastPersistCheckpointIO` each save is an asynchronous
    collective one: every rank writes its share in the background.
    ``divergence`` says what to do about model, optimizer or scheduler
    tensors whose values differ between ranks (``"warn"``: write rank 0's
    and warn once; ``"error"``; ``"ignore"``); the rest of the checkpoint
    (loops, callbacks: per-rank state that Lightning's own rank-0 save
    writes as rank 0 has it) is expected to differ and never warned
    about. If
    this fastpersist has no sharded save (``save`` without ``group``), or
    the world has one rank, rank 0 saves the whole file as before (with one
    warning in the first case). The strategy's CheckpointIO becomes a
    :class:`FastPersistCheckpointIO` unless it already is one. Returns
    ``strategy``.

    Raises:
        TypeError: the strategy saves sharded state itself and bypasses
            CheckpointIO (FSDP, DeepSpeed, ModelParallel, XLA): use its own
            checkpointing (or fastpersist's torch.distributed.checkpoint
            backend) instead.
    """
    # checkpoint_io_class: the FastPersistCheckpointIO of the strategy's package (the public
    # install_sharded_save that _build makes passes it).
    bypass = _bypasses_checkpoint_io(strategy)
    if bypass is not None:
        raise TypeError(
            f"{bypass} saves sharded checkpoints itself and does not go through CheckpointIO, so "
            "fastpersist cannot write its slices; keep the strategy's own checkpointing (or use "
            "torch.distributed.checkpoint), or use DDPStrategy for replicated state"
        )
    if getattr(strategy, "_fastpersist_sharded", False):
        return strategy
    if not isinstance(getattr(strategy, "_checkpoint_io", None), checkpoint_io_class):
        strategy.checkpoint_io = checkpoint_io_class()
    original = strategy.save_checkpoint

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        import torch.distributed as dist

        io = strategy.checkpoint_io
        sharded = (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
            and isinstance(io, checkpoint_io_class)
            and _is_local(filepath)
        )
        if sharded and not save_supports_group():
            if not getattr(strategy, "_fastpersist_warned", False):
                strategy._fastpersist_warned = True
                _rank_zero_warn(
                    "this fastpersist has no sharded save (fastpersist.save(..., group=)); "
                    "global rank 0 writes whole checkpoints"
                )
            sharded = False
        if not sharded:
            original(checkpoint, filepath, storage_options=storage_options)
            return
        io.save_checkpoint(checkpoint, filepath, storage_options, group=dist.group.WORLD, divergence=divergence)

    strategy.save_checkpoint = save_checkpoint
    strategy._fastpersist_sharded = True
    return strategy


class _DDPStrategyMixin:
    """``DDPStrategy`` whose checkpoints are written by fastpersist, each rank its slice.

    Same arguments as ``DDPStrategy``, and ``divergence`` (see
    :func:`install_sharded_save`); ``checkpoint_io`` defaults to
    :class:`FastPersistCheckpointIO`.
    """

    _checkpoint_io_class: type  # the package's FastPersistCheckpointIO

    def __init__(self, *args: Any, divergence: str = "warn", **kwargs: Any) -> None:
        kwargs.setdefault("checkpoint_io", self._checkpoint_io_class())
        super().__init__(*args, **kwargs)
        _install_sharded_save(self, divergence, self._checkpoint_io_class)


class _CheckpointCallbackMixin:
    """``ModelCheckpoint`` (same arguments) whose files are written by fastpersist.

    In ``setup`` it installs a fastpersist CheckpointIO on the trainer's
    strategy (so ``trainer.save_checkpoint`` and resuming with
    ``ckpt_path=`` use it too) and, under DDP, the sharded-save hook.

    Args:
        *args, **kwargs: as ``ModelCheckpoint``.
        async_mode: None (synchronous saves, the default), ``"snapshot"``
            or ``"pipelined"`` (:class:`AsyncFastPersistCheckpointIO`; in
            pipelined mode the optimizers wait for the pending save before
            stepping).
        sharded: under DDP, let every rank write its slice of rank 0's
            checkpoint (with ``async_mode``: in the background, each save an
            asynchronous collective one).
        divergence: with ``sharded``: tensors whose values differ between
            ranks (an unsynchronized metric's best score, a drifted
            replica) are written as rank 0 has them, with one warning
            (``"warn"``), silently (``"ignore"``), or refused (``"error"``).
        settings: ``fastpersist.config`` overrides (a dict).
    """

    # The package's FastPersistCheckpointIO, AsyncFastPersistCheckpointIO and DDPStrategy.
    _checkpoint_io_class: type
    _async_checkpoint_io_class: type
    _ddp_strategy_class: type

    def __init__(
        self,
        *args: Any,
        async_mode: str | None = None,
        sharded: bool = True,
        divergence: str = "warn",
        settings: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if async_mode not in (None, "snapshot", "pipelined"):
            raise ValueError(f"async_mode must be None, 'snapshot' or 'pipelined', got {async_mode!r}")
        self.async_mode = async_mode
        self.sharded = sharded
        self.divergence = divergence
        self.fastpersist_settings = dict(settings or {})
        self.checkpoint_io: _CheckpointIOMixin | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        strategy = trainer.strategy
        bypass = _bypasses_checkpoint_io(strategy)
        if bypass is not None:
            _rank_zero_warn(
                f"FastPersistCheckpoint: {bypass} writes its checkpoints itself (not through CheckpointIO); "
                "they are saved by the strategy, not by fastpersist"
            )
            return
        current = getattr(strategy, "_checkpoint_io", None)
        if isinstance(current, self._checkpoint_io_class):
            self.checkpoint_io = current
        else:
            if current is not None and type(current).__name__ != "TorchCheckpointIO":
                _rank_zero_warn(
                    f"FastPersistCheckpoint replaces the strategy's {type(current).__name__} with fastpersist"
                )
            if self.async_mode is None:
                self.checkpoint_io = self._checkpoint_io_class(**self.fastpersist_settings)
            else:
                self.checkpoint_io = self._async_checkpoint_io_class(self.async_mode, **self.fastpersist_settings)
            strategy.checkpoint_io = self.checkpoint_io
        if self.sharded and isinstance(strategy, self._ddp_strategy_class):
            _install_sharded_save(strategy, self.divergence, self._checkpoint_io_class)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        io = self.checkpoint_io
        if isinstance(io, self._async_checkpoint_io_class) and io.mode == "pipelined":
            optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]
            io.attach(optimizers, model=pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = self.checkpoint_io
        if isinstance(io, self._async_checkpoint_io_class):
            io.detach()
            io.teardown()  # raises a failed save's error
        super().teardown(trainer, pl_module, stage)


def _compose(name: str, mixin: type, base: type, **attributes: Any) -> type:
    """``class <name>(mixin, base)`` with ``attributes``, named as this module's ``name``.

    Pickle finds it again by that name (through this module's ``__getattr__``, as
    ddp_spawn needs), and Lightning keys a callback's state by its qualname.
    """
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": mixin.__doc__, **attributes}
    return types.new_class(name, (mixin, base), exec_body=lambda ns: ns.update(namespace))


def _build(pl: Any, CheckpointIO: type, cloud_io: Any, strategies: Any) -> types.SimpleNamespace:
    """The public classes for one Lightning package: each mixin composed with that package's base class."""
    sync_io = _compose("FastPersistCheckpointIO", _CheckpointIOMixin, CheckpointIO, _cloud_io=cloud_io)
    async_io = _compose("AsyncFastPersistCheckpointIO", _AsyncCheckpointIOMixin, sync_io)
    ddp = _compose("FastPersistDDPStrategy", _DDPStrategyMixin, strategies.DDPStrategy, _checkpoint_io_class=sync_io)
    callback = _compose(
        "FastPersistCheckpoint",
        _CheckpointCallbackMixin,
        pl.callbacks.ModelCheckpoint,
        _checkpoint_io_class=sync_io,
        _async_checkpoint_io_class=async_io,
        _ddp_strategy_class=strategies.DDPStrategy,
    )

    def install_sharded_save(strategy: Any, divergence: str = "warn") -> Any:
        return _install_sharded_save(strategy, divergence, sync_io)

    install_sharded_save.__doc__ = _install_sharded_save.__doc__
    return types.SimpleNamespace(
        FastPersistCheckpointIO=sync_io,
        AsyncFastPersistCheckpointIO=async_io,
        FastPersistCheckpoint=callback,
        FastPersistDDPStrategy=ddp,
        install_sharded_save=install_sharded_save,
    )
