#!/usr/bin/env python3
"""Measures what ``fastpersist.patch()``'s safetensors alignment costs: the library's exact bytes (alignment 8)
against O_DIRECT-aligned payloads (4096), with the safetensors library as the baseline, in one run.

    python tools/measure_safetensors_alignment.py --dir /path/on/the/disk [--size-mb 1024] [--rounds 5]

Every method runs once per round, in a seeded random order per round; each
round's saves create new files (the previous round's are deleted first, not
within the clock), timed to durable (the library's ``save_file`` is followed by an fsync of
the file, fastpersist's fsyncs itself); loads read a file whose pages were
evicted from the page cache first (``posix_fadvise(DONTNEED)`` after an
fsync, so only that file leaves the cache), and each file is read once,
untimed, before the round's loads (see ``_first_read``). The first round checks every
loaded tensor against the saved one. Every load reads one byte of each page
of the tensors it returns within the clock (the library maps the file and
reads on first touch). Prints medians (and min-max) in seconds
and GB/s (10^9 bytes of tensor data per second) as a Markdown table, with the
machine. The figures in docs/patch.md come from this script.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import subprocess
import time

import torch

import fastpersist


def state(size_mb: int) -> dict[str, torch.Tensor]:
    """About ``size_mb`` MB of Llama-shaped bf16 tensors (large matrices, small norms)."""
    generator = torch.Generator().manual_seed(0)
    tensors, total, layer = {}, 0, 0
    while total < size_mb * 1e6:
        for name, shape in (("q", (2048, 2048)), ("k", (512, 2048)), ("mlp", (5632, 2048)), ("norm", (2048,))):
            tensor = torch.randn(shape, generator=generator).to(torch.bfloat16)
            tensors[f"layers.{layer}.{name}"] = tensor
            total += tensor.numel() * tensor.element_size()
        layer += 1
    return tensors


def evict(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def touched(tensors: dict) -> dict:
    """``tensors`` after reading one byte of every page: a lazily mapped load (the library's mmap backend)
    reads the file here, within the clock, as an eager one has already."""
    for tensor in tensors.values():
        if tensor.numel():
            tensor.reshape(-1).view(torch.uint8)[::4096].sum()
    return tensors


def library_save(tensors: dict, path: str) -> None:
    import safetensors.torch

    safetensors.torch.save_file(tensors, path)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # durable, as fastpersist's save is when it returns
    finally:
        os.close(descriptor)


def _paths(directory: str) -> dict[int, str]:
    return {a: os.path.join(directory, f"a{a}.safetensors") for a in (8, 4096)}


def _first_read(path: str) -> None:
    """Reads a just-written file once, untimed: on the virtual disk of the development machine the first read
    of freshly written blocks took 0.5-3.2 s for the same 1 GB, whatever read it; later reads are steadier. A
    checkpoint is loaded long after it was written."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def methods(directory: str, tensors: dict) -> dict:
    """name -> (prepare, timed call); each load reads the file its alignment's save wrote."""
    import safetensors.torch

    paths = _paths(directory)
    library = os.path.join(directory, "library.safetensors")
    return {
        "save: safetensors library (+ fsync)": (None, lambda: library_save(tensors, library)),
        "save: fastpersist, alignment=8 (patch default)": (
            None,
            lambda: fastpersist.save_file(tensors, paths[8], alignment=8),
        ),
        "save: fastpersist, alignment=4096": (
            None,
            lambda: fastpersist.save_file(tensors, paths[4096], alignment=4096),
        ),
        "load: safetensors library, alignment=8 file": (
            lambda: evict(paths[8]),
            lambda: touched(safetensors.torch.load_file(paths[8])),
        ),
        "load: fastpersist, alignment=8 file": (
            lambda: evict(paths[8]),
            lambda: touched(fastpersist.load_file(paths[8])),
        ),
        "load: fastpersist, alignment=4096 file": (
            lambda: evict(paths[4096]),
            lambda: touched(fastpersist.load_file(paths[4096])),
        ),
    }


def measure(directory: str, size_mb: int, rounds: int) -> tuple[dict[str, list[float]], int]:
    tensors = state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    table = methods(directory, tensors)
    times: dict[str, list[float]] = {name: [] for name in table}
    order = list(table)
    for number in range(rounds):
        for name in os.listdir(directory):  # the saves create files (freeing a replaced 1 GB file is not timed)
            if name.endswith(".safetensors"):
                os.unlink(os.path.join(directory, name))
        os.sync()
        random.Random(number).shuffle(order)
        order.sort(key=lambda name: name.startswith("load"))  # a round's loads read its own saves
        loads_began = False
        for name in order:
            if name.startswith("load") and not loads_began:
                loads_began = True
                os.sync()  # nothing of the saves is still being written back
                for path in {p for p in _paths(directory).values() if os.path.exists(p)}:
                    _first_read(path)
            prepare, call = table[name]
            if prepare is not None:
                prepare()
            began = time.perf_counter()
            result = call()
            times[name].append(time.perf_counter() - began)
            if number == 0 and result is not None:
                assert all(torch.equal(result[k], v) for k, v in tensors.items()), name
            del result
    return times, nbytes


def machine(directory: str) -> str:
    filesystem = subprocess.run(["stat", "-f", "-c", "%T", directory], capture_output=True, text=True).stdout.strip()
    return (
        f"{datetime.date.today().isoformat()}, {platform.node()}: {os.cpu_count()} CPUs, "
        f"{platform.platform()}, {filesystem} at {directory}, torch {torch.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a directory on the storage to measure")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times, nbytes = measure(args.dir, args.size_mb, args.rounds)
    print(f"{machine(args.dir)}; {nbytes / 1e9:.2f} GB of bf16 tensors, median of {args.rounds} rounds (min-max)\n")
    print("| method | seconds | GB/s |")
    print("| --- | ---: | ---: |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} ({min(values):.3f}-{max(values):.3f}) | {nbytes / median / 1e9:.2f} |")
    for name in os.listdir(args.dir):
        if name.endswith(".safetensors"):
            os.unlink(os.path.join(args.dir, name))


if __name__ == "__main__":
    main()
