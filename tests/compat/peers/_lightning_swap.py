"""pytest plugin: Lightning's default TorchCheckpointIO saves, loads and removes through fastpersist.

Loaded by run_lightning_checkpoint_io_tests.py with ``-p``; every Trainer and
Fabric that uses the default CheckpointIO (and AsyncCheckpointIO, which wraps
it) then goes through FastPersistCheckpointIO's methods.
"""

from lightning.fabric.plugins.io import torch_io

from fastpersist.integrations.lightning import for_package

_ours = for_package("lightning").FastPersistCheckpointIO
torch_io.TorchCheckpointIO.settings = {}
torch_io.TorchCheckpointIO.save_checkpoint = _ours.save_checkpoint
torch_io.TorchCheckpointIO.load_checkpoint = _ours.load_checkpoint
torch_io.TorchCheckpointIO.remove_checkpoint = _ours.remove_checkpoint
