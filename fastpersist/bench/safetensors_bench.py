"""``python -m fastpersist.bench safetensors``: safetensors files, fastpersist against the safetensors library.

Durable saves and cold loads of one real-shaped bf16 state dict, interleaved per repeat: fastpersist, the library
and the engine's O_DIRECT ceiling of as many bytes. Every file is read back by the other library and every load
compared with the original; see docs/safetensors.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from typing import Any

import torch

from fastpersist import config, system
from fastpersist.bench import bounds, harness, measure
from fastpersist.bench.harness import Benchmark, Rounds, markdown_table, option, timed
from fastpersist.tuning import workloads

__all__ = ["BENCHMARK", "SCHEMA", "main", "to_markdown"]

SCHEMA = "fastpersist.bench.safetensors/1"
_RATIOS = (("fastpersist", "ceiling"), ("fastpersist", "safetensors"), ("fastpersist-own", "safetensors"))


def _options(p: argparse.ArgumentParser) -> None:
    option(p, "device", help="where the state lives and loads go: cpu or cuda[:N] (default cpu)")
    option(p, "size", type=str, default="4G", help="state size, e.g. 4G or 2GiB (binary units; default 4G)")
    p.add_argument("--model", default="llama-3.2-1b", choices=workloads.model_names(), help="layer shapes to use")
    option(p, "dir", help="directory for the files (default: a new one under the cwd)")
    option(p, "repeats", help="repeats per method; medians reported (default 3)")
    option(p, "no_drop_caches")
    p.add_argument("--skip", nargs="*", default=[], help="methods to leave out (see the result's method names)")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import safetensors.torch as library

    import fastpersist
    from fastpersist.api import safetensors as ours
    from fastpersist.io import engine, memory

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    spec = workloads.get_model(args.model)
    layers = workloads.layers_for_size(spec, config.parse_size(args.size), torch.bfloat16)
    state = workloads.build_state(spec, dtype=torch.bfloat16, device=device, layers=layers)
    expected = workloads.flatten_state(state)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    directory = args.dir or tempfile.mkdtemp(prefix="fastpersist-bench-safetensors-", dir=".")
    os.makedirs(directory, exist_ok=True)
    names = ("fastpersist.api.safetensors", "library.safetensors", "ceiling.bin", "fastpersist-torch.pt")
    paths = ours_path, theirs_path, raw_path, torch_path = [os.path.join(directory, name) for name in names]
    dropper = system.CacheDropper(enabled=not args.no_drop_caches)
    settings = ours._settings("bench", {})
    raw_size = -(-nbytes // 4096) * 4096
    handle = engine.make_handle(settings)

    def ceiling_write() -> None:
        measure.remove_path(raw_path)
        bounds.engine_write(raw_path, raw_buffer, raw_size, handle, allocate=True)
        measure.fsync_paths(raw_path)  # its directory entry too, as the saves' is

    def ceiling_read(path: str) -> None:
        bounds.engine_read(path, raw_buffer, raw_size, handle)

    def library_save() -> None:
        library.save_file(state, theirs_path)
        measure.fsync_paths(theirs_path)  # the file and its directory entry

    where, load_ours = str(device), functools.partial(ours.load_file, device=device)
    load_theirs = functools.partial(library.load_file, device=where)
    save_torch = functools.partial(fastpersist.save, state, torch_path, checksum=False)
    saves = {
        "ceiling": ("O_DIRECT write of the same bytes (engine) + fsync", ceiling_write),
        "fastpersist": ("fastpersist.save_file (durable)", lambda: ours.save_file(state, ours_path)),
        "safetensors": ("safetensors.torch.save_file + fsync", library_save),
        "fastpersist-torch": ("fastpersist.save of the same dict, torch format, no CRC (context)", save_torch),
    }
    own = f"fastpersist.load_file(device={where!r}) of its own (4 KiB-aligned) file"
    loads = {  # name: (label, the file it reads, its load of a path)
        "ceiling": ("O_DIRECT read of the file (engine)", raw_path, ceiling_read),
        "fastpersist": (f"fastpersist.load_file(device={where!r}) of the library's file", theirs_path, load_ours),
        "fastpersist-own": (own, ours_path, load_ours),
        "safetensors": (f"safetensors.torch.load_file(device={where!r})", ours_path, load_theirs),
    }
    saves, loads = ({k: v for k, v in methods.items() if k not in args.skip} for methods in (saves, loads))
    problems: list[str] = []
    # Each library reads the other's file in the first round (the loads below do too, timed).
    cross = {"fastpersist": (library.load_file, ours_path), "safetensors": (ours.load_file, theirs_path)}

    def save(name: str, index: int) -> dict[str, Any]:
        system.release_memory()
        stats = timed(saves[name][1], device, memory=True)[1]
        if index == 0 and name in cross:
            reader, path = cross[name]
            harness.check(expected, reader(path), problems, f"{os.path.basename(path)} read back by the other library")
        return stats

    def load(name: str, index: int) -> dict[str, Any] | None:
        system.release_memory()
        _, path, action = loads[name]
        if not os.path.exists(path):
            problems.append(f"load {name}: {path} missing (its save was skipped)")
            return None
        dropper.drop([path])
        loaded, stats = timed(lambda: action(path), device, touch=True)
        if loaded is not None and index == 0:
            harness.check(expected, loaded, problems, f"load {name}", device)
        return stats

    ours.save_file({"warm-up": torch.ones(1, device=device)}, ours_path)  # allocates the ring once, as in training
    raw_buffer = memory.aligned_empty(raw_size, lock=True).fill_(7)  # touched once: the ceiling never pays page faults
    rounds = Rounds(args.repeats, catch=False).run_ops(saves, loads, save, load)
    for path in paths:
        measure.remove_path(path)
    if args.dir is None:
        os.rmdir(directory)
    run = {"device": str(device), "bytes": nbytes, "tensors": len(state), "model": args.model, "layers": layers}
    run.update(dtype="bf16", repeats=args.repeats, directory=directory, cache=dropper.detail)
    run["engine"] = engine.resolve_engine(settings.engine)
    machine = measure.machine_info(directory if os.path.isdir(directory) else ".", str(device))
    result = {"schema": SCHEMA, "machine": machine, "config": run, "save": _section(rounds, "save", saves, nbytes)}
    result.update(load=_section(rounds, "load", loads, nbytes), problems=problems)
    pairs = [(kind, *pair) for kind in ("save", "load") for pair in _RATIOS]  # those with both figures
    result["ratios"] = harness.ratios(pairs, lambda kind, name: result[kind].get(name, {}).get("gb_per_s"))
    return result


def _section(rounds: Rounds, kind: str, methods: dict[str, tuple], nbytes: int) -> dict[str, Any]:
    out = {}
    for name, (label, *_) in methods.items():
        if samples := rounds.samples.get((kind, name)):
            median = rounds.median((kind, name), "seconds")
            out[name] = {"label": label, "seconds": [s["seconds"] for s in samples], "median_s": median}
            out[name]["gb_per_s"] = nbytes / median / 1e9
            if kind == "save":
                out[name]["peak_extra_rss_bytes"] = max(s["peak_rss_delta"] for s in samples)
    return out


def to_markdown(result: dict[str, Any]) -> str:
    config = result["config"]
    rows = [
        [kind, entry["label"], f"{entry['gb_per_s']:.2f}"]
        + [workloads.format_bytes(entry["peak_extra_rss_bytes"]) if "peak_extra_rss_bytes" in entry else "-"]
        for kind in ("save", "load")
        for entry in result[kind].values()
    ]
    lines = [
        f"{workloads.format_bytes(config['bytes'])} bf16 in {config['tensors']} tensors on {config['device']}, "
        f"{config['repeats']} repeats, engine {config['engine']}; {config['cache']}",
        "",
        *markdown_table(["operation", "method", "GB/s (median)", "peak extra RSS"], "<<>>", rows),
        "",
        *(f"- {name}: {ratio:.2f}x" for name, ratio in result["ratios"].items()),
        *(f"- PROBLEM: {problem}" for problem in result["problems"]),
    ]
    return "\n".join(lines) + "\n"


BENCHMARK = Benchmark(
    "safetensors",
    _options,
    _measure,
    to_markdown,
    description=__doc__.splitlines()[0],
    schema=SCHEMA,
    requires=("numpy", "safetensors"),
    status=lambda result: 1 if result["problems"] else 0,
)
main = BENCHMARK.main
