"""fastpersist's I/O layer.

``engine`` is the only module that imports the compiled core
(``fastpersist._native``); ``memory`` manages aligned and page-locked host
memory. DeepNVMe's ``aio_handle`` API over the engine lives in
``fastpersist.deepnvme``; ``targets`` decides where a checkpoint's bytes go
and come from (a local file, an object store, any fsspec filesystem, a file
object, a sink). Submodules are imported explicitly (``from
fastpersist.io import engine``) so that importing this package stays cheap.
"""

__all__ = ["engine", "memory"]
