"""fastpersist as the storage layer of ``torch.distributed.checkpoint`` (DCP).

:class:`FastPersistWriter` and :class:`FastPersistReader` implement DCP's
``StorageWriter`` / ``StorageReader``; the checkpoints are
``FileSystemWriter``-compatible directories (see docs/dcp.md)::

    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import FastPersistReader, FastPersistWriter

    dcp.save(state_dict, storage_writer=FastPersistWriter("/ckpt/step-100"))
    dcp.load(state_dict, storage_reader=FastPersistReader("/ckpt/step-100"))
"""

from fastpersist.dcp.reader import FastPersistReader
from fastpersist.dcp.writer import FastPersistWriter

__all__ = ["FastPersistReader", "FastPersistWriter"]
