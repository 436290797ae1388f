"""DeepNVMe's API on fastpersist: the ``aio_handle`` look-alike and DeepSpeed's op-builder look-alikes.

::

    # from deepspeed.ops.op_builder import AsyncIOBuilder
    from fastpersist.deepnvme import AsyncIOBuilder

    h = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=32)

:mod:`.handle` holds :class:`AioHandle`; :mod:`.builder` the builders. Nothing
in save and load depends on this package: it sits beside them, on
:mod:`fastpersist.io`.
"""

from fastpersist.deepnvme.builder import AsyncIOBuilder, PinHandle, PinMemoryBuilder, UtilsBuilder
from fastpersist.deepnvme.handle import AioHandle

__all__ = ["AioHandle", "AsyncIOBuilder", "PinHandle", "PinMemoryBuilder", "UtilsBuilder"]
