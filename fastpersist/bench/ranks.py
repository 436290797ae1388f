"""``python -m fastpersist.bench ranks``: data-parallel sharded save against the number of ranks.

For each N in ``--ranks`` (and 1, the single writer), N processes of one process group time ``--repeat`` collective
saves of the same ``--size`` state, per rank and end to end (first start after a barrier to the last return), every
checkpoint verified, the first loaded back. ``--sink`` saves into ``/dev/null`` and measures each N's bound: all ranks
at once copying their share to the host. For per-rank targets (``--dir`` a comma list) the N-rank time is projected
from the single writer's rate plus the measured coordination; see docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

from fastpersist import config
from fastpersist.bench import bounds, measure
from fastpersist.bench.harness import Benchmark, UsageError, bf16_state, markdown_table, option, spawn
from fastpersist.bench.shapes import sink_save
from fastpersist.io import targets
from fastpersist.tuning import workloads

__all__ = ["BENCHMARK", "SCHEMA", "main", "to_markdown"]

SCHEMA = "fastpersist.bench.ranks/1"
_SECONDS = ("write_seconds", "digest_seconds", "prepare_seconds", "launch_seconds")  # of a save, in a rank's records


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (1 is always added)")
    option(parser, "size", type=str, default="2G", help="checkpoint size (e.g. 256M, 2G)")
    option(parser, "device", choices=["cpu", "cuda"], help="where each rank's state lives")
    per_rank = (
        "target directory; a comma list gives rank r the directory r %% len (per-rank targets, with --layout parts)"
    )
    option(parser, "dir", help=per_rank)
    parser.add_argument("--layout", default="file", choices=["file", "parts"])
    parser.add_argument("--writers", default="all", choices=["all", "node"])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    sink = "write into /dev/null and commit nothing: the pipeline without storage"
    parser.add_argument("--sink", action="store_true", help=sink)
    option(parser, "repeats", "--repeat")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--markdown", default=None, help="write the table and a text chart (Markdown) here")


def _worker(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank's part (a child of :func:`_measure`): ``--repeat`` collective saves, checked; its records."""
    import torch.distributed as dist

    import fastpersist
    from fastpersist.distributed import save as dsave
    from fastpersist.distributed.manifest import is_manifest, read_manifest

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda" or args.backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(args.backend)
    state = bf16_state(config.parse_size(args.size), args.device, odd_tail=True)
    directories = args.dir.split(",")
    path = os.path.join(directories[rank % len(directories)], "ranks-bench.pt")
    options = {"group": dist.group.WORLD, **{k: getattr(args, k) for k in ("layout", "writers", "timeout")}}
    records = []
    for repeat in range(args.repeat):
        dist.barrier()
        start = time.time()
        if world == 1:
            began = time.perf_counter()
            if args.sink:
                written = sink_save(state, config.settings())
            else:
                fastpersist.save(state, path)
                written = os.path.getsize(path)
            seconds = {"write_seconds": time.perf_counter() - began, **dict.fromkeys(_SECONDS[1:], 0.0)}
            steps = {}
        else:
            stats = dsave.save(state, targets.Sink() if args.sink else path, **options, settings=config.settings())
            written, steps, seconds = stats.bytes_written, stats.steps, {k: getattr(stats, k) for k in _SECONDS}
        end = time.time()
        dist.barrier()
        check = {"sink": True} if args.sink else {}
        if rank == 0 and not args.sink:
            report = fastpersist.verify(path)
            check = {"verified_records": report.records, "checksummed": report.checksummed}
            if repeat == 0:
                loaded = fastpersist.load(path, map_location="cpu")
                check["round_trip"] = all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
            parts = read_manifest(path).parts if is_manifest(path) else []
            files = [path, *(os.path.join(os.path.dirname(path), p.name) for p in parts)]
            check["file_bytes"] = sum(os.path.getsize(f) for f in files)
        dist.barrier()
        record = {"rank": rank, "repeat": repeat, "start": start, "end": end, "bytes": written}
        records.append({**record, **seconds, "steps": steps, **check})
    if args.sink:  # the bound: this rank's share (every world-th tensor) copied to the host, no format
        settings = config.settings()
        ceiling = bounds.CopyCeiling(list(state.values())[rank::world], settings.buffer_size, settings.buffer_count)
        ceiling.to_host(settings.checksum)  # untimed: first touches
        for index in range(args.repeat):
            dist.barrier()
            start = time.time()
            ceiling.to_host(settings.checksum)
            records.append({"rank": rank, "bound_repeat": index, "start": start, "end": time.time()})
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
    return records


def _summarize(world: int, rows: list[dict[str, Any]], size: int) -> dict[str, Any]:
    def repeats(key: str) -> list[list[dict[str, Any]]]:  # the rows of every repeat, in order
        return [[r for r in rows if r.get(key) == i] for i in sorted({r[key] for r in rows if key in r})]

    def span(these: list[dict[str, Any]]) -> float:  # from the first start to the last end
        return max(r["end"] for r in these) - min(r["start"] for r in these)

    bound = measure.summarize([span(these) for these in repeats("bound_repeat")])
    end_to_end = [span(these) for these in repeats("repeat")]
    slowest_write = [max(r["write_seconds"] for r in these) for these in repeats("repeat")]
    saves = [r for r in rows if "bound_repeat" not in r]
    per_rank = []
    for rank in range(world):
        mine = [r for r in saves if r["rank"] == rank]
        seconds = {k: measure.summarize([r.get(k, 0.0) for r in mine]) for k in _SECONDS}
        write = seconds["write_seconds"]["median"]
        rate = mine[0]["bytes"] / write / 1e9 if write else None
        per_rank.append({"rank": rank, "bytes": mine[0]["bytes"], **seconds, "write_GBps": rate})
    checks = [r for r in saves if r["rank"] == 0]
    e2e = measure.summarize(end_to_end)
    steps = {
        step: measure.summarize([r["steps"][step] for r in checks if step in r["steps"]])
        for step in ("plan", "match", "write", "commit")
    }
    return {
        "ranks": world,
        "end_to_end_seconds": e2e,
        "end_to_end_GBps": size / e2e["median"] / 1e9,
        "slowest_write_seconds": measure.summarize(slowest_write),
        "coordination_seconds": measure.summarize([e - w for e, w in zip(end_to_end, slowest_write)]),
        "per_rank": per_rank,
        "rank0_steps_seconds": steps if world > 1 else None,
        "bound_seconds": bound,
        "file_bytes": checks[0].get("file_bytes"),
        "identity_check_seconds": max(p["digest_seconds"]["median"] for p in per_rank),
        "verified": all(c.get("sink") for c in checks)
        or (all(c.get("verified_records") for c in checks) and checks[0].get("round_trip", False)),
    }


def _project(results: list[dict[str, Any]]) -> None:
    """Adds the projection for independent per-rank targets: each rank writing at the single writer's rate."""
    single = next(r for r in results if r["ranks"] == 1)
    rate = single["per_rank"][0]["write_GBps"] * 1e9
    baseline = single["end_to_end_seconds"]["median"]
    for r in results:
        coordination = max(r["coordination_seconds"]["median"], 0.0) if r["ranks"] > 1 else 0.0
        r["projected_independent_seconds"] = max(p["bytes"] for p in r["per_rank"]) / rate + coordination
        r["projected_speedup"] = baseline / r["projected_independent_seconds"]
        r["measured_speedup"] = baseline / r["end_to_end_seconds"]["median"]
        if r.get("bound_seconds") and single.get("bound_seconds"):
            r["of_bound"] = r["bound_seconds"]["median"] / r["end_to_end_seconds"]["median"]
            r["bound_speedup"] = single["bound_seconds"]["median"] / r["bound_seconds"]["median"]


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    ranks = sorted({1, *(int(n) for n in args.ranks.split(",") if n.strip())})
    size = config.parse_size(args.size)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    settings = {"size": size, **{k: getattr(args, k) for k in ("device", "layout", "writers", "backend")}}
    settings.update(repeat=args.repeat, timeout=args.timeout, sink=args.sink, checksum=config.settings().checksum)
    missing = [d for d in (args.dir or ".").split(",") if not os.path.isdir(d)]
    if missing:
        raise UsageError(f"--dir: {', '.join(missing)}: no such directory")
    results = []
    with tempfile.TemporaryDirectory(dir=(args.dir or ".").split(",")[0]) as scratch:
        dirs = args.dir.split(",") if args.dir and "," in args.dir else [scratch]
        for world in ranks:
            records, error = spawn("ranks", [*args.argv, "--dir", ",".join(dirs)], ranks=world, group=True)
            if error:
                raise RuntimeError(f"{world} ranks failed:\n{error}")
            results.append(_summarize(world, [row for rows in records for row in rows], size))
            for stale in [os.path.join(d, name) for d in dirs for name in os.listdir(d)]:
                if os.path.basename(stale).startswith("ranks-bench.pt"):
                    os.unlink(stale)
    _project(results)
    document = {
        "schema": SCHEMA,
        "machine": measure.machine_info(dirs[0] if os.path.isdir(dirs[0]) else None, args.device),
        **settings,
        "dirs": args.dir or "(temporary)",
        "config": settings,
        "results": results,
    }
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(to_markdown(document))
    return document


def _writing(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in r["per_rank"] if p["bytes"]]


def _launch_ms(r: dict[str, Any]) -> str:
    launch = [p["launch_seconds"]["median"] * 1e3 for p in _writing(r) if "launch_seconds" in p]
    return f"{max(launch):.1f}" if launch and r["ranks"] > 1 else "n/a"


_COLUMNS = [  # heading, the cell of one N's result r in a document of size bytes
    ("N", lambda r, _: r["ranks"]),
    ("per-rank bytes", lambda r, _: workloads.format_bytes(max(p["bytes"] for p in r["per_rank"]))),
    ("per-rank write (s)", lambda r, _: f"{max(p['write_seconds']['median'] for p in _writing(r)):.3f}"),
    ("per-rank GB/s", lambda r, _: f"{min(p['write_GBps'] for p in _writing(r)):.2f}"),
    ("identity check: launch, in the write (ms)", lambda r, _: _launch_ms(r)),
    ("identity check wait (s)", lambda r, _: f"{r.get('identity_check_seconds', 0.0):.3f}"),
    ("end-to-end (s)", lambda r, _: f"{r['end_to_end_seconds']['median']:.3f}"),
    ("end-to-end GB/s", lambda r, _: f"{r['end_to_end_GBps']:.2f}"),
    ("vs single writer", lambda r, _: f"{r['measured_speedup']:.2f}x"),
    ("projected, independent targets (s)", lambda r, _: f"{r['projected_independent_seconds']:.3f}"),
    ("projected speed-up", lambda r, _: f"{r['projected_speedup']:.2f}x"),
]
_BOUND_COLUMNS = [
    ("N", lambda r, _: r["ranks"]),
    ("bound end-to-end (s)", lambda r, _: f"{r['bound_seconds']['median']:.3f}"),
    ("bound GB/s", lambda r, size: f"{size / r['bound_seconds']['median'] / 1e9:.2f}"),
    ("bound vs 1 rank", lambda r, _: f"{r['bound_speedup']:.2f}x"),
    ("measured, of bound", lambda r, _: f"{r['of_bound']:.2f}"),
]


def _table(columns: list[tuple[str, Any]], results: list[dict[str, Any]], size: int) -> list[str]:
    rows = [[cell(r, size) for _, cell in columns] for r in results]
    return markdown_table([heading for heading, _ in columns], ">" * len(columns), rows)


def _bar(value: float, scale: float, width: int = 40) -> str:
    cells = int(round(value / scale * width * 8)) if scale > 0 else 0
    return "\u2588" * (cells // 8) + ("\u258f\u258e\u258d\u258c\u258b\u258a\u2589"[cells % 8 - 1] if cells % 8 else "")


def to_markdown(document: dict[str, Any]) -> str:
    """A Markdown table of one result document, and a text bar chart of end-to-end GB/s against N."""
    machine, size, results = document["machine"], document["size"], document["results"]
    lines = [
        "#### sharded save against N ranks",
        "",
        f"{machine.get('cpu_count')} cores, {machine.get('device_name')}, torch {machine.get('torch')}, "
        f"{workloads.format_bytes(size)} bf16 on {document['device']} per rank, "
        f"backend {document.get('backend', 'gloo')}, "
        + ("**sink** (/dev/null, nothing stored), " if document.get("sink") else "")
        + f"layout `{document['layout']}`, "
        f"writers `{document['writers']}`, {document['repeat']} repeats (medians), target {document['dirs']}",
        "",
        *_table(_COLUMNS, results, size),
    ]
    bounded = [r for r in results if r.get("of_bound")]
    if bounded:
        checksummed = ", checksummed as it lands" if document.get("checksum", True) else ""
        lines += [
            "",
            "Bound (all ranks at once copy their share to the host through a ring of page-locked windows"
            f"{checksummed}; no format, no coordination):",
            "",
            *_table(_BOUND_COLUMNS, bounded, size),
        ]
    projected = [size / r["projected_independent_seconds"] / 1e9 for r in results]
    scale = max(max(r["end_to_end_GBps"], p) for r, p in zip(results, projected))
    lines += ["", "```", "end-to-end GB/s (measured M, projected for independent per-rank targets P)"]
    for r, p in zip(results, projected):
        lines.append(f"N={r['ranks']:<3} M {_bar(r['end_to_end_GBps'], scale)} {r['end_to_end_GBps']:.2f}")
        lines.append(f"      P {_bar(p, scale)} {p:.2f}")
    lines += ["```", ""]
    return "\n".join(lines)


BENCHMARK = Benchmark(
    "ranks",
    _options,
    _measure,
    to_markdown,
    description=__doc__.split("\n")[0],
    schema=SCHEMA,
    report="--render",
    child=_worker,
    status=lambda document: 0 if all(r["verified"] for r in document["results"]) else 1,
)
main = BENCHMARK.main
