"""``patch``: torch.save, torch.load and safetensors' functions routed through fastpersist, for code you do not own.

Most checkpoints are written by libraries (Hugging Face Trainer, accelerate,
Lightning, NeMo, DeepSpeed's ``TorchCheckpointEngine``) that call
``torch.save``/``torch.load`` and ``safetensors.torch.save_file``/``load_file``/
``safe_open`` themselves. :func:`patch` replaces those functions, in every
module that holds them, by wrappers with the same signatures that hand each
call to fastpersist when fastpersist can take it and to the original function
otherwise; the :class:`Restorer` it returns puts the original objects back.
``python -m fastpersist.run script.py ARGS`` (:mod:`fastpersist.cli.run`)
patches before the script imports anything. docs/patch.md has the details,
the measured costs and what is not covered.

Routing (everything not listed goes to the original, unchanged):

* ``torch.save(obj, f, ...)``: a path or a file object -> :func:`fastpersist.save`
  (atomic, durable; file objects are streamed). The legacy format
  (``_use_new_zipfile_serialization=False``) and saves inside
  ``torch.serialization.skip_data()`` are torch's own, as are URL strings
  (``s3://``, ``memory://``...: torch treats them as local paths).
* ``torch.load(f, ...)``: a path to a zip checkpoint -> :func:`fastpersist.load`.
  File objects, ``mmap=True`` (or torch's ``load.mmap`` setting), legacy and
  non-checkpoint files, and keywords that fastpersist would take as settings
  go to torch.load.
* ``safetensors.torch.save_file``: a dict of CPU or CUDA tensors to a path ->
  :func:`fastpersist.save_file` with ``alignment`` (8 by default: the library's
  exact bytes). What fastpersist refuses (other devices or dtypes, invalid
  arguments) goes to the library, which raises its own errors.
* ``safetensors.torch.load_file`` and ``safetensors.safe_open`` (framework
  ``"pt"``, CPU or CUDA) -> fastpersist's; a file fastpersist finds invalid
  goes to the library, whose verdict (and error) stands.

``mode="snapshot"``: a save to a path returns once the state is copied into a
staging area (host memory); the background save thread writes and commits it
(:func:`fastpersist.async_save`). Loads of a path with a pending save wait
for it; pending saves complete at interpreter exit; a failed one is raised by
the next patched call. Each save lands in the directory that was there at the
call (:class:`fastpersist.io.commit.DirectoryAnchor`); a save into another
directory first waits for the pending ones, so a library that rotates old
checkpoint directories never deletes one with a save still pending.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import os
import pickle
import sys
import threading
import types
import warnings
from typing import Any

from fastpersist import config, errors
from fastpersist.api import futures, loading, saving
from fastpersist.api import safetensors as safetensors_api
from fastpersist.io import targets
from fastpersist.io.commit import target_kind
from fastpersist.io.queue import SaveFuture, pending_saves
from fastpersist.tensors import torch_serialization_config

__all__ = ["MODES", "Restorer", "patch", "patch_stats"]

MODES = ("sync", "snapshot")
_SNAPSHOT_MAX_PENDING = 8  # a checkpoint's files in flight at once (Trainer writes five); the user may pass another
_TORCH_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL, checked against torch's signature at install
_RESERVED = frozenset(f.name for f in dataclasses.fields(config.Settings)) | {"verify", "group", "timeout"}


@dataclasses.dataclass(frozen=True, eq=False)
class _Options:
    """One :func:`patch` call's choices (the innermost active one applies)."""

    mode: str
    safetensors: bool
    alignment: int
    settings: dict[str, Any]


_lock = threading.RLock()
_stack: list[_Options] = []  # active patches, innermost last
_installed: dict[str, dict[str, tuple[Any, Any]]] = {}  # group -> name -> (original, wrapper)
_saves: list[tuple[SaveFuture, tuple[int, int]]] = []  # snapshot saves of the patch -> (device, inode) of their dir
_stats: dict[str, collections.Counter] = {"fastpersist": collections.Counter(), "original": collections.Counter()}


def _reset_after_fork() -> None:
    global _lock, _saves
    _lock = threading.RLock()
    _saves = []  # the parent's pending saves finish in the parent (fastpersist.io.queue)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _options() -> _Options | None:
    try:
        return _stack[-1]
    except IndexError:
        return None


def _count(route: str, name: str) -> None:
    with _lock:
        _stats[route][name] += 1


def patch_stats() -> dict[str, dict[str, int]]:
    """How many calls the patched functions handed to fastpersist and to the originals, by function.

    ``{"fastpersist": {"torch.save": 3, "save_file": 1, ...}, "original": {"torch.load": 1, ...}}``,
    counted since the process started (across patches); for checking that a
    library's checkpoints really went through fastpersist.
    """
    with _lock:
        return {route: dict(counter) for route, counter in _stats.items()}


# ----------------------------------------------------------------------------- waiting for background saves


def _settle(selected: list[SaveFuture]) -> None:
    """Waits for ``selected`` (saves of the patch or pending saves of a path); raises the first failure."""
    first = None
    for future in selected:
        error = future.exception()
        if error is not None and first is None:
            first = error
    with _lock:
        _saves[:] = [(f, d) for f, d in _saves if not f.done()]
    if first is not None:
        first.add_note(
            "raised by a later call: this background save (fastpersist.patch(mode='snapshot')) failed, and that "
            "file was not written"
        )
        raise first


def _raise_failed_saves() -> None:
    """Raises the error of a finished snapshot save of the patch that failed (once), so a library hears of it."""
    with _lock:
        done = [f for f, _ in _saves if f.done()]
    if done:
        _settle(done)


def _wait_for_path(f: Any) -> None:
    """Waits for the pending saves of the path ``f`` (a load must see them; a save must land after them)."""
    path = os.path.realpath(os.fspath(f))
    selected = [future for future in pending_saves() if future.path == path]
    if selected:
        _settle(selected)


def _wait_for_other_directories(identity: tuple[int, int]) -> None:
    """Waits for the patch's pending saves into other directories, raising their failures.

    Libraries delete or rename old checkpoint directories right after saving a
    new one (Trainer's ``save_total_limit`` sorts them by modification time),
    so the pending saves never span two checkpoint directories.
    """
    with _lock:
        selected = [f for f, d in _saves if d != identity]
    if selected:
        _settle(selected)


# ----------------------------------------------------------------------------- the wrappers


def _is_local_path(f: Any) -> bool:
    return isinstance(f, (str, os.PathLike)) and not targets.is_url(f)


def _save_later(options: _Options, path: Any, start) -> bool:
    """In snapshot mode, queues a save of the regular file ``path`` (``start()`` returns its future); False when
    the save must run now (sync mode, special files)."""
    if options.mode != "snapshot" or target_kind(os.path.realpath(os.fspath(path))) != "regular":
        return False
    try:
        info = os.stat(os.path.dirname(os.path.realpath(os.fspath(path))))
    except OSError:
        return False  # the synchronous save raises torch's error for it
    identity = (info.st_dev, info.st_ino)
    _wait_for_other_directories(identity)
    future = start({"async_max_pending": _SNAPSHOT_MAX_PENDING, **options.settings, "mode": "snapshot"})
    with _lock:
        _saves.append((future, identity))
    return True


def torch_save(
    obj: object,
    f: Any,
    pickle_module: Any = pickle,
    pickle_protocol: int = _TORCH_PROTOCOL,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
) -> None:
    """``torch.save`` through fastpersist (see the module docstring); torch's own otherwise."""
    options = _options()
    arguments = (obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record)
    if options is None or targets.is_url(f) or saving.torch_writes_it(_use_new_zipfile_serialization):
        _count("original", "torch.save")
        return _original("torch", "torch.save")(*arguments)
    _raise_failed_saves()
    if isinstance(f, (str, os.PathLike)):
        _wait_for_path(f)
        if not _disable_byteorder_record and _save_later(
            options,
            f,
            lambda extra: futures.async_save(obj, f, pickle_module, pickle_protocol, format="torch", **extra),
        ):
            _count("fastpersist", "torch.save")
            return None
    _count("fastpersist", "torch.save")
    saving.save(*arguments, format="torch", **options.settings)
    return None


def torch_load(
    f: Any,
    map_location: Any = None,
    pickle_module: Any = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    **pickle_load_args: Any,
) -> Any:
    """``torch.load`` through fastpersist for paths to zip checkpoints; torch's own otherwise."""
    options = _options()
    mapped = mmap if mmap is not None else getattr(getattr(torch_serialization_config, "load", None), "mmap", False)
    if options is None or not _is_local_path(f) or mapped or _RESERVED.intersection(pickle_load_args):
        return _load_with_torch(f, map_location, pickle_module, weights_only, mmap, pickle_load_args)
    _raise_failed_saves()
    _wait_for_path(f)
    try:
        with open(f, "rb") as handle:
            zipped = handle.read(4) == b"PK\x03\x04"
    except OSError:
        zipped = False  # torch.load raises the error of its own open()
    if not zipped:  # legacy files, safetensors, anything else: torch decides
        return _load_with_torch(f, map_location, pickle_module, weights_only, mmap, pickle_load_args)
    _count("fastpersist", "torch.load")
    return loading.load(
        f, map_location, pickle_module, weights_only=weights_only, mmap=False, **pickle_load_args, **options.settings
    )


def _load_with_torch(f, map_location, pickle_module, weights_only, mmap, pickle_load_args) -> Any:
    _count("original", "torch.load")
    return _original("torch", "torch.load")(
        f, map_location, pickle_module, weights_only=weights_only, mmap=mmap, **pickle_load_args
    )


def _writable_by_fastpersist(tensors: Any, metadata: Any) -> bool:
    """Whether fastpersist writes this ``save_file`` call itself (else the library does, raising its own errors)."""
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        return False
    try:
        safetensors_api.check_tensors(tensors)
    except (ValueError, TypeError, RuntimeError):
        return False
    return all(t.device.type in ("cpu", "cuda") for t in tensors.values())


def save_file(tensors: Any, filename: Any, metadata: Any = None) -> None:
    """``safetensors.torch.save_file`` through fastpersist (see the module docstring); the library's otherwise."""
    options = _options()
    if (
        options is None
        or not options.safetensors
        or not _is_local_path(filename)
        or not _writable_by_fastpersist(tensors, metadata)
    ):
        _count("original", "save_file")
        return _original("safetensors", "save_file")(tensors, filename, metadata)
    _raise_failed_saves()
    _wait_for_path(filename)
    _count("fastpersist", "save_file")
    try:
        if _save_later(
            options,
            filename,
            lambda extra: safetensors_api.async_save_file(
                tensors, filename, metadata, alignment=options.alignment, **extra
            ),
        ):
            return None
        safetensors_api.save_file(tensors, filename, metadata, alignment=options.alignment, **options.settings)
    except OSError as error:  # the library raises SafetensorError for I/O errors: both clauses must catch it
        raise safetensors_api.as_library_error(error) from None
    return None


def _device_for_fastpersist(device: Any) -> bool:
    import torch

    try:
        kind = torch.device(f"cuda:{device}" if isinstance(device, int) else device).type
    except (RuntimeError, TypeError, ValueError):
        return False
    return kind == "cpu" or (kind == "cuda" and torch.cuda.is_available())


def _readable_by_fastpersist(options: _Options | None, filename: Any, framework: str, device: Any, backend) -> bool:
    return (
        options is not None
        and options.safetensors
        and _is_local_path(filename)
        and framework in ("pt", "torch", "pytorch")
        and backend in ("mmap", "pread")
        and _device_for_fastpersist(device)
    )


def load_file(filename: Any, device: Any = "cpu", *, backend: str = "mmap") -> dict:
    """``safetensors.torch.load_file`` through fastpersist; the library's for what fastpersist does not read."""
    options = _options()
    if _readable_by_fastpersist(options, filename, "pt", device, backend):
        tensors = _read_through_fastpersist(
            "load_file",
            filename,
            lambda: safetensors_api.load_file(filename, device=device, backend=backend, **options.settings),
        )
        if tensors is not _REFUSED:
            return tensors
    _count("original", "load_file")
    return _original("safetensors", "load_file")(filename, device, backend=backend)


_REFUSED = object()


def _read_through_fastpersist(name: str, filename: Any, read) -> Any:
    """``read()`` (fastpersist's reader of a safetensors file), after pending saves of it; ``_REFUSED`` when
    fastpersist finds the file invalid, so the library reads it and its verdict (and error) stands."""
    _raise_failed_saves()
    _wait_for_path(filename)
    try:
        result = read()
    except errors.InvalidSafetensorsError:
        return _REFUSED
    _count("fastpersist", name)
    return result


class _SafeOpenType(type):
    """``isinstance(x, safetensors.safe_open)`` stays true for the library's objects and fastpersist's."""

    def __instancecheck__(cls, instance: Any) -> bool:
        if isinstance(instance, safetensors_api.safe_open):
            return True
        library = _installed.get("safetensors", {}).get("safe_open", (None,))[0]
        return isinstance(library, type) and isinstance(instance, library)


class safe_open(metaclass=_SafeOpenType):  # the library's name
    """``safetensors.safe_open`` through fastpersist: the object returned is fastpersist's
    :class:`fastpersist.api.safetensors.safe_open` (framework ``"pt"``, CPU or CUDA) or the library's."""

    def __new__(cls, filename: Any, framework: str, device: Any = "cpu", *, backend: str = "mmap"):
        options = _options()
        if _readable_by_fastpersist(options, filename, framework, device, backend):
            opened = _read_through_fastpersist(
                "safe_open",
                filename,
                lambda: safetensors_api.safe_open(filename, "pt", device, backend=backend, **options.settings),
            )
            if opened is not _REFUSED:
                return opened
        _count("original", "safe_open")
        return _original("safetensors", "safe_open")(filename, framework, device, backend=backend)


def _original(group: str, name: str) -> Any:
    entry = _installed.get(group, {}).get(name)
    if entry is not None:
        return entry[0]
    return _current_functions(group)[name]  # not installed: what the library has now


# ----------------------------------------------------------------------------- installing


def _current_functions(group: str) -> dict[str, Any]:
    """The functions of ``group`` as their libraries hold them now (originals, unless someone else patched)."""
    if group == "torch":
        import torch

        return {"torch.save": torch.save, "torch.load": torch.load}
    import safetensors
    import safetensors.torch

    return {
        "save_file": safetensors.torch.save_file,
        "load_file": safetensors.torch.load_file,
        "safe_open": safetensors.safe_open,
    }


_WRAPPERS = {
    "torch.save": torch_save,
    "torch.load": torch_load,
    "save_file": save_file,
    "load_file": load_file,
    "safe_open": safe_open,
}


def _compatible(original: Any, wrapper: Any) -> bool:
    """Same parameter names, kinds and defaults (annotations aside); True when the original has no signature."""
    try:
        theirs = inspect.signature(original).parameters.values()
    except (TypeError, ValueError):
        return True
    ours = inspect.signature(wrapper).parameters.values()
    if any(p.default is Ellipsis for p in theirs):  # a compiled class's text signature: names and kinds only
        return [(p.name, p.kind) for p in theirs] == [(p.name, p.kind) for p in ours]
    return [(p.name, p.kind, p.default) for p in theirs] == [(p.name, p.kind, p.default) for p in ours]


def _wrapper_for(name: str, original: Any) -> Any:
    wrapper = _WRAPPERS[name]
    if isinstance(wrapper, type):
        return wrapper  # safe_open: a class, whose instances are the library's or fastpersist's

    @functools.wraps(original)  # the original's name, docstring and signature (inspect.signature follows it)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return wrapper(*args, **kwargs)

    patched.__fastpersist_patch__ = name
    return patched


def _install(group: str) -> None:
    entries = {}
    for name, original in _current_functions(group).items():
        if original is _WRAPPERS[name] or getattr(original, "__fastpersist_patch__", None):
            continue  # a wrapper of an earlier patch, still held there: not an original
        if not _compatible(original, _WRAPPERS[name]):
            warnings.warn(
                f"fastpersist.patch: {name} has a signature this fastpersist does not know "
                f"({inspect.signature(original)}); it is left unpatched",
                RuntimeWarning,
                stacklevel=4,
            )
            continue
        entries[name] = (original, _wrapper_for(name, original))
    _installed[group] = entries
    _swap({id(original): (original, wrapper) for original, wrapper in entries.values()})


def _uninstall(group: str) -> None:
    entries = _installed.pop(group, {})
    _swap({id(wrapper): (wrapper, original) for original, wrapper in entries.values()})


def _swap(mapping: dict[int, tuple[Any, Any]]) -> None:
    """In every module's globals (fastpersist's aside), replaces each value that *is* a key with its partner.

    Modules that imported a function by name before the patch
    (``from safetensors.torch import save_file as safe_save_file``, as
    transformers does) hold the object itself: they are found by identity.
    fastpersist's own modules keep torch's functions, which they call for what
    they hand to torch.
    """
    if not mapping:
        return
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or name == "fastpersist" or name.startswith("fastpersist."):
            continue
        namespace = module.__dict__
        for attribute, value in list(namespace.items()):
            pair = mapping.get(id(value))
            if pair is not None and value is pair[0]:
                namespace[attribute] = pair[1]


def _wanted_groups() -> set[str]:
    wanted = {"torch"} if _stack else set()
    if any(o.safetensors for o in _stack) and importlib.util.find_spec("safetensors") is not None:
        wanted.add("safetensors")
    return wanted


def _reconcile() -> None:
    """Installs the groups some active patch needs and removes the others (under ``_lock``)."""
    wanted = _wanted_groups()
    for group in sorted(set(_installed) - wanted):
        _uninstall(group)
    for group in sorted(wanted - set(_installed)):
        _install(group)


class Restorer(contextlib.AbstractContextManager):
    """What :func:`patch` returns: call it (or leave its ``with`` block) to undo that patch.

    Patches nest: the innermost active one's options apply, and when the last
    one is undone, torch's and safetensors' own function objects are back
    everywhere the patch had put its wrappers (``torch.save is
    torch.serialization.save`` and the original object again). Undoing the
    last patch first waits for its pending snapshot saves, and raises the
    first of their errors (after restoring). Calling it again does nothing.
    """

    def __init__(self, options: _Options):
        self._options = options
        self._done = False

    @property
    def active(self) -> bool:
        """Whether this patch is still in place."""
        return not self._done

    def __call__(self) -> None:
        with _lock:
            if self._done:
                return
            last = _stack == [self._options]
        failure = None
        if last:
            failure = _settled_quietly()  # while the wrappers still wait for pending paths
        with _lock:
            if self._done:
                return
            self._done = True
            _stack[:] = [o for o in _stack if o is not self._options]
            _reconcile()
        if last:
            failure = failure or _settled_quietly()  # saves queued meanwhile
        if failure is not None:
            raise failure

    restore = __call__

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self()
            return
        try:
            self()
        except Exception as error:  # noqa: BLE001 - the block's own exception wins; this one is reported
            warnings.warn(f"fastpersist.patch: a pending save failed: {error!r}", RuntimeWarning, stacklevel=2)


def _settled_quietly() -> BaseException | None:
    with _lock:
        selected = [f for f, _ in _saves]
    try:
        _settle(selected)
    except Exception as error:  # noqa: BLE001 - returned to be raised once the originals are back
        return error
    return None


def patch(*, mode: str = "sync", safetensors: bool = True, alignment: int = 8, **settings: Any) -> Restorer:
    """Routes ``torch.save``, ``torch.load`` and safetensors' ``save_file``/``load_file``/``safe_open`` through
    fastpersist, everywhere in the process; returns a :class:`Restorer`.

    ::

        with fastpersist.patch():
            trainer.train()  # Hugging Face Trainer's checkpoints are written by fastpersist

    Safe to call from several threads; patches nest. The wrappers keep the
    originals' signatures, return values and exception types (fastpersist's
    exceptions subclass torch's; under safetensors' functions an I/O error is
    also a ``safetensors.SafetensorError``). Modules that imported the
    functions by name are patched too (see :func:`_swap`); functions held
    elsewhere (default arguments, class attributes, ``functools.partial``)
    are not.

    Args:
        mode: ``"sync"``: each save is durable when the call returns.
            ``"snapshot"``: a save to a path returns once the state is copied
            into host memory; the write goes on in the background (module
            docstring; docs/patch.md). ``"pipelined"`` is refused: the caller
            is library code that changes the tensors right after saving.
        safetensors: also patch safetensors' functions (when it is installed).
        alignment: where safetensors files' data starts: 8 (the library's
            exact bytes, what hashing tools such as the Hub's deduplication
            expect) or a multiple of 8 such as 4096 (O_DIRECT-aligned
            payloads; costs in docs/patch.md).
        **settings: ``fastpersist.config`` settings for every patched call
            (``fsync=False``, ``verify=False``, ``async_max_pending=2``, ...).

    Raises:
        ValueError: an unknown ``mode``, or an ``alignment`` that is not a positive multiple of 8.
        TypeError: an unknown setting name. ConfigError: an invalid setting value.
    """
    if mode not in MODES:
        raise ValueError(
            f"fastpersist.patch(mode={mode!r}): expected one of {MODES}. 'pipelined' needs a caller that leaves "
            "the tensors alone until the save is done, which code calling torch.save does not promise"
        )
    if alignment <= 0 or alignment % 8:
        raise ValueError(f"alignment must be a positive multiple of 8, got {alignment}")
    overrides, _ = config.split_overrides("patch", settings, allow_other=False)
    config.resolve(overrides)  # invalid values raise now, not in the middle of a library's save
    options = _Options(mode, bool(safetensors), alignment, dict(overrides))
    if safetensors and importlib.util.find_spec("safetensors") is not None:
        importlib.import_module("safetensors.torch")  # now, so that later imports find the wrappers
    with _lock:
        _stack.append(options)
        try:
            _reconcile()
        except BaseException:
            _stack.remove(options)
            raise
    return Restorer(options)
