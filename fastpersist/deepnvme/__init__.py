"""DeepNVMe's API on fastpersist: the ``aio_handle`` and ``gds_handle`` look-alikes and DeepSpeed's op builders.

::

    # from deepspeed.ops.op_builder import AsyncIOBuilder
    from fastpersist.deepnvme import AsyncIOBuilder

    h = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=32)
    g = GDSBuilder().load().gds_handle(block_size=1 << 20, queue_depth=32)  # CUDA tensors

:mod:`.handle` holds :class:`AioHandle`; :mod:`.gds` :class:`GdsHandle` (its
optional cuFile binding is :mod:`.cufile`, loaded only when a handle needs it);
:mod:`.builder` the builders. Nothing
in save and load depends on this package: it sits beside them, on
:mod:`fastpersist.io`.
"""

from fastpersist.deepnvme.builder import AsyncIOBuilder, GDSBuilder, PinHandle, PinMemoryBuilder, UtilsBuilder
from fastpersist.deepnvme.gds import GdsHandle
from fastpersist.deepnvme.handle import AioHandle

__all__ = ["AioHandle", "AsyncIOBuilder", "GDSBuilder", "GdsHandle", "PinHandle", "PinMemoryBuilder", "UtilsBuilder"]
