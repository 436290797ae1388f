"""pytest plugin: Lightning's default TorchCheckpointIO saves, loads and removes through fastpersist.

Loaded by run_lightning_checkpoint_io_tests.py with ``-p``; every Trainer and
Fabric that uses the default CheckpointIO (and AsyncCheckpointIO, which wraps
it) then goes through FastPersistCheckpointIO's methods.
"""

from lightning.fabric.plugins.io import torch_io
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from fastpersist.integrations.lightning import for_package

_ours = for_package("lightning").FastPersistCheckpointIO
torch_io.TorchCheckpointIO.settings = {}
# Every method and attribute FastPersistCheckpointIO adds to CheckpointIO (save, load, remove, teardown and
# what they use), but not __init__: the class keeps its identity, which Lightning's tests check.
for _klass in reversed(_ours.__mro__[: _ours.__mro__.index(CheckpointIO)]):
    for _name, _value in vars(_klass).items():
        if not _name.startswith("__"):
            setattr(torch_io.TorchCheckpointIO, _name, _value)
