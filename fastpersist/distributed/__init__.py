"""Data-parallel sharded save and load across the ranks of a ``torch.distributed`` group.

Every rank holds the same (replicated, DDP) state; each writes a disjoint,
aligned slice of one checkpoint's bytes from its own copy. Ranks exchange
only metadata (sizes, CRC-32s, status), never tensor data, during a save.
See docs/distributed.md.

Modules: :mod:`.sharding` (the pure split), :mod:`.coordinator` (metadata
exchange with timeouts), :mod:`.save` (which combines the ranks' CRC-32s
with ``fastpersist.io.checksum.crc32_combine_all``), :mod:`.replicas`,
:mod:`.manifest`, :mod:`.load`, :mod:`.verify`, :mod:`.objectstore`
(``s3://`` targets).
"""
