"""Checkpoint every iteration of a small transformer's training: what does it cost?

    python -m fastpersist.bench training --dir /dev/shm/fp --json out.json        # GPU if present
    python -m fastpersist.bench training --report out.json --svg docs/images/async.svg   # table + chart

Each method runs the same loop (forward, backward, AdamW step) in a fresh process (DDP over ``--ranks``),
checkpointing model + optimizer after the first timed iteration and every ``--every``, against the loop without
checkpoints (``none``) and the bound ``max(iteration, the faster of a checkpoint's write alone and in a row /
every)`` (:mod:`fastpersist.bench.bounds`, same run; N concurrent writers for the collective methods). Per save,
where the time goes (:mod:`fastpersist.io.timeline`); see docs/async.md.
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from fastpersist.bench import bounds
from fastpersist.bench.harness import Benchmark, Rounds, Svg, UsageError, figure, markdown_table, option, spawn, timed
from fastpersist.tuning.measure import write_json

__all__ = ["BENCHMARK", "METHODS", "RANK_METHODS", "SCHEMA", "main", "save_phases", "to_markdown", "to_svg"]

SCHEMA = "fastpersist-training-bench/1"
METHODS = ["none", "fastpersist-pipelined", "fastpersist-snapshot", "fastpersist-sync", "torch.save", "lightning-async"]
_COLLECTIVE = ("fastpersist-collective", "fastpersist-collective-pipelined", "fastpersist-collective-snapshot")
RANK_METHODS = ["none", *_COLLECTIVE, "fastpersist-pipelined", "fastpersist-snapshot", "fastpersist-sync", "torch.save"]
_CHECKPOINTER = ("fastpersist-pipelined", "fastpersist-snapshot", *_COLLECTIVE[1:])


def _build(args, device, seed: int = 0):
    """The model and optimizer (the same on every rank) and this rank's batch (``seed``)."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        args.d_model, args.heads, 4 * args.d_model, dropout=0.0, batch_first=True, norm_first=True
    )
    model = torch.nn.Sequential(
        torch.nn.Embedding(args.vocab, args.d_model),
        torch.nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False),
        torch.nn.Linear(args.d_model, args.vocab),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
    return model, optimizer, tokens


def _iteration(model, optimizer, tokens, amp: bool):
    import torch

    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _setup(args, rank: int):
    """This rank's model, optimizer, batch and the model it trains (with ``--ranks``: DDP in a process group)."""
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if args.ranks > 1:
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.ranks)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model, optimizer, tokens = _build(args, device, seed=rank)
    ids = [device.index] if device.index is not None else None
    trained = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids) if args.ranks > 1 else model
    return model, optimizer, tokens, trained


def _run_one(args) -> dict[str, Any]:
    """One method in this process (one per rank with ``--ranks``); its measurements."""
    import torch
    import torch.distributed as dist

    import fastpersist
    from fastpersist.bench.measure import PeakMemory, remove_path
    from fastpersist.io import timeline
    from fastpersist.system import release_memory

    rank, method, distributed, cuda = int(os.environ.get("RANK", 0)), args.method, args.ranks > 1, args.device == "cuda"
    model, optimizer, tokens, trained = _setup(args, rank)
    # One path for every rank: with several ranks, per-process names would not be one checkpoint.
    path = os.path.join(args.dir, f"bench-{method}-{os.getppid() if distributed else os.getpid()}.pt")
    writes = method != "none" and (not distributed or rank == 0 or method in _COLLECTIVE)
    group = {"group": dist.group.WORLD, "layout": args.layout} if method in _COLLECTIVE else {}
    checkpointer = lightning_io = None
    futures, blocked = [], []  # the asynchronous saves' futures (with a collective's SaveStats), seconds blocked
    if writes and method in _CHECKPOINTER:
        checkpointer = fastpersist.Checkpointer(optimizer, model=model, mode=method.rsplit("-", 1)[1], **group)
    elif writes and method == "lightning-async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        lightning_io = AsyncCheckpointIO(TorchCheckpointIO())

    def state():
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def checkpoint():
        started = time.perf_counter()
        if checkpointer is not None:
            futures.append(checkpointer.save(state(), path))
        elif lightning_io is not None:
            lightning_io.save_checkpoint(state(), path)
        elif writes and method == "torch.save":
            _torch_save(state(), path)
        elif writes:  # fastpersist-sync, fastpersist-collective
            fastpersist.save(state(), path, **group)
        if distributed and method in ("fastpersist-sync", "torch.save"):
            dist.barrier()  # the ranks that do not save wait for rank 0's save, as Lightning's ranks do
        if writes:
            blocked.append(time.perf_counter() - started)

    for _ in range(args.warmup):
        _iteration(trained, optimizer, tokens, cuda)
    if distributed:
        dist.barrier()
    if checkpointer is not None and args.prepare:
        checkpointer.prepare(state())
    release_memory()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    with PeakMemory() as host, timeline.recording() as events:
        started = time.perf_counter()
        for index in range(args.iterations):
            _iteration(trained, optimizer, tokens, cuda)
            if index % args.every == 0:
                checkpoint()
        steady = time.perf_counter() - started
        if checkpointer is not None:
            checkpointer.wait()
        if lightning_io is not None:
            lightning_io.teardown()
        if cuda:
            torch.cuda.synchronize()
        drained = time.perf_counter() - started
    if args.timeline:  # the raw marks, for a where-does-the-time-go trace (docs/async.md)
        os.makedirs(args.timeline, exist_ok=True)
        write_json({"started": started, "events": events}, os.path.join(args.timeline, f"{method}-rank{rank}.json"))
    parted = method in _COLLECTIVE and args.layout == "parts"
    peak_gpu = torch.cuda.max_memory_allocated() if cuda else None
    result = {
        "method": method,
        "iterations": args.iterations,
        "steady_s": steady,
        "drained_s": drained,
        "per_iteration_s": drained / args.iterations,
        "blocked_per_save_s": statistics.median(blocked) if blocked else 0.0,
        "first_blocked_s": blocked[0] if blocked else 0.0,
        "saves": save_phases(events),
        "checkpoint_bytes": _checkpoint_bytes(path, parted),
        "peak_host_delta_bytes": host.delta,
        "peak_host_bytes": host.peak,
        "peak_gpu_bytes": peak_gpu,
        "peak_gpu_delta_bytes": None if peak_gpu is None else peak_gpu - base_gpu,
    }
    if collective := _collective(futures):
        result["collective"] = collective
    if distributed:
        # DDP holds the group: drop it first, so the group goes while the interpreter is alive (not at exit).
        del trained
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        for leftover in [path, *(glob.glob(glob.escape(path) + ".*.part-*") if parted else ())]:
            remove_path(leftover)
    return result


def _collective(futures: list) -> dict[str, Any] | None:
    """Rank 0's collective saves after the first (None: none): seconds from each start to the end of each step's
    exchange (plan, verify in the caller; write, commit in the background), its write, its bytes."""
    stats = [f.stats for f in futures if f.stats is not None][1:]
    if not stats:
        return None
    return {
        "steps_s": {k: statistics.median(s.steps.get(k, 0.0) for s in stats) for k in stats[0].steps},
        "write_s": statistics.median(s.write_seconds for s in stats),
        "bytes_written": stats[0].bytes_written,
        "file_size": stats[0].file_size,
    }


def _torch_save(state: dict[str, Any], path: str) -> None:
    """torch.save + fsync, marked as one phase on the timeline (torch marks nothing itself)."""
    import torch

    from fastpersist.io import timeline

    timeline.mark("call")
    torch.save(state, path)
    bounds.fsync_file(path)
    timeline.mark("committed")


def _checkpoint_bytes(path: str, parted: bool) -> int:
    """The size of the checkpoint at ``path``: its file's, or (``parted``) what its manifest and parts make."""
    nbytes = os.path.getsize(path) if os.path.exists(path) else 0
    if parted and nbytes:
        from fastpersist.distributed.manifest import read_manifest

        return read_manifest(path).size
    return nbytes


_PHASES = (
    # (name, from label, to label): medians over the saves of a run
    ("pickle", "call", "pickled"),
    ("wait for slot", "pickled", "slot"),
    ("verify", "slot", "verified"),  # a collective async save's identity check (in "copies queued" too)
    ("copies queued", "slot", "queued"),
    ("open", "start", "opened"),
    ("read", "opened", "reads queued"),
    ("write", "opened", "written"),
    ("fsync", "written", "fsynced"),
    ("rename", "fsynced", "renamed"),
    ("commit", "renamed", "committed"),
    ("save", "start", "done"),
)


def save_phases(events: list[tuple[float, str, str]]) -> list[dict[str, float]]:
    """Seconds of each phase (``_PHASES``) of every save in a :func:`fastpersist.io.timeline.recording`, in order:
    the caller's marks numbered by its ``call`` marks, the background thread's by its ``start`` marks."""
    caller = next((thread for _, thread, label in events if label == "call"), None)
    calls = starts = -1
    marks: dict[int, dict[str, float]] = {}
    for when, thread, label in events:
        if label == "call":
            calls += 1
        elif label == "start":
            starts += 1
        index = calls if thread == caller else starts
        if index >= 0:
            marks.setdefault(index, {}).setdefault(label, when)
    saves = []
    for index in sorted(marks):
        seen = marks[index]
        if "start" not in seen and "call" in seen:  # synchronous: the write runs in the caller
            seen["start"] = seen.get("pickled", seen["call"])
            seen.setdefault("done", seen.get("committed", seen["start"]))
        saves.append({name: seen[b] - seen[a] for name, a, b in _PHASES if a in seen and b in seen})
    return saves


def _phase_medians(samples: list[dict]) -> dict[str, float]:
    """Median seconds of each phase over every save of every sample, the first saves of each process apart."""
    later = [save for sample in samples for save in sample.get("saves", [])[1:]]
    first = [sample["saves"][0] for sample in samples if sample.get("saves")]
    out: dict[str, float] = {}
    for name, _, _ in _PHASES:
        if values := [save[name] for save in later if name in save]:
            out[name] = statistics.median(values)
        if values := [save[name] for save in first if name in save]:
            out["first " + name] = statistics.median(values)
    return out


def _measure_d2h(args) -> float | None:
    """Seconds to copy the checkpoint's tensors device-to-host into pinned memory (the snapshot's cost)."""
    import torch

    if args.device != "cuda":
        return None
    model, optimizer, tokens = _build(args, torch.device("cuda"))
    _iteration(model, optimizer, tokens, True)
    tensors = list(model.state_dict().values()) + [
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.is_cuda
    ]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def copy() -> None:
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)

    return min(timed(copy, "cuda")[1]["seconds"] for _ in range(3))


# The options a method's process runs with (its children get the same command line), recorded in the config.
_RUN_OPTIONS = "dir device d_model layers heads vocab batch seq iterations warmup every ranks layout prepare".split()


def _median(samples: list[dict], key: str, per_iteration: bool = False) -> float | None:
    values = [s[key] / s["iterations"] if per_iteration else s[key] for s in samples]
    return statistics.median(values) if values else None


def _measure(args) -> dict[str, Any]:
    """Each method in a fresh process (``--ranks`` of them), ``--repeats`` times; the document of them all."""
    from fastpersist.bench.measure import machine_info

    os.makedirs(args.dir, exist_ok=True)
    known, where = (RANK_METHODS, " with --ranks") if args.ranks > 1 else (METHODS, "")
    methods = [m for m in (args.methods or ",".join(known)).split(",") if m]
    if unknown := set(methods) - set(known):
        raise UsageError(f"unknown methods {sorted(unknown)}; known{where}: {known}")
    if "none" not in methods:
        methods.insert(0, "none")

    def run(method: str, _round: int) -> dict[str, Any]:
        results, error = spawn("training", [*args.argv, "--method", method], ranks=args.ranks)
        if error:
            print(f"{method}: failed\n{error}", file=sys.stderr)
            raise RuntimeError(error[-2000:])
        print(f"{method}: {results[0]['per_iteration_s'] * 1000:.1f} ms/iteration", file=sys.stderr)
        return results[0]

    rounds = Rounds(args.repeats, order="reverse").run([methods], run)
    samples = {m: rounds.samples.get(m, []) for m in methods}
    checkpoint_bytes = max((runs[0]["checkpoint_bytes"] for runs in samples.values() if runs), default=0)
    ceiling = shared = None
    if checkpoint_bytes and not args.no_ceiling:
        ceiling = bounds.write_ceiling(args.dir, checkpoint_bytes, in_a_row=max(3, args.iterations // args.every))
        if args.ranks > 1 and any(m in _COLLECTIVE for m in methods):
            shared = bounds.shared_write_ceiling(args.dir, checkpoint_bytes, args.ranks)
    none = samples["none"]
    base, base_steady = _median(none, "per_iteration_s"), _median(none, "steady_s", True)
    base_host, base_gpu = _median(none, "peak_host_bytes"), none[0]["peak_gpu_bytes"] if none else None
    # Every `every` iterations one checkpoint replaces the last: the storage's share per iteration.
    alone = max(base_steady, ceiling["best_s"] / args.every) if ceiling and base_steady else None
    fastest = min(ceiling["best_s"], ceiling["sustained_s"]) if ceiling else None  # the storage's best, either way
    possible = max(base_steady, fastest / args.every) if ceiling and base_steady else None
    possible_shared = max(base_steady, shared["per_writer_s"] / args.every) if shared and base_steady else None
    results = []
    for method, runs in samples.items():
        if not runs:
            results.append({"method": method, "error": rounds.errors.get(method, "no sample")})
            continue
        per, steady = _median(runs, "per_iteration_s"), _median(runs, "steady_s", True)
        host_peak, gpu_peak = _median(runs, "peak_host_bytes"), runs[0]["peak_gpu_bytes"]
        result = {
            "method": method,
            "per_iteration_s": per,
            "steady_per_iteration_s": steady,
            "overhead_pct": None if not base else 100.0 * (per - base) / base,
            "steady_overhead_pct": None if not base_steady else 100.0 * (steady - base_steady) / base_steady,
            "blocked_per_save_s": _median(runs, "blocked_per_save_s"),
            "checkpoint_bytes": runs[0]["checkpoint_bytes"],
            "peak_host_bytes": host_peak,
            "extra_host_bytes": None if base_host is None else host_peak - base_host,
            "peak_gpu_bytes": gpu_peak,
            "extra_gpu_bytes": None if gpu_peak is None or base_gpu is None else gpu_peak - base_gpu,
            "samples": runs,
            "phases": _phase_medians(runs),
        }
        if bound := (possible_shared if method in _COLLECTIVE else possible):
            result.update(possible_per_iteration_s=bound, steady_of_possible=steady / bound, of_possible=per / bound)
        results.append(result)
    return {
        "schema": SCHEMA,
        "machine": machine_info(args.dir, device=args.device),
        "config": {k: getattr(args, k) for k in (*_RUN_OPTIONS, "repeats")},
        "checkpoint_bytes": checkpoint_bytes,
        "d2h_seconds": _measure_d2h(args),
        "write_ceiling": ceiling,
        "possible_per_iteration_s": possible,
        "possible_alone_per_iteration_s": alone,
        "shared_write_ceiling": shared,
        "possible_collective_per_iteration_s": possible_shared,
        "results": results,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def _setting(document: dict[str, Any]) -> str:
    """The first paragraph of :func:`to_markdown`: what ran where, the loop's own time and the storage ceiling."""
    config, machine, ceiling = document["config"], document["machine"], document.get("write_ceiling")
    base = next(r for r in document["results"] if r["method"] == "none" and "error" not in r)
    # Runs before the bound was measured also saved during the warm-up and after every `every`-th iteration.
    cadence = "the first after the first timed iteration" if "write_ceiling" in document else "warm-up saves untimed"
    text = (
        f"Device `{config['device']}` ({machine.get('device_name')}, {machine.get('cpu_count')} CPUs), checkpoint "
        f"{document['checkpoint_bytes'] / 1e6:,.0f} MB (model + AdamW) to `{config['dir']}`, {config['iterations']} "
        f"iterations, checkpoint every {config.get('every', 1)} ({cadence}), "
    )
    if config.get("ranks", 1) > 1:
        text += f"{config['ranks']} data-parallel ranks (DDP, rank 0's times), "
    text += f"median of {config['repeats']}; iteration without checkpoint {_ms(base['steady_per_iteration_s'])} ms"
    if document.get("d2h_seconds"):
        text += f", device-to-host copy of the state {_ms(document['d2h_seconds'])} ms"
    if ceiling:
        ways = ", ".join(f"{k} {_ms(v)} ms" for k, v in ceiling["seconds"].items())
        text += f"; storage ceiling: one checkpoint written in {_ms(ceiling['best_s'])} ms "
        text += f"({ceiling['bytes'] / ceiling['best_s'] / 1e9:.2f} GB/s, {ceiling['best']}; {ways})"
        if row := ceiling.get("in_a_row_s"):
            each = f"{_ms(ceiling['sustained_s'])} ms per checkpoint (writes {', '.join(_ms(s) for s in row)} ms)"
            text += f"; {len(row)} in a row ({ceiling['in_a_row']}), each freeing the last: {each}"
    return text + "."


def to_markdown(document: dict[str, Any]) -> str:
    """The result as Markdown: one row per method against the bound, then where each save's time goes."""
    every, lines = document["config"].get("every", 1), [_setting(document), ""]
    if possible := document.get("possible_per_iteration_s"):
        alone = document.get("possible_alone_per_iteration_s")  # None in runs before 2026-12-02
        how = "the faster of a checkpoint written alone and in a row" if alone else "ceiling write"
        text = f"Possible (the bound): max(iteration, {how} / {every}) = {_ms(possible)} ms per iteration"
        lines += [text + (f"; with one checkpoint's write alone, {_ms(alone)} ms." if alone else "."), ""]
    shared, possible_shared = document.get("shared_write_ceiling"), document.get("possible_collective_per_iteration_s")
    if shared and possible_shared:
        lines += [
            f"Possible for the collective methods: max(iteration, the slowest of {shared['writers']} concurrent "
            f"writers' share / {every}) = {_ms(possible_shared)} ms per iteration ({shared['writers']} writers "
            f"wrote {shared['bytes'] / 1e6:,.0f} MB together in {_ms(shared['per_writer_s'])} ms).",
            "",
        ]
    header = ["method", "ms / iteration (steady)", "× possible", "with the final wait", "overhead (steady)"]
    header += ["overhead", "blocked per save (ms)", "first save blocked (ms)", "extra peak GPU (MiB)"]
    lines += markdown_table([*header, "extra peak host RSS (MiB)"], "<" + ">" * 9, [])
    for r in document["results"]:
        if "error" in r:
            lines.append(f"| {r['method']} | failed | | | | | | | | |")
            continue
        firsts = [s["first_blocked_s"] * 1000 for s in r["samples"] if "first_blocked_s" in s]
        lines.append(
            f"| {r['method']} | {_ms(r['steady_per_iteration_s'])} | {figure(r.get('steady_of_possible') or None)} | "
            f"{_ms(r['per_iteration_s'])} | {r['steady_overhead_pct']:+.1f}% | {r['overhead_pct']:+.1f}% | "
            f"{_ms(r['blocked_per_save_s'])} | {f'{statistics.median(firsts):.1f}' if firsts else '-'} | "
            f"{_mib(r['extra_gpu_bytes'])} | {_mib(r['extra_host_bytes'])} |"
        )
    phased = [r for r in document["results"] if "error" not in r and r.get("phases")]
    names = [name for name, _, _ in _PHASES if any(name in r["phases"] for r in phased)]  # the phases some save had

    def cell(phases: dict[str, float], name: str) -> str:  # the median ms, the first save's in brackets
        value, first = phases.get(name), phases.get("first " + name)
        return ("-" if value is None else _ms(value)) + ("" if first is None else f" ({_ms(first)})")

    if phased:
        collective = " (for the collective methods " if any(r["method"] in _COLLECTIVE for r in phased) else ""
        if "verify" in names:
            collective += "`pickle` includes the plan's exchange and `copies queued` the `verify` exchange)"
        elif collective:
            collective += "`open` is the plan's and the verify's exchanges, on the save thread)"
        caption = (
            "Where a save's time goes (median ms over the saves after the first; the first save's in brackets): "
            f"`pickle`, `wait for slot` and `copies queued` are the caller's{collective}; the rest runs in the "
            "background (in the caller for fastpersist-sync). `read`: until the last device-to-host copy is queued; "
            "`write`: until the last byte is written."
        )
        rows = [[r["method"], *(cell(r["phases"], name) for name in names)] for r in phased]
        lines += ["", caption, "", *markdown_table(["method", *names], "<" + ">" * len(names), rows)]
    return "\n".join(lines) + "\n"


def to_svg(documents: list[dict[str, Any]]) -> str:
    """A horizontal bar chart of the overhead per method, one panel per document."""
    bar, gap, left, width = 18, 6, 190, 420
    svg, y = Svg(), 10
    for document in documents:
        rows = [r for r in document["results"] if r["method"] != "none" and "error" not in r]
        top = max([abs(r["overhead_pct"]) for r in rows] + [5.0])
        title = f"{document['machine'].get('device_name')} ({document['config']['device']}): overhead per iteration"
        svg.title(y + 14, title)
        y += 24
        for r in rows:
            length = width * max(r["overhead_pct"], 0) / top
            color = "#2a7" if r["method"].startswith("fastpersist-") and r["method"] != "fastpersist-sync" else "#888"
            svg.label(left - 6, y + 13, r["method"])
            svg.bar(left, y, length, bar, color)
            svg.text(f"{left + length + 4:.1f}", y + 13, f"{r['overhead_pct']:+.1f}%")
            y += bar + gap
        five = left + width * 5 / top
        svg.line(five, y - (bar + gap) * len(rows), five, y, 'stroke="#c33" stroke-dasharray="4,3"')
        svg.text(f"{five + 3:.1f}", y + 12, "5%", 11, ' fill="#c33"')
        y += 26
    return svg.document(left + width + 90, y + 10)


def _options(parser: argparse.ArgumentParser) -> None:
    import torch

    gpu = torch.cuda.is_available()
    option(parser, "dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    option(parser, "device", choices=["cpu", "cuda"], default="cuda" if gpu else "cpu")
    # GPU defaults: a ~0.25 GB checkpoint (21M parameters + AdamW) whose write (~2 GB/s) hides behind one iteration.
    sizes = {"--d-model": (512, 256), "--layers": (4, 2), "--heads": (8, 4), "--vocab": (8192, 2048)}
    sizes.update({"--batch": (64, 8), "--seq": (2048, 64), "--iterations": (20, 8), "--warmup": (3, 2)})
    for flag, (on_gpu, on_cpu) in sizes.items():
        parser.add_argument(flag, type=int, default=on_gpu if gpu else on_cpu)
    parser.add_argument("--every", type=int, default=1, help="checkpoint every N iterations (default: every one)")
    layout = "with --ranks: the collective methods' layout (parts: one file per writer, for node-local storage)"
    parser.add_argument("--layout", choices=["file", "parts"], default="file", help=layout)
    option(parser, "repeats", default=1, help="runs of each method, in alternating order")
    ranks = "data-parallel processes (one per GPU, DDP); methods then: " + ",".join(RANK_METHODS)
    parser.add_argument("--ranks", type=int, default=1, help=ranks)
    parser.add_argument("--methods", default=None, help=f"comma list (default: all of {','.join(METHODS)})")
    prepare = "Checkpointer methods: call Checkpointer.prepare after the warm-up (default true; 'false' times the "
    prepare += "first save's allocation in the loop)"
    on = ("1", "true", "yes", "on")
    parser.add_argument("--prepare", type=lambda text: text.lower() in on, default=True, help=prepare)
    parser.add_argument("--no-ceiling", action="store_true", help="do not measure the storage's write ceiling")
    timeline = "write every rank's raw timeline of each method (save phases, exchanges, the step's waits) here"
    parser.add_argument("--timeline", metavar="DIR", default=None, help=timeline)
    parser.add_argument("--method", help=argparse.SUPPRESS)


BENCHMARK = Benchmark(
    "training", _options, _measure, to_markdown, __doc__.partition("\n")[0], SCHEMA, svg=to_svg, child=_run_one
)
main = BENCHMARK.main
