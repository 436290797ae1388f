"""Where the storage-pace work stands, in one command: every target ratio of one GPU, measured in one run.

    python -m fastpersist.bench pace --disk /mnt/nvme/fp --shm /dev/shm/fp --json out.json
    python -m fastpersist.bench pace --report out.json

Each against its own ceiling in the same run: ``training`` every iteration (pipelined and snapshot, to shm and to
disk) against its bound; a ``--size`` GPU state saved durably to disk against fio's O_DIRECT write (fio on ``PATH``),
alternating; that state loaded from shm verified against unverified. Each target (:data:`TARGETS`), its ratio and
whether it is met; see docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from fastpersist.bench.harness import Benchmark, Rounds, bf16_state, figure, markdown_table, option, timed
from fastpersist.bench.measure import remove_path

__all__ = ["BENCHMARK", "SCHEMA", "TARGETS", "main", "to_markdown"]

SCHEMA = "fastpersist.bench.pace/1"
TARGETS = {
    # name: (what, comparison, target)
    "training-shm-pipelined": ("every-iteration pipelined to shm, x the bound", "<=", 1.05),
    "training-shm-snapshot": ("every-iteration snapshot to shm, x the bound", "<=", 1.10),
    "training-disk-pipelined": ("every-iteration pipelined to disk, x the bound", "<=", 1.05),
    "training-disk-snapshot": ("every-iteration snapshot to disk, x the bound", "<=", 1.10),
    "disk-save": ("GPU state saved durably to disk, x fio's write", ">=", 0.95),
    "verified-load": ("verified shm->GPU load, x the same load unverified", ">=", 0.90),
}


def _training(directory: str, iterations: int, scratch: str) -> dict[str, Any]:
    out = os.path.join(scratch, f"training-{abs(hash(directory))}.json")
    command = [sys.executable, "-m", "fastpersist.bench", "training", "--dir", directory, "--json", out]
    command += ["--methods", "fastpersist-pipelined,fastpersist-snapshot", "--iterations", str(iterations)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        return {"error": (run.stderr or run.stdout)[-2000:]}
    with open(out) as f:
        document = json.load(f)
    rows = {r["method"]: r for r in document["results"]}
    return {
        "bound_s": document.get("possible_per_iteration_s"),
        "steady_s": {m: rows[m].get("steady_per_iteration_s") for m in rows},
        "of_bound": {m: rows[m].get("steady_of_possible") for m in rows},
        "document": document,
    }


def _disk_rounds(directory: str, state: dict, nbytes: int, rounds: int) -> dict[str, Any]:
    import fastpersist
    from fastpersist.bench import bounds

    path, fio_path = os.path.join(directory, "pace-save.pt"), os.path.join(directory, "pace-fio.bin")
    fastpersist.save(state, path)  # untimed: pools and the file system's first allocation

    def run(name: str, _round: int) -> float:
        for stale in (path, fio_path):
            remove_path(stale)
        os.sync()
        if name == "fio":
            return bounds.fio_write_seconds(fio_path, nbytes)
        return timed(lambda: fastpersist.save(state, path))[1]["seconds"]

    measured = Rounds(rounds, order="reverse", catch=False).run([["fio", "fastpersist"]], run).samples
    for stale in (path, fio_path):
        remove_path(stale)
    return _paired(nbytes, measured, "fastpersist", "fio")


def _load_rounds(directory: str, state: dict, nbytes: int, rounds: int, device: str) -> dict[str, Any]:
    import torch

    import fastpersist

    path = os.path.join(directory, "pace-load.pt")
    fastpersist.save(state, path)

    def run(name: str, index: int) -> float:
        verify = name == "verified"
        loaded, seconds = timed(lambda: fastpersist.load(path, map_location=device, verify=verify), device)
        if index == 0 and verify and any(not torch.equal(loaded[k], state[k]) for k in state):
            raise AssertionError("the verified load differs from the saved state")
        return seconds["seconds"]

    try:  # the first round is untimed
        measured = Rounds(rounds, warmup=1, order="reverse", catch=False).run([["verified", "unverified"]], run).samples
    finally:
        os.unlink(path)
    return _paired(nbytes, measured, "verified", "unverified")


def _paired(nbytes: int, seconds: dict[str, list[float]], measured: str, reference: str) -> dict[str, Any]:
    """Each round's seconds of two methods and their ratio (reference / measured: above 1, ``measured`` is
    faster), the median ratio and each method's median GB/s."""
    records = [dict(zip(seconds, pair)) for pair in zip(*seconds.values())]
    for record in records:
        record["ratio"] = record[reference] / record[measured]
    gbps = {f"{m}_gbps": nbytes / statistics.median(r[m] for r in records) / 1e9 for m in (measured, reference)}
    return {"bytes": nbytes, "rounds": records, "ratio": statistics.median(r["ratio"] for r in records), **gbps}


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fastpersist import system
    from fastpersist.bench.measure import machine_info

    if not system.find_fio():
        raise SystemExit(f"the disk save's ceiling is fio's write: {system.FIO_INSTALL_HINT}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ratios, parts = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for where, directory in (("shm", args.shm), ("disk", args.disk)):
            os.makedirs(directory, exist_ok=True)
            parts[f"training-{where}"] = result = _training(directory, args.iterations, scratch)
            for mode in ("pipelined", "snapshot"):
                ratios[f"training-{where}-{mode}"] = (result.get("of_bound") or {}).get(f"fastpersist-{mode}")
            print(f"training {where}: {result.get('of_bound', result.get('error'))}", file=sys.stderr)
    state = bf16_state(args.size, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    parts["disk-save"] = _disk_rounds(args.disk, state, nbytes, args.rounds)
    print(f"disk save: {[round(r['ratio'], 3) for r in parts['disk-save']['rounds']]}", file=sys.stderr)
    parts["verified-load"] = _load_rounds(args.shm, state, nbytes, args.rounds, device)
    results = {}
    for name, (what, comparison, target) in TARGETS.items():
        ratio = parts[name]["ratio"] if name in parts else ratios.get(name)
        met = None if ratio is None else ratio <= target if comparison == "<=" else ratio >= target
        results[name] = {"what": what, "target": f"{comparison} {target}", "ratio": ratio, "met": met}
    return {
        "schema": SCHEMA,
        "benchmark": "pace",
        "machine": machine_info(args.disk, device=device),
        "config": {"size": args.size, "rounds": args.rounds, "iterations": args.iterations, "device": device},
        "results": results,
        "parts": parts,
    }


def to_markdown(document: dict[str, Any]) -> str:
    """One row per target: what, the measured ratio, the target, met."""
    config = document["config"]
    lines = [
        f"Device `{config['device']}` ({document['machine'].get('device_name') or '-'}), state "
        f"{config['size'] / 1e9:.1f} GB, {config['rounds']} rounds; training every iteration, "
        f"{config['iterations']} iterations.",
        "",
        *markdown_table(["target", "measured", "target", "met"], "<>><", []),
    ]
    for row in document["results"].values():
        met = {True: "yes", False: "NO", None: "not measured"}[row["met"]]
        lines.append(f"| {row['what']} | {figure(row['ratio'], '.3f')} | {row['target']} | {met} |")
    for name in ("disk-save", "verified-load"):
        rounds = (document["parts"].get(name) or {}).get("rounds") or []
        lines.append(f"\n{name} per round: " + ", ".join(f"{r['ratio']:.3f}" for r in rounds))
    return "\n".join(lines) + "\n"


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disk", default=tempfile.gettempdir(), help="a directory on the disk")
    parser.add_argument("--shm", default="/dev/shm/fastpersist-pace", help="a directory on tmpfs")
    option(parser, "size", default=4 << 30, help="the state of the save and load parts")
    option(parser, "repeats", "--rounds", default=5, help="rounds of the disk save and of the load, alternating")
    parser.add_argument("--iterations", type=int, default=12, help="timed iterations of each training run")


BENCHMARK = Benchmark("pace", _options, _measure, to_markdown, description=__doc__.split("\n\n")[0], schema=SCHEMA)
main = BENCHMARK.main
