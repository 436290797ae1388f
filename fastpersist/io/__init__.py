"""fastpersist's I/O layer.

``engine`` is the only module that imports the compiled core
(``fastpersist._native``); ``memory`` manages aligned and page-locked host
memory. DeepNVMe's ``aio_handle`` API over the engine lives in
``fastpersist.deepnvme``. Submodules are imported explicitly (``from
fastpersist.io import engine``) so that importing this package stays cheap.
"""

__all__ = ["engine", "memory"]
