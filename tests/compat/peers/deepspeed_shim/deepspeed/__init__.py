"""Shim of the ``deepspeed`` package for DeepSpeed's DeepNVMe tests (see ../README.md).

``deepspeed.io`` (FastFileWriter, pure Python) comes from the DeepSpeed
checkout named by ``FASTPERSIST_DEEPSPEED_PATH``; everything else is here.
"""

import os

_checkout = os.environ.get("FASTPERSIST_DEEPSPEED_PATH")
if _checkout:
    _peer_package = os.path.join(_checkout, "deepspeed")
    if os.path.isdir(os.path.join(_peer_package, "io")):
        __path__.append(_peer_package)

from deepspeed import ops

__version__ = "0.0.0+fastpersist-shim"
__all__ = ["ops"]
