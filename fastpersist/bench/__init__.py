"""Benchmarks: ``python -m fastpersist.bench <subcommand> [options]``.

A subcommand is a module declaring one :class:`fastpersist.bench.harness.Benchmark`, imported when it runs.
"""

from __future__ import annotations

__all__ = ["SUBCOMMANDS", "listing"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {  # name -> (module with BENCHMARK and main(argv), what it measures)
    "io": ("fastpersist.bench.io", "sequential write/read throughput of the I/O engine, optionally against fio"),
    "checkpoint": ("fastpersist.bench.checkpoint", "save/load a real-shaped checkpoint with every method"),
    "aio_handle": ("fastpersist.bench.aio_handle", "AioHandle tensor I/O: CPU locked, CUDA ring vs whole bounce"),
    "gds": ("fastpersist.bench.gds", "GdsHandle cufile and bounce paths vs AioHandle + copy vs raw O_DIRECT (CUDA)"),
    "report": ("fastpersist.bench.report", "Markdown of results; --update-docs regenerates the docs' tables"),
    "shapes": ("fastpersist.bench.shapes", "many-small / many-medium / huge / mixed states vs torch, fio and a sink"),
    "safetensors": ("fastpersist.bench.safetensors_bench", "safetensors files: fastpersist vs the safetensors library"),
    "dcp": ("fastpersist.bench.dcp", "dcp.save/load: FileSystemWriter/Reader vs FastPersistWriter/Reader"),
    "ranks": ("fastpersist.bench.ranks", "data-parallel sharded save (group=...) against the number of ranks"),
    "training": ("fastpersist.bench.training", "overhead of checkpointing every iteration of a training loop"),
    "stages": ("fastpersist.bench.stages", "a CUDA load's ring stage by stage: read, + CRC-32, + copy, against pread"),
    "offload": ("fastpersist.bench.offload", "generation with a Llama-shaped model streamed from disk or host memory"),
    "trainer": (
        "fastpersist.bench.trainer",
        "Hugging Face Trainer checkpoints: unpatched, + fsync, patch(), async patch",
    ),
    "pace": ("fastpersist.bench.pace", "every storage-pace target ratio of one GPU in one run (training, disk, load)"),
    "s3": ("fastpersist.bench.s3", "save/load to an S3-compatible store (moto by default): fastpersist vs boto3, s3fs"),
}


def listing() -> str:
    """Every subcommand and what it measures, a line each: what both helps print."""
    width = max(map(len, SUBCOMMANDS), default=0)
    return "\n".join(f"  {name:<{width}}  {description}".rstrip() for name, (_, description) in SUBCOMMANDS.items())
