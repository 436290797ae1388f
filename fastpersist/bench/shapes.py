"""Checkpoint shapes users hit, against torch and an independent ceiling, in one run.

``python -m fastpersist.bench shapes --shape many-small --tensors 20000 --tensor-bytes 16-256`` (or ``checkpoint
--shape ...``): fastpersist's saves and loads against torch's, fio's write (``--fio``), the pipelines without
storage (``--sink``: into ``/dev/null``, from ``/dev/zero``) and, unless ``--no-ceiling``, each one's bound
(:mod:`fastpersist.bench.bounds`), measured in the same rounds.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import fastpersist
from fastpersist import config, system
from fastpersist.bench import bounds, measure
from fastpersist.bench.harness import Benchmark, Rounds, UsageError, figure, markdown_table, option, timed
from fastpersist.config import parse_size
from fastpersist.format.deserializer import archive_prefix, deserialize
from fastpersist.format.serializer import plan_save
from fastpersist.format.zipformat import read_directory
from fastpersist.io import engine, targets, timeline
from fastpersist.io.reader import FileStorageProvider
from fastpersist.tuning import workloads
from fastpersist.tuning.workloads import format_bytes

__all__ = ["BENCHMARK", "SHAPES", "build_shape", "main", "markdown", "sink_save"]

SHAPES = ("many-small", "many-medium", "huge", "mixed")
_FILES = ("fastpersist.pt", "torch.pt", "fio.bin", "zeros.pt")
_VERIFIED = {True: "verified", False: "unverified"}
_FIO = "fio-write (ceiling)"
_WRITE, _READ = "ceiling: write", "ceiling: read"
_TO_HOST, _TO_HOST_CRC = "ceiling: copy to host", "ceiling: copy to host + CRC-32"
_TO_DEVICE, _TO_DEVICE_CRC = "ceiling: copy to device", "ceiling: copy to device + CRC-32"
_WAITS = ("read", "slot", "crc", "copy", "other")  # where a load's calling thread spends its time (see markdown)


def _tensor_sizes(text: str) -> list[int]:
    """``64`` -> [64]; ``16-256`` -> the powers of two between (the sizes a many-small state cycles through)."""
    if "-" not in str(text):
        return [parse_size(text)]
    size, high = (parse_size(part) for part in str(text).split("-", 1))
    sizes = []
    while size <= high:
        sizes.append(size)
        size *= 2
    return sizes


def build_shape(
    shape: str, tensors: int | None, tensor_bytes: str | None, size: int, device: str, zeros: bool = False
) -> Any:
    """The state to save for ``shape`` (all zeros for the sink load): ``many-small``, ``--tensor-bytes`` each;
    ``many-medium``, ``--tensors`` equal ones totalling ``--size``; ``huge``, one tensor (above 4 GiB: zip64);
    ``mixed``, 1,000+ parameters and optimizer state with Python scalars, half on the GPU with CUDA."""
    cuda = device.startswith("cuda")

    def make(nbytes: int, dtype: torch.dtype = torch.float32, on: str = device) -> torch.Tensor:
        tensor = torch.empty(max(nbytes // dtype.itemsize, 0), dtype=dtype, device=on)
        return tensor.zero_() if zeros else tensor.uniform_(-1, 1)

    if shape == "many-small":
        sizes = _tensor_sizes(tensor_bytes or "16-256")
        return {f"layer.{i}.param": make(sizes[i % len(sizes)]) for i in range(tensors or 20_000)}
    if shape == "many-medium":
        count = tensors or 120
        each = parse_size(tensor_bytes) if tensor_bytes else max(size // count, 1)
        return {f"layers.{i}.weight": make(each, torch.bfloat16) for i in range(count)}
    if shape == "huge":
        return {"embedding.weight": make(size, torch.bfloat16)}
    if shape != "mixed":
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    # An LLM-like model: per block 4 attention + 3 MLP matrices, 2 norms and biases; about --size in all.
    blocks = max((tensors or 1_100) // 11, 1)
    big = max(size // (blocks * 7 * 3), 256)  # weights + two Adam moments
    model = {}
    for b in range(blocks):
        for name in ("q", "k", "v", "o", "up", "gate", "down"):
            model[f"blocks.{b}.{name}.weight"] = make(big, torch.bfloat16)
        for name in ("attn_norm", "mlp_norm"):
            model[f"blocks.{b}.{name}.weight"] = make(8192, torch.bfloat16, "cpu")
        model[f"blocks.{b}.bias"] = make(4096, torch.float32, "cpu")
        model[f"blocks.{b}.scale"] = make(4, torch.float32, "cpu")
    for index, (name, tensor) in enumerate(model.items()):
        if cuda and index % 2:
            model[name] = tensor.to(device)  # mixed CPU/GPU state
        elif not cuda:
            model[name] = tensor.cpu()
    optimizer_state = {}
    for index, tensor in enumerate(model.values()):
        if tensor.numel() >= 1024:
            second = torch.zeros_like(tensor) if zeros else tensor.abs()
            optimizer_state[index] = {"step": 1000 + index, "exp_avg": torch.zeros_like(tensor), "exp_avg_sq": second}
    group = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, params=list(range(len(model))))
    optimizer = {"state": optimizer_state, "param_groups": [group]}
    return {"model": model, "optimizer": optimizer, "epoch": 3, "global_step": 123_456, "loss": 2.25}


def _tensors_of(state: Any) -> list[torch.Tensor]:
    return list(workloads.flatten_state(state)[0].values())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _torch_save(state: Any, path: str) -> None:
    torch.save(state, path)
    measure.fsync_paths(path)  # the file and its directory entry


def sink_save(state: Any, settings: config.Settings) -> int:
    """The real save pipeline (plan, ring, copies, CRC-32, engine) writing into /dev/null; returns its bytes."""
    plan = plan_save(state, "sink")
    targets.Sink().commit_plan(plan, settings)
    for device in plan.devices():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return plan.layout.central_directory_offset


def _sink_load(path: str, settings: config.Settings, device: str, verify: bool) -> Any:
    """The real load pipeline reading every storage from /dev/zero (the file's state is all zeros)."""
    with open(path, "rb") as handle:
        fd = handle.fileno()
        records = {r.name: r for r in read_directory(lambda o, n: os.pread(fd, n, o), os.fstat(fd).st_size)}
        prefix = archive_prefix(list(records), path)
        pickle_bytes = os.pread(fd, records[prefix + "data.pkl"].size, records[prefix + "data.pkl"].data_offset)
    zero = engine.File("/dev/zero", "r", direct=False)
    storages = [r for n, r in records.items() if n.startswith(prefix + "data/")]
    provider = FileStorageProvider(zero, storages, settings, verify=verify, path="/dev/zero")
    try:
        loaded = deserialize(pickle_bytes, records, prefix, provider, map_location=device, weights_only=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return loaded
    finally:
        provider.close()
        zero.close()


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=SHAPES, help="the state's shape (required to measure)")
    p.add_argument("--tensors", type=int, default=None, help="number of tensors (parameters for mixed)")
    p.add_argument("--tensor-bytes", default=None, help="bytes per tensor, or a range like 16-256")
    option(p, "size", type=str, default="1G", help="total bytes for many-medium / mixed, tensor bytes for huge")
    option(p, "device", help="where the state lives and loads go (cpu, cuda)")
    option(p, "dir", help="where files go (default: a temporary directory on disk)")
    option(p, "repeats")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--sink", action="store_true", help="also run the pipelines without storage (labelled sink)")
    p.add_argument("--sink-only", action="store_true", help="only the sink pipelines (no storage at all)")
    p.add_argument("--fio", action="store_true", help="also give fio's write of the same bytes a row of its own")
    p.add_argument("--no-ceiling", action="store_true", help="do not measure the bounds (see the module docstring)")
    p.add_argument("--no-torch", action="store_true", help="leave the torch baselines out")
    p.add_argument("--no-loads", action="store_true")
    p.add_argument("--loads", default="all", help="comma list of load variants to run (default all)")
    option(p, "no_drop_caches")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="fastpersist setting")


def _methods(
    args: argparse.Namespace, state: Any, nbytes: int, settings: config.Settings, overrides: dict, directory: str
):
    """The saves (name -> (kind, call)) and loads (name -> (kind, call, the file it reads)) the options ask for."""
    ours, theirs, fio, zeros = (os.path.join(directory, name) for name in _FILES)
    storage, sink = not args.sink_only, args.sink or args.sink_only
    saves: dict[str, tuple[str, Callable[[], Any]]] = {}
    loads: dict[str, tuple[str, Callable[[], Any], str]] = {}
    if storage:
        saves["fastpersist"] = ("storage", lambda: fastpersist.save(state, ours, **overrides))
        if not args.no_torch:
            saves["torch.save"] = ("storage", lambda: _torch_save(state, theirs))
        if args.fio and system.find_fio():
            saves[_FIO] = ("storage", lambda: bounds.fio_write_seconds(fio, nbytes))
        if not args.no_ceiling:
            saves[_WRITE] = ("ceiling", lambda: bounds.write_ceiling(directory, nbytes, repeats=1)["best_s"])
    copies = None  # the copy bounds of the sink pipelines, one ring for both directions
    if sink:
        if not args.no_ceiling:
            copies = bounds.CopyCeiling(_tensors_of(state), settings.buffer_size, settings.buffer_count)
        saves["fastpersist-sink"] = ("sink", lambda: sink_save(state, settings))
        if copies is not None:
            saves[_TO_HOST] = ("ceiling", lambda: copies.to_host(crc=False))
            if settings.checksum:
                saves[_TO_HOST_CRC] = ("ceiling", lambda: copies.to_host(crc=True))
    if not args.no_loads and storage:
        for verify, weights_only in itertools.product((True, False), repeat=2):
            load = functools.partial(
                fastpersist.load, ours, map_location=args.device, verify=verify, weights_only=weights_only, **overrides
            )
            loads[f"fastpersist {_VERIFIED[verify]} wo={weights_only}"] = ("storage", load, ours)
        for weights_only in () if args.no_torch else (True, False):
            load = functools.partial(torch.load, theirs, map_location=args.device, weights_only=weights_only)
            loads[f"torch.load wo={weights_only}"] = ("storage", load, theirs)
        if not args.no_ceiling:
            loads[_READ] = ("ceiling", lambda: bounds.read_ceiling(ours), ours)
    if not args.no_loads and sink:
        fastpersist.save(
            build_shape(args.shape, args.tensors, args.tensor_bytes, parse_size(args.size), "cpu", True), zeros
        )
        for verify in (True, False):
            load = functools.partial(_sink_load, zeros, settings, args.device, verify)
            loads[f"fastpersist-sink-load {_VERIFIED[verify]}"] = ("sink", load, zeros)
        if copies is not None:
            loads[_TO_DEVICE] = ("ceiling", lambda: copies.to_device(crc=False), zeros)
            loads[_TO_DEVICE_CRC] = ("ceiling", lambda: copies.to_device(crc=True), zeros)
    if args.loads != "all":
        wanted = [w.strip() for w in args.loads.split(",")]
        # The bounds stay: they are what the chosen loads are compared with.
        loads = {k: v for k, v in loads.items() if v[0] == "ceiling" or any(w in k for w in wanted)}
    return saves, loads, {"fastpersist": ours, "torch.save": theirs, _FIO: fio}


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.shape is None:
        raise UsageError("the following arguments are required: --shape")
    loadavg_start = list(os.getloadavg())
    overrides = dict(item.split("=", 1) for item in args.set)
    settings = config.resolve(overrides)
    state = build_shape(args.shape, args.tensors, args.tensor_bytes, parse_size(args.size), args.device)
    nbytes = workloads.state_nbytes(state)
    directory = measure.scratch_dir(args.dir, "fastpersist-shapes-")
    dropper = system.CacheDropper(enabled=not args.no_drop_caches)
    saves, loads, previous = _methods(args, state, nbytes, settings, overrides, directory)

    def save(name: str, index: int) -> dict[str, Any]:
        system.release_memory()
        if name in previous and os.path.exists(previous[name]):
            # Every save writes a fresh file: the previous one is deleted untimed, and the clock starts once the
            # blocks it freed are given back (on a disk mounted with discard, freeing 4 GB takes ~0.5 s).
            os.unlink(previous[name])
            measure.fsync_paths(directory)
            os.sync()
            time.sleep(1.0)
        reported, sample = timed(saves[name][1], args.device, memory=True)
        if name == _FIO or saves[name][0] == "ceiling":
            sample["seconds"] = reported  # their own clocks (fio's runtime without its start-up)
        if index == 0 and name == "fastpersist":
            if not _same(state, fastpersist.load(previous[name], weights_only=False)):
                raise RuntimeError("fastpersist round trip differs from the saved state")
        return sample

    def load(name: str, index: int) -> dict[str, Any]:
        system.release_memory()
        dropper.drop([loads[name][2]])
        with timeline.recording() as events:
            loaded, sample = timed(loads[name][1], args.device, memory=True)
        if loads[name][0] == "ceiling":
            sample["seconds"], loaded = loaded, None  # its own clock
        elif index == 0 and "sink" not in name and not _same(state, loaded):
            raise RuntimeError(f"{name}: the loaded state differs from the saved one")
        del loaded
        waits = timeline.waits(events, threading.current_thread().name)
        return dict(sample, waits={**waits, "other": sample["seconds"] - sum(waits.values())} if waits else None)

    # Rotated each round: the first load after a free pays the fresh page faults.
    rounds = Rounds(args.repeats, warmup=args.warmup, order="rotate", catch=False)
    try:
        rounds.run_ops(saves, loads, save, load)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "benchmark": "shapes",
        "shape": args.shape,
        "tensors": len(_tensors_of(state)),
        "state_bytes": nbytes,
        "device": args.device,
        "settings": settings.as_dict(),
        "overrides": overrides,
        "cache": dropper.detail,
        "files": "every timed save (fio's too) writes a fresh file: the previous one is deleted, then 1 s passes "
        "before the clock starts",
        "loadavg_start": loadavg_start,
        "code": measure.code_version(),
        "machine": measure.machine_info(args.dir or tempfile.gettempdir(), args.device),
        "results": _results(rounds, {**saves, **loads}, nbytes, settings.checksum),
        "note": "kind=sink: the pipeline without storage (save into /dev/null, load from /dev/zero); stores nothing",
    }


def _results(rounds: Rounds, methods: dict[str, tuple], nbytes: int, checksum: bool) -> list[dict[str, Any]]:
    """A row per method (``methods``: name -> (kind, ...)): its times, next to torch's, fio's and its bound's."""
    results = []
    for (op, name), samples in rounds.samples.items():
        if not samples:
            continue
        values = [s["seconds"] for s in samples]
        median = statistics.median(values)
        result = {"method": name, "op": op, "kind": methods[name][0], "seconds": values, "median_s": median}
        result["gbps"] = nbytes / median / 1e9 if median else None
        result["peak_rss_delta"] = max([0] + [s["peak_rss_delta"] for s in samples])
        result["cpu_seconds_median"] = statistics.median(s["cpu_seconds"] for s in samples)
        waited = [s["waits"] for s in samples if s.get("waits")]
        if waited:
            result["caller_waits_s"] = {label: statistics.median(w.get(label, 0.0) for w in waited) for label in _WAITS}
        results.append(result)
    by_method = {r["method"]: r for r in results}  # the names of saves and loads differ
    for result in results:
        save, kind = result["op"] == "save", result["kind"]
        baseline = (
            "torch.save" if save else "torch.load wo=False" if "wo=False" in result["method"] else "torch.load wo=True"
        )
        # The ceiling row that bounds the result; the ceilings themselves have none.
        bound = {"storage": _WRITE if save else _READ, "sink": _TO_HOST_CRC if checksum else _TO_HOST}.get(kind)
        if kind == "sink" and not save:
            bound = _TO_DEVICE if "unverified" in result["method"] else _TO_DEVICE_CRC
        base, fio, bound = (by_method.get(m) for m in (baseline, _FIO, bound))
        result["speedup_vs_torch"] = base["median_s"] / result["median_s"] if base and result["median_s"] else None
        if save and fio and result["median_s"]:
            result["fraction_of_fio"] = fio["median_s"] / result["median_s"]
        if bound is not None and result["median_s"]:
            result.update(
                bound=bound["method"], bound_s=bound["median_s"], of_bound=bound["median_s"] / result["median_s"]
            )
    return results


def markdown(doc: dict[str, Any]) -> str:
    """A Markdown table of one result document (what docs/benchmarks.md shows)."""
    machine, results = doc.get("machine", {}), doc["results"]
    lines = [
        f"{doc['shape']}: {doc['tensors']} tensors, {format_bytes(doc['state_bytes'])}, device {doc['device']}; "
        f"{len(results[0]['seconds'])} timed rounds, medians; {machine.get('cpu_count', '?')} CPUs "
        f"({machine.get('device_name', '')}), 1-min load average {doc.get('loadavg_start', ['?'])[0]:.1f} at the start, "
        f"{(machine.get('loadavg') or [0])[0]:.1f} at the end",
        "",
    ]
    bounded = any("of_bound" in r for r in results)  # documents from before the bounds have none
    ratios = {"x torch": "speedup_vs_torch", "of bound": "of_bound", "x fio": "fraction_of_fio"}
    if not bounded:
        del ratios["of bound"]
    header = ["op", "method", "kind", "median s", "GB/s", *ratios, "peak RSS growth", "CPU s"]
    rows = []
    for r in results:
        gbps = figure(r["gbps"] if (r.get("gbps") or 0) >= 0.01 else None)
        rss = format_bytes(r["peak_rss_delta"]) if r.get("peak_rss_delta") is not None else "-"
        cells = [figure(r.get(key) or None) for key in ratios.values()]  # none (or 0): a dash
        cells += [rss, figure(r.get("cpu_seconds_median"))]
        rows.append([r["op"], r["method"], r["kind"], f"{r['median_s']:.3f}", gbps, *cells])
    lines += markdown_table(header, "<<<" + ">" * (len(header) - 3), rows)
    if bounded:
        pairs = {}
        for r in results:
            if r.get("bound"):
                verified = next((f" ({w})" for w in ("verified", "unverified") if f" {w}" in r["method"]), "")
                label = f"{r['kind']} {r['op']}s" + (verified if r["kind"] == "sink" and r["op"] == "load" else "")
                pairs[label] = r["bound"]
        bounds_text = "; ".join(f"{label} `{bound}`" for label, bound in pairs.items())
        lines += ["", f"of bound: the bound's time / the method's; bounds: {bounds_text}"]
    waiting = [r for r in results if r.get("caller_waits_s")]  # documents from before 8555fbf have none
    if waiting:
        caption = (
            "Where each load's calling thread spends its time, medians in seconds: waiting for reads, for a ring "
            "slot's refill (its copies and CRC-32s), for the last CRC-32s and device copies, and the rest (parsing, "
            "unpickling, allocating, submitting); `-`: not recorded by that run's code:"
        )
        table = [[r["method"], *(figure(r["caller_waits_s"].get(label), ".3f") for label in _WAITS)] for r in waiting]
        lines += ["", caption, "", *markdown_table(["load", *_WAITS], "<" + ">" * len(_WAITS), table)]
    return "\n".join(lines)


BENCHMARK = Benchmark("shapes", _options, _measure, markdown, description=__doc__.split("\n\n")[0], report="--markdown")
main = BENCHMARK.main
