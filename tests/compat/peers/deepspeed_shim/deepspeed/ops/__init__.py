"""``deepspeed.ops`` shim: every op the DeepNVMe tests ask about is provided by fastpersist.

``gds`` (``GDSBuilder.NAME``, the key DeepSpeed's ``test_gds.py`` looks up) is
compatible where torch sees a CUDA device, as ``GDSBuilder().is_compatible()``
says: without one the test module skips itself, as it does on DeepSpeed.
"""

from deepspeed.ops import op_builder  # noqa: F401
from deepspeed.ops.op_builder import GDSBuilder

__compatible_ops__ = {
    "async_io": True,
    "pin_memory": True,
    "utils": True,
    GDSBuilder.NAME: GDSBuilder().is_compatible(),
}
