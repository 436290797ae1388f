"""fastpersist: torch.save / torch.load at the speed of the storage.

    import fastpersist
    fastpersist.save(model.state_dict(), "ckpt.pt")       # durable, atomic, torch.load-compatible
    state = fastpersist.load("ckpt.pt", map_location="cuda")
    future = fastpersist.async_save(state, "ckpt.pt")     # overlaps the next training step
    future.result()
    with fastpersist.patch():                              # torch.save/torch.load/safetensors inside any library
        trainer.train()

See docs/ for the architecture, configuration, file format and reliability.
"""

from fastpersist import config, errors
from fastpersist._version import __version__
from fastpersist.api import SaveFuture, VerifyReport, async_save, load, save, verify
from fastpersist.api.checkpointer import Checkpointer
from fastpersist.api.futures import pending_saves, release_buffers, wait_all
from fastpersist.api.patching import patch, patch_stats
from fastpersist.api.safetensors import load_file, safe_open, save_file
from fastpersist.deepnvme.gds import GdsHandle
from fastpersist.deepnvme.handle import AioHandle
from fastpersist.errors import (
    ChecksumMismatchError,
    ConfigError,
    CorruptCheckpointError,
    CudaUnavailableError,
    CufileError,
    DistributedCheckpointError,
    EngineUnavailableError,
    FastPersistError,
    GdsUnavailableError,
    TensorModifiedError,
    UnsupportedObjectError,
)
from fastpersist.io.memory import free_cpu_locked_tensor, new_cpu_locked_tensor
from fastpersist.tensors import cast_to_byte_tensor

__all__ = [
    "__version__",
    "save",
    "load",
    "async_save",
    "SaveFuture",
    "verify",
    "VerifyReport",
    "AioHandle",
    "GdsHandle",
    "new_cpu_locked_tensor",
    "free_cpu_locked_tensor",
    "cast_to_byte_tensor",
    "release_buffers",
    "config",
    "errors",
    "FastPersistError",
    "ConfigError",
    "EngineUnavailableError",
    "CudaUnavailableError",
    "GdsUnavailableError",
    "CufileError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "UnsupportedObjectError",
    "save_file",
    "load_file",
    "safe_open",
    "DistributedCheckpointError",
    "TensorModifiedError",
    "wait_all",
    "pending_saves",
    "Checkpointer",
    "patch",
    "patch_stats",
]
