"""``deepspeed.ops.op_builder`` shim: DeepSpeed's builders mapped to fastpersist's look-alikes."""

from fastpersist.deepnvme import AsyncIOBuilder, GDSBuilder, PinMemoryBuilder, UtilsBuilder

__all__ = ["AsyncIOBuilder", "GDSBuilder", "PinMemoryBuilder", "UtilsBuilder"]
