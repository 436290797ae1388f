"""Ceilings: what the storage can do with no format at all, the upper bounds the other methods are compared with."""

from __future__ import annotations

import os

import torch

from fastpersist.bench import measure, models
from fastpersist.bench.methods.base import (
    LoadMethod,
    SaveMethod,
    fastpersist_api,
    register,
)
from fastpersist.tensors import host_memoryview

__all__ = ["RawWrite", "EngineCeilingWrite", "EngineCeilingRead"]


class RawWrite(SaveMethod):
    """All tensor bytes in one file with os.write + fsync: no format at all; an upper bound for buffered writes."""

    name = "os.write"
    label = "raw os.write of all bytes + fsync (ceiling)"
    extension = ".bin"
    default = False

    def save(self, state, path, ctx):
        tensors, _ = models.flatten_state(state)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors.values():
                data = t.detach().reshape(-1).view(torch.uint8)
                if data.device.type != "cpu":
                    data = data.cpu()
                view = host_memoryview(data.contiguous())
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        return {}

    def read_back(self, path, state, ctx):
        tensors, _ = models.flatten_state(state)
        out: dict[str, torch.Tensor] = {}
        with open(path, "rb") as f:
            for key, t in tensors.items():
                raw = bytearray(f.read(t.numel() * t.element_size()))
                flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                out[key] = flat.view(t.dtype).reshape(t.shape).to(ctx.device)
            if f.read(1):
                raise ValueError("raw file is longer than the state")
        return out

    def flat(self, loaded):
        return dict(loaded), None


# ---------------------------------------------------------------------------- engine ceiling


_CEILING_CHUNK = 64 << 20


def _ceiling_pattern() -> torch.Tensor:
    """A page-locked chunk of random bytes that the ceiling methods write over and over."""
    global _PATTERN
    if _PATTERN is None:
        from fastpersist.io import memory

        _PATTERN = memory.new_cpu_locked_tensor(_CEILING_CHUNK)
        _PATTERN.copy_(torch.randint(0, 256, (_CEILING_CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    return _PATTERN


_PATTERN: torch.Tensor | None = None


class EngineCeilingWrite(SaveMethod):
    """The storage ceiling: the same number of bytes, written by fastpersist's engine with
    O_DIRECT from page-locked memory, no format, no copies, no checksums (fallocate + fsync
    like a save). Its file is not a checkpoint: read-back checks the written pattern."""

    name = "engine-write"
    label = "engine raw O_DIRECT write (ceiling)"
    extension = ".raw"

    def unavailable(self, ctx):
        return fastpersist_api()[1]

    def save(self, state, path, ctx):
        from fastpersist import config
        from fastpersist.io import engine

        total = models.state_nbytes(state)
        pattern = _ceiling_pattern()
        settings = config.resolve(ctx.fastpersist_overrides)
        file = engine.File(path, "w", direct=settings.direct, truncate=True)
        try:
            file.allocate(0, max(total, 1))
            # As many writes in flight, each on its own handle, as a save keeps ring slots.
            handles = [engine.make_handle(settings) for _ in range(settings.buffer_count)]
            for index, offset in enumerate(range(0, total, _CEILING_CHUNK)):
                handle = handles[index % len(handles)]
                handle.wait()
                handle.submit_write(pattern.data_ptr(), min(_CEILING_CHUNK, total - offset), file, offset, pattern)
            for handle in handles:
                handle.wait()
            file.fsync()
        finally:
            file.close()
        return {}

    def read_back(self, path, state, ctx):
        _check_pattern_file(path, models.state_nbytes(state))
        return state

    def cleanup(self, path):
        measure.remove_path(path)


def _check_pattern_file(path: str, total: int) -> None:
    pattern = _ceiling_pattern()
    if os.path.getsize(path) != total:
        raise ValueError(f"ceiling file has {os.path.getsize(path)} bytes, expected {total}")
    with open(path, "rb") as f:
        for offset in range(0, total, _CEILING_CHUNK):
            data = f.read(min(_CEILING_CHUNK, total - offset))
            if not torch.equal(torch.frombuffer(bytearray(data), dtype=torch.uint8), pattern[: len(data)]):
                raise ValueError(f"ceiling file differs from the pattern near offset {offset}")


class EngineCeilingRead(LoadMethod):
    """The read ceiling: the ceiling file read cold with O_DIRECT into page-locked memory."""

    name = "engine-read"
    label = "engine raw O_DIRECT read (ceiling)"
    source = "engine-write"

    def unavailable(self, ctx):
        return fastpersist_api()[1]

    def load(self, path, state, ctx):
        from fastpersist import config
        from fastpersist.io import engine, memory

        total = models.state_nbytes(state)
        settings = config.resolve(ctx.fastpersist_overrides)
        count = settings.buffer_count
        with memory.lease_buffers(count, _CEILING_CHUNK) as buffers:
            handles = [engine.make_handle(settings) for _ in buffers]
            file = engine.File(path, "r", direct=settings.direct)
            try:
                for index, offset in enumerate(range(0, total, _CEILING_CHUNK)):
                    slot = index % count
                    handles[slot].wait()
                    handles[slot].submit_read(buffers[slot].data_ptr(), min(_CEILING_CHUNK, total - offset), file,
                                              offset, buffers[slot])  # fmt: skip
                for handle in handles:
                    handle.wait()
            finally:
                file.close()
        return state


for _method in (RawWrite(), EngineCeilingWrite(), EngineCeilingRead()):
    register(_method)
