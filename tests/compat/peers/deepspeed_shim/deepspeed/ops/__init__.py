"""``deepspeed.ops`` shim: every op the DeepNVMe tests ask about is provided by fastpersist."""

from deepspeed.ops import op_builder  # noqa: F401

__compatible_ops__ = {"async_io": True, "pin_memory": True, "utils": True}
