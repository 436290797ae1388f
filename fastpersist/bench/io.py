"""``python -m fastpersist.bench io``: sequential engine throughput, optionally against fio.

Like DeepSpeed's ``ds_io``: ``--size`` bytes written to a fresh file (preallocated outside the clock unless
``--no-fallocate``, timed to fsync), read back cold and verified outside the clock; median GB/s (10^9 bytes/s).
ds_io command lines work with the program name replaced (docs/deepnvme-parity.md), printing ds_io's lines too::

    fastpersist bench io --folder /local_nvme --io_size 400M --read --block_size 1M --queue_depth 32 --loops 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from typing import Any

import torch

from fastpersist import display, system
from fastpersist.bench import bounds, measure
from fastpersist.bench.harness import Benchmark, Rounds, UsageError, option, size, timed
from fastpersist.deepnvme.gds import GdsHandle
from fastpersist.io import engine, memory

__all__ = ["BENCHMARK", "UsageError", "apply_ds_io", "build_parser", "ds_io_summary", "main"]

DS_IO_ENGINES = ("aio_handle", "aio_basic", "torch_io", "torch_fastio")  # the first two: the fastpersist engine


def _options(p: argparse.ArgumentParser) -> None:
    option(p, "dir", help="directory for the test file (default: current directory)")
    option(p, "size", help="bytes per file, e.g. 4G (default 1G)")
    p.add_argument("--block-size", "--block_size", type=size, help="bytes per request (default 16M; ds_io: 1M)")
    p.add_argument("--queue-depth", "--queue_depth", type=int, default=32, help="requests in flight per lane")
    p.add_argument("--threads", "--io_parallel", type=int, help="lanes, i.e. intra_op_parallelism (default 1)")
    engines = ("auto", "io_uring", "threads", *DS_IO_ENGINES)
    p.add_argument("--engine", default="auto", choices=engines, help="ds_io's aio_handle and aio_basic mean auto")
    p.add_argument("--buffered", action="store_true", help="no O_DIRECT (both tools)")
    p.add_argument("--single-submit", "--single_submit", action="store_true", help="one io_uring_enter per request")
    overlap = "submit and reap in batches (overlap_events=False)"
    p.add_argument("--no-overlap-events", "--sequential_requests", action="store_true", help=overlap)
    p.add_argument("--no-fallocate", action="store_true", help="do not preallocate the file (both tools)")
    p.add_argument("--no-huge-pages", action="store_true", help="engine buffers on 4 KiB pages (fio's default memory)")
    option(p, "repeats", "--repeats", "--loops", help="repeats; the median is reported (default 3)")
    p.add_argument("--mode", choices=("both", "write", "read"), help="default both (ds_io: write)")
    p.add_argument("--fio", action="store_true", help="also run fio (ioengine=io_uring) with the same settings")
    p.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte check of each read")

    ds = p.add_argument_group("DeepSpeed ds_io", "ds_io's options with ds_io's meaning (and some listed above)")
    ds.add_argument("--folder", help="folder for the test file (= --dir)")
    mapping = "one FOLDER:DEVICE (the CUDA device used with --gpu)"
    ds.add_argument("--folder_to_device_mapping", default=[], nargs="+", metavar="FOLDER:DEVICE", help=mapping)
    ds.add_argument("--io_size", type=size, help="bytes to read or write, e.g. 400M (= --size)")
    ds.add_argument("--read", action="store_true", help="read instead of write (= --mode read)")
    ds.add_argument("--validate", action="store_true", help="check the bytes of every read and write")
    ds.add_argument("--handle", action="store_true", help="accepted: I/O always goes through one handle")
    ds.add_argument("--gpu", action="store_true", help="the data lives on a CUDA device (pinned bounce buffer)")
    ds.add_argument("--use_gds", action="store_true", help="with --gpu: move the device tensor with GdsHandle")
    paths = ("auto", "cufile", "bounce")
    ds.add_argument("--gds_path", "--gds-path", choices=paths, help="GdsHandle's data path (default: the setting)")
    ds.add_argument("--multi_process", type=int, default=1, help="only 1 is supported")
    ds.add_argument("--warmup_loops", type=int, default=0, help="untimed repetitions before the timed ones")
    pinned = "accepted: host buffers are always locked (pinned)"
    ds.add_argument("--use_accelerator_pin_memory", action="store_true", help=pinned)
    ds.add_argument("--slow_bounce_buffer", action="store_true", help="not supported")
    ds.add_argument("--torch_legacy_save", action="store_true", help="only for --engine torch_fastio (not supported)")
    ds.add_argument("--fast_io_size", help="only for --engine torch_fastio (not supported)")


def apply_ds_io(args: argparse.Namespace) -> argparse.Namespace:
    """Maps ds_io's options onto this benchmark's in place and fills the defaults (``device``: ``cpu`` or
    ``cuda:N``; ``ds_io``: whether a ds_io-only target or size option is named); UsageError where it cannot."""
    ds_io = args.ds_io = bool(args.folder or args.folder_to_device_mapping or args.io_size is not None)
    torch_engine = (
        f"--engine {args.engine} (torch.save through DeepSpeed) is not provided; use --engine aio_handle here, "
        "and 'python -m fastpersist.bench checkpoint' to compare torch.save with fastpersist.save"
    )
    mapping = args.folder_to_device_mapping
    for refused, message in (  # the first that applies is the usage error
        (args.use_gds and not args.gpu, "--use_gds moves a CUDA tensor: add --gpu (as ds_io requires)"),
        (args.gds_path is not None and not args.use_gds, "--gds_path applies to --use_gds only"),
        (args.engine in ("torch_io", "torch_fastio"), torch_engine),
        (
            args.torch_legacy_save or args.fast_io_size is not None,
            "--torch_legacy_save and --fast_io_size only apply to ds_io's --engine torch_fastio",
        ),
        (
            args.slow_bounce_buffer,
            "--slow_bounce_buffer is not supported: the pinned bounce buffer is allocated once, outside the timing",
        ),
        (args.multi_process != 1, "--multi_process: only 1 process is supported; run one command per process"),
        (args.folder and mapping, "--folder and --folder_to_device_mapping cannot be specified together"),
        (
            len(mapping) > 1,
            "--folder_to_device_mapping with several FOLDER:DEVICE (one process each) is not supported; "
            "run one command per folder",
        ),
    ):
        if refused:
            raise UsageError(message)
    if args.engine in ("aio_handle", "aio_basic"):
        args.engine = "auto"
    device_index = 0
    if mapping:
        folder, sep, device = mapping[0].rpartition(":")
        if not sep or not folder or not device.isdigit():
            raise UsageError(f"--folder_to_device_mapping takes FOLDER:DEVICE, got {mapping[0]!r}")
        args.folder, device_index = folder, int(device)
    if args.folder and args.dir is not None and os.path.abspath(args.dir) != os.path.abspath(args.folder):
        raise UsageError("--dir and --folder name the same thing; give one")
    args.dir = args.folder or ("." if args.dir is None else args.dir)
    if not os.path.isdir(args.dir):
        raise UsageError(f"folder {args.dir} does not exist")
    if args.io_size is not None and args.size not in (None, args.io_size):
        raise UsageError("--size and --io_size name the same thing; give one")
    args.size = args.size if args.io_size is None else args.io_size
    for name, default in {"size": 1 << 30, "block_size": (1 if ds_io else 16) << 20, "threads": 1}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.read and args.mode not in (None, "read"):
        raise UsageError(f"--read contradicts --mode {args.mode}")
    args.mode = "read" if args.read else args.mode or ("write" if ds_io else "both")
    if args.validate and args.no_verify:
        raise UsageError("--validate contradicts --no-verify")
    if args.warmup_loops < 0 or args.repeats < 1:
        raise UsageError("--loops must be at least 1 and --warmup_loops at least 0")
    args.device = "cpu"
    if args.gpu:
        if not torch.cuda.is_available():
            raise UsageError(
                "--gpu needs a CUDA device and torch with CUDA; none is available here "
                "(drop --gpu to measure host memory <-> storage)"
            )
        if device_index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise UsageError(f"--folder_to_device_mapping names CUDA device {device_index}; this machine has {count}")
        if args.fio:
            raise UsageError("--fio measures host memory only; drop --fio or --gpu")
        args.device = f"cuda:{device_index}"
    return args


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    apply_ds_io(args)
    direct, size, fallocate = not args.buffered, args.size, not args.no_fallocate
    if size % 4096 or args.block_size % 4096:
        raise UsageError("--size and --block-size must be multiples of 4096")
    use_fio = args.fio and system.find_fio() is not None
    if args.fio and not use_fio:
        print(f"{system.FIO_INSTALL_HINT}; running the engine only", file=sys.stderr)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.init()  # before allocating: locked host buffers are then registered with CUDA (pinned)
    knobs = dict(block_size=args.block_size, queue_depth=args.queue_depth, single_submit=args.single_submit)
    knobs.update(overlap_events=not args.no_overlap_events, intra_op_parallelism=args.threads, engine=args.engine)
    gds = GdsHandle(**knobs, path=args.gds_path, direct=direct) if args.use_gds else None
    handle = engine.IoHandle(**knobs, direct=direct)
    probe = engine.probe_directory(args.dir)
    do_write, do_read = args.mode in ("both", "write"), args.mode in ("both", "read")
    verify_reads = args.validate or not args.no_verify
    # Random bytes (nothing a deduplicating or compressing backend could exploit), written once: this also
    # touches every page outside the timing (page faults on fresh memory are far slower than the disk here).
    source = memory.aligned_empty(size, huge_pages=not args.no_huge_pages, lock=on_gpu)
    generator = torch.Generator().manual_seed(0)
    words = source.view(torch.int64)  # size is a multiple of 4096
    for start in range(0, words.numel(), 32 << 20):
        words[start : start + (32 << 20)].random_(generator=generator)
    # --gpu: the data lives on the device; source and destination are the pinned bounce buffers.
    destination = None
    if do_read and gds is None:  # GdsHandle reads straight into the device tensor
        destination = memory.aligned_empty(size, huge_pages=not args.no_huge_pages, lock=on_gpu).fill_(0)
    device_source = source.to(device) if on_gpu and do_write else None
    device_destination = torch.zeros(size, dtype=torch.uint8, device=device) if on_gpu and do_read else None
    expected = source.clone() if on_gpu and (do_write or verify_reads) else source
    workdir = measure.scratch_dir(args.dir, ".fastpersist-bench-")
    path, fio_path = os.path.join(workdir, "engine.bin"), os.path.join(workdir, "fio.bin")

    def write() -> None:  # durable, into a file preallocated outside the clock unless --no-fallocate
        if gds is not None:
            gds.sync_pwrite(device_source, path)
            bounds.fsync_file(path)
            return
        if device_source is not None:
            source.copy_(device_source)  # to the pinned bounce buffer (synchronous)
        bounds.engine_write(path, source, size, handle, direct=direct)

    def read() -> None:
        if gds is not None:
            gds.sync_pread(device_destination, path)
            return
        bounds.engine_read(path, destination, size, handle, direct=direct)
        if device_destination is not None:
            device_destination.copy_(destination)

    def run(tool: str, index: int) -> dict[str, float]:
        if tool == "fio":
            return _fio_round(args, fio_path, do_write, do_read) if index >= args.warmup_loops else {}
        sample = {}
        if do_write:
            if fallocate:
                bounds.preallocate(path, size, direct)
            elif os.path.exists(path):
                os.unlink(path)
            sample["write_s"] = timed(write, device)[1]["seconds"]
            problem = bounds.file_problem(path, expected) if args.validate else None
            if problem:
                raise RuntimeError(f"write verification failed: {problem}")
        if do_read:
            if not direct:  # cold: its cached pages dropped first
                system.CacheDropper().drop([path])
            sample["read_s"] = timed(read, device)[1]["seconds"]
            if verify_reads:
                got = device_destination.cpu() if device_destination is not None else destination
                if not torch.equal(got, expected):
                    raise RuntimeError("read-back verification failed: bytes read differ from bytes written")
                for buffer in [b for b in (destination, device_destination) if b is not None]:
                    buffer.zero_()
        if do_write:
            os.unlink(path)
        return {**sample, **{op: size / 1e9 / sample[f"{op}_s"] for op in ("write", "read") if f"{op}_s" in sample}}

    try:
        if not do_write:  # read only: lay the file down once
            if fallocate:
                bounds.preallocate(path, size, direct)
            bounds.engine_write(path, expected, size, handle, direct=direct)
        # Who goes first alternates: this disk is fastest right after an idle period and slows under writing.
        tools = ["engine", "fio"] if use_fio else ["engine"]
        rounds = Rounds(args.repeats, warmup=args.warmup_loops, order="reverse", catch=False).run([tools], run)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _document(args, handle, gds, probe, rounds)


def _fio_round(args: argparse.Namespace, path: str, do_write: bool, do_read: bool) -> dict[str, float]:
    """fio's GB/s of a round, one sequential job with the engine's settings (read only: the file written once)."""

    def fio(rw: str) -> float:
        if rw == "read" and args.buffered:
            system.CacheDropper().drop([path])
        options = dict(direct=not args.buffered, threads=args.threads, fallocate=not args.no_fallocate, verify=False)
        command = bounds.fio_command(path, rw, args.size, args.block_size, args.queue_depth, **options)
        return bounds.run_fio(command, rw) / 1e9

    sample = {}
    if do_write or not os.path.exists(path):
        measure.remove_path(path)
        rate = fio("write")
        if do_write:
            sample["write"] = rate
    if do_read:
        sample["read"] = fio("read")
    if do_write:
        os.unlink(path)
    return sample


def _document(args: argparse.Namespace, handle: Any, gds: Any, probe: dict[str, Any], rounds: Rounds) -> dict[str, Any]:
    """The results document (see ``--json``): the settings, the medians (GB/s, seconds), samples and ratios."""

    def values(tool: str, key: str) -> list[float]:
        return [s[key] for s in rounds.samples.get(tool, []) if key in s]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    samples = {f"{tool}_{op}": values(tool, op) for tool in ("engine", "fio") for op in ("write", "read")}
    results = {name: median(values) for name, values in samples.items()}
    pairs = {op: (results[f"engine_{op}"], results[f"fio_{op}"]) for op in ("write", "read")}
    settings = {"dir": os.path.abspath(args.dir), "size": args.size, "block_size": args.block_size}
    settings.update(queue_depth=args.queue_depth, threads=args.threads, engine=handle.engine, direct=not args.buffered)
    settings.update(single_submit=args.single_submit, overlap_events=not args.no_overlap_events)
    settings.update(fallocate=not args.no_fallocate, repeats=args.repeats, warmup_loops=args.warmup_loops)
    settings.update(huge_pages=not args.no_huge_pages, device=str(torch.device(args.device)), validate=args.validate)
    settings.update(handle="io_handle" if gds is None else "gds_handle", gds_path=None if gds is None else gds.path)
    return {
        "benchmark": "fastpersist.bench.io",
        "settings": settings,
        "filesystem": probe,
        "gbps_median": results,
        "gbps_samples": samples,
        "seconds_median": {f"engine_{op}": median(values("engine", f"{op}_s")) for op in ("write", "read")},
        "ratio_engine_to_fio": {op: e / f if e and f else None for op, (e, f) in pairs.items()},
        "stats": handle.stats(),
        "gds": None if gds is None else {"path": gds.path, "reason": gds.path_reason},
    }


def ds_io_summary(doc: dict[str, Any]) -> list[str]:
    """ds_io's result lines for ``doc`` (median seconds; GB/sec with GB = 2**30 bytes, as ds_io prints)."""
    lines = []
    for op, word in (("write", "Write"), ("read", "Read")):
        latency = doc["seconds_median"].get(f"engine_{op}")
        if latency is not None:
            speed = doc["settings"]["size"] / latency / 2**30 if latency else 0.0
            lines += [f"E2E {word} Latency = {latency} sec", f"E2E {word} Speed = {speed} GB/sec"]
    return lines


def _text(doc: dict[str, Any]) -> str:
    """The terminal's table (median GB/s of the engine and fio, their ratio, every sample), then ds_io's lines."""
    s, rows = doc["settings"], []
    for op in ("write", "read"):
        e, f = doc["gbps_median"][f"engine_{op}"], doc["gbps_median"][f"fio_{op}"]
        r = doc["ratio_engine_to_fio"][op]
        samples = " | ".join(" ".join(f"{v:.2f}" for v in doc["gbps_samples"][f"{t}_{op}"]) for t in ("engine", "fio"))
        if e is not None:
            rows.append((op, f"{e:.2f}", f"{f:.2f}" if f else "-", f"{100 * r:.0f}%" if r else "-", samples))
    header = ("op", "engine GB/s", "fio GB/s", "ratio", "samples (engine | fio)")
    via = f", GdsHandle path {s['gds_path']}" if s.get("gds_path") else ""
    title = (
        f"fastpersist io bench{via}: {s['size'] / 2**30:.2f} GiB, block {s['block_size'] >> 10} KiB, "
        f"queue depth {s['queue_depth']}, lanes {s['threads']}, engine {s['engine']}, "
        f"direct {s['direct']}, fallocate {s['fallocate']}, fs {doc['filesystem']['fs_type']}, "
        f"median of {s['repeats']}"
    )
    return "\n".join([title, display.format_table(header, rows, "<>>><", rule=False), *ds_io_summary(doc)])


BENCHMARK = Benchmark(
    "io",
    _options,
    _measure,
    None,
    description="Sequential write/read throughput of the fastpersist I/O engine (optionally vs fio). "
    "Also accepts DeepSpeed ds_io's options (see the 'DeepSpeed ds_io' group).",
    show=_text,
    json="print",
    report=None,
)
main = BENCHMARK.main


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m fastpersist.bench io`` (ds_io's options included)."""
    return BENCHMARK.parser()
