"""``python -m fastpersist.bench safetensors``: safetensors files, fastpersist against the safetensors library.

One run, on the same real-shaped state dict (random bf16, Llama-shaped layers):

* **durable save** (file and directory fsynced): ``fastpersist.save_file``
  against ``safetensors.torch.save_file`` + fsync, and against the storage
  ceiling: one O_DIRECT write of the same number of bytes from a locked
  buffer by the native engine (fallocate, write, fsync);
* **cold load** (page cache dropped before every load; as root the whole
  cache, otherwise the file's pages with ``posix_fadvise``; CPU results are
  touched, one byte a page, inside the timing, since safetensors maps the
  file and reads it on first touch):
  ``fastpersist.load_file(device=...)`` (of the library's file, and of its
  own) against
  ``safetensors.torch.load_file(device=...)``, and the read ceiling (one
  O_DIRECT read of the file into a locked buffer).

Methods are interleaved repeat by repeat (the disk's speed drifts); medians are
reported, with ratios against the baselines of the same run. Every saved file
is loaded back by the other library, and every load is compared with the
original tensors, before any figure is reported.

::

    python -m fastpersist.bench safetensors --device cuda --size 4G --dir /mnt/disk --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from fastpersist import config, system
from fastpersist.bench import measure
from fastpersist.tuning import workloads

__all__ = ["build_parser", "main", "run"]

SCHEMA = "fastpersist.bench.safetensors/1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastpersist.bench safetensors", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="where the state lives and loads go: cpu or cuda[:N] (default cpu)")
    p.add_argument("--size", default="4G", help="state size, e.g. 4G (decimal) or 2GiB (default 4G)")
    p.add_argument("--model", default="llama-3.2-1b", choices=workloads.model_names(), help="layer shapes to use")
    p.add_argument("--dir", default=None, help="directory for the files (default: a new one under the cwd)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per method; medians reported (default 3)")
    p.add_argument("--json", default=None, help="write the result document here")
    p.add_argument("--no-drop-caches", action="store_true", help="warm loads (do not drop the page cache)")
    p.add_argument("--skip", nargs="*", default=[], help="methods to leave out (see the result's method names)")
    return p


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _equal(loaded: dict[str, torch.Tensor], original: dict[str, torch.Tensor], device: torch.device) -> str | None:
    if set(loaded) != set(original):
        return f"names differ: {sorted(set(loaded) ^ set(original))[:5]}"
    for name, tensor in original.items():
        other = loaded[name]
        if other.device.type != device.type:
            return f"{name} loaded on {other.device}, expected {device}"
        if (
            other.dtype != tensor.dtype
            or other.shape != tensor.shape
            or not torch.equal(other.to(tensor.device), tensor)
        ):
            return f"{name} differs"
    return None


def _touch(result: Any) -> None:
    """Reads one byte of every page of CPU results: safetensors maps the file and reads it only on first touch."""
    if not isinstance(result, dict):
        return
    from fastpersist.tensors import cast_to_byte_tensor

    for tensor in result.values():
        if tensor.device.type == "cpu" and tensor.numel():
            cast_to_byte_tensor(tensor)[::4096].sum()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import safetensors.torch as library

    import fastpersist
    from fastpersist.api import safetensors as ours
    from fastpersist.io import engine, memory

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    size = config.parse_size(args.size)
    spec = workloads.get_model(args.model)
    layers = workloads.layers_for_size(spec, size, torch.bfloat16)
    state = workloads.build_state(spec, dtype=torch.bfloat16, device=device, layers=layers)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    directory = args.dir or tempfile.mkdtemp(prefix="fastpersist-bench-safetensors-", dir=".")
    os.makedirs(directory, exist_ok=True)
    ours_path = os.path.join(directory, "fastpersist.api.safetensors")
    theirs_path = os.path.join(directory, "library.safetensors")
    raw_path = os.path.join(directory, "ceiling.bin")
    torch_path = os.path.join(directory, "fastpersist-torch.pt")
    dropper = system.CacheDropper(enabled=not args.no_drop_caches)
    settings = ours._settings("bench", {})
    raw_size = -(-nbytes // 4096) * 4096

    def ceiling_write() -> None:
        measure.remove_path(raw_path)
        with engine.File(raw_path, "w", direct=True, truncate=True) as f:
            if f.direct:
                f.allocate(0, raw_size)
            handle.submit_write(raw_buffer.data_ptr(), raw_size, f, 0, keepalive=raw_buffer)
            handle.wait()
            f.fsync()
        from fastpersist.io.commit import fsync_directory

        fsync_directory(directory)

    def ceiling_read() -> None:
        with engine.File(raw_path, "r", direct=True) as f:
            handle.submit_read(raw_buffer.data_ptr(), raw_size, f, 0, keepalive=raw_buffer)
            handle.wait()

    def library_save() -> None:
        library.save_file(state, theirs_path)
        measure.fsync_paths(theirs_path)  # the file and its directory entry

    saves: dict[str, tuple[str, Callable[[], None]]] = {
        "ceiling": ("O_DIRECT write of the same bytes (engine) + fsync", ceiling_write),
        "fastpersist": ("fastpersist.save_file (durable)", lambda: ours.save_file(state, ours_path)),
        "safetensors": ("safetensors.torch.save_file + fsync", library_save),
        "fastpersist-torch": (
            "fastpersist.save of the same dict, torch format, no CRC (context)",
            lambda: fastpersist.save(state, torch_path, checksum=False),
        ),
    }
    loads: dict[str, tuple[str, Callable[[], Any], str]] = {
        "ceiling": ("O_DIRECT read of the file (engine)", ceiling_read, raw_path),
        "fastpersist": (
            f"fastpersist.load_file(device={str(device)!r}) of the library's file",
            lambda: ours.load_file(theirs_path, device=device),
            theirs_path,
        ),
        "fastpersist-own": (
            f"fastpersist.load_file(device={str(device)!r}) of its own (4 KiB-aligned) file",
            lambda: ours.load_file(ours_path, device=device),
            ours_path,
        ),
        "safetensors": (
            f"safetensors.torch.load_file(device={str(device)!r})",
            lambda: library.load_file(ours_path, device=str(device)),
            ours_path,
        ),
    }
    saves = {k: v for k, v in saves.items() if k not in args.skip}
    loads = {k: v for k, v in loads.items() if k not in args.skip}
    times: dict[str, dict[str, list[float]]] = {"save": {k: [] for k in saves}, "load": {k: [] for k in loads}}
    peaks: dict[str, list[int]] = {k: [] for k in saves}
    problems: list[str] = []
    handle = engine.make_handle(settings)
    ours.save_file({"warm-up": torch.ones(1, device=device)}, ours_path)  # allocates the ring once, as in training
    with memory.lease_buffers(1, raw_size) as (raw_buffer,):
        raw_buffer.fill_(7)  # touched once: the ceiling never pays page faults
        for repeat in range(args.repeats):
            for name, (_, action) in saves.items():
                _sync_device(device)
                system.release_memory()
                with measure.PeakMemory() as peak:
                    start = time.perf_counter()
                    action()
                    elapsed = time.perf_counter() - start
                times["save"][name].append(elapsed)
                peaks[name].append(peak.delta)
            if repeat == 0:
                # Each library reads the other's file (loads below do too, timed).
                for path, reader in ((ours_path, library.load_file), (theirs_path, ours.load_file)):
                    if os.path.exists(path):
                        problem = _equal(reader(path), {k: v.cpu() for k, v in state.items()}, torch.device("cpu"))
                        if problem:
                            problems.append(f"{os.path.basename(path)} read back by the other library: {problem}")
            for name, (_, action, path) in loads.items():
                if not os.path.exists(path):
                    problems.append(f"load {name}: {path} missing (its save was skipped)")
                    continue
                dropper.drop([path])
                system.release_memory()
                _sync_device(device)
                start = time.perf_counter()
                result = action()
                _touch(result)
                _sync_device(device)
                times["load"][name].append(time.perf_counter() - start)
                if result is not None and repeat == 0:
                    problem = _equal(result, state, device)
                    if problem:
                        problems.append(f"load {name}: {problem}")
                del result
    for path in (ours_path, theirs_path, raw_path, torch_path):
        measure.remove_path(path)
    if args.dir is None:
        os.rmdir(directory)

    def summary(kind: str, name: str, label: str) -> dict[str, Any]:
        samples = times[kind][name]
        median = statistics.median(samples)
        entry = {"label": label, "seconds": samples, "median_s": median, "gb_per_s": nbytes / median / 1e9}
        if kind == "save":
            entry["peak_extra_rss_bytes"] = max(peaks[name])
        return entry

    result: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": measure.machine_info(directory if os.path.isdir(directory) else ".", str(device)),
        "config": {
            "device": str(device),
            "bytes": nbytes,
            "tensors": len(state),
            "model": args.model,
            "layers": layers,
            "dtype": "bf16",
            "repeats": args.repeats,
            "directory": directory,
            "cache": dropper.detail,
            "engine": engine.resolve_engine(settings.engine),
        },
        "save": {name: summary("save", name, label) for name, (label, _) in saves.items() if times["save"][name]},
        "load": {name: summary("load", name, label) for name, (label, _, _) in loads.items() if times["load"][name]},
        "problems": problems,
    }
    ratios = {}
    for kind in ("save", "load"):
        section = result[kind]
        if "fastpersist" in section:
            for baseline in ("ceiling", "safetensors"):
                if baseline in section:
                    ratios[f"{kind}: fastpersist / {baseline}"] = round(
                        section["fastpersist"]["gb_per_s"] / section[baseline]["gb_per_s"], 3
                    )
    if "fastpersist-own" in result["load"] and "safetensors" in result["load"]:
        ratios["load: fastpersist-own / safetensors"] = round(
            result["load"]["fastpersist-own"]["gb_per_s"] / result["load"]["safetensors"]["gb_per_s"], 3
        )
    result["ratios"] = ratios
    return result


def to_markdown(result: dict[str, Any]) -> str:
    """The result as Markdown: one row per method and operation, then the ratios."""
    config = result["config"]
    lines = [
        f"{workloads.format_bytes(config['bytes'])} bf16 in {config['tensors']} tensors on {config['device']}, "
        f"{config['repeats']} repeats, engine {config['engine']}; {config['cache']}",
        "",
        "| operation | method | GB/s (median) | peak extra RSS |",
        "| --- | --- | ---: | ---: |",
    ]
    for kind in ("save", "load"):
        for _name, entry in result[kind].items():
            rss = entry.get("peak_extra_rss_bytes")
            lines.append(
                f"| {kind} | {entry['label']} | {entry['gb_per_s']:.2f} | "
                f"{workloads.format_bytes(rss) if rss is not None else '-'} |"
            )
    lines.append("")
    lines += [f"- {name}: {ratio:.2f}x" for name, ratio in result["ratios"].items()]
    lines += [f"- PROBLEM: {problem}" for problem in result["problems"]]
    return "\n".join(lines) + "\n"


def _print(result: dict[str, Any]) -> None:
    config = result["config"]
    print(
        f"{workloads.format_bytes(config['bytes'])} in {config['tensors']} tensors on {config['device']}, "
        f"{config['repeats']} repeats, engine {config['engine']}; {config['cache']}"
    )
    for kind in ("save", "load"):
        for name, entry in result[kind].items():
            extra = ""
            if "peak_extra_rss_bytes" in entry:
                extra = f"  peak extra RSS {workloads.format_bytes(entry['peak_extra_rss_bytes'])}"
            print(f"  {kind:4} {name:12} {entry['gb_per_s']:6.2f} GB/s  ({entry['label']}){extra}")
    for name, ratio in result["ratios"].items():
        print(f"  {name}: {ratio:.2f}x")
    for problem in result["problems"]:
        print(f"  PROBLEM: {problem}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import numpy  # noqa: F401  (safetensors.torch.save_file goes through numpy)
        import safetensors.torch  # noqa: F401
    except ImportError as e:
        print(f"the baseline needs safetensors and numpy: {e}", file=sys.stderr)
        return 2
    result = run(args)
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result["problems"] else 0
