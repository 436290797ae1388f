"""``fastpersist tune``: measure which settings save and load fastest on one filesystem.

The tuner saves and loads a synthetic checkpoint with fastpersist's own
``save`` / ``load`` in a temporary directory inside ``--dir``, sweeping one
setting at a time (engine, direct I/O, block size, queue depth, lanes, staging
buffer size and count) while the others stay at their best value so far.
Every point is timed to durability (fsync) and, for loads, with the page cache
dropped; every load is compared byte for byte with what was saved; each point
is repeated, values of a setting are interleaved round by round, and medians
decide. A value replaces the current one only when it beats it by more than
``--threshold`` (noise is not a reason to change a default). Finally the
recommendation is measured against the defaults, head to head.

The result is a configuration file written with
:func:`fastpersist.config.save_file`; use it with
``export FASTPERSIST_CONFIG=PATH`` or ``fastpersist.config.load_file(PATH)``.
See docs/tuning.md.

Programmatic use: :func:`add_arguments` and :func:`run` (what the
``fastpersist tune`` subcommand calls); :func:`sweep` for a custom backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastpersist import config, display, system
from fastpersist.errors import UsageError
from fastpersist.tuning import deepnvme, measure, workloads

__all__ = [
    "Knob",
    "KNOBS",
    "QUICK_KNOBS",
    "Backend",
    "FastpersistBackend",
    "GdsHandleBackend",
    "Point",
    "SweepResult",
    "sweep",
    "add_arguments",
    "run",
    "main",
]

_MiB = 1 << 20
DEFAULT_OUT = "fastpersist-config.json"


@dataclasses.dataclass(frozen=True)
class Knob:
    """One setting to sweep and the values to try."""

    name: str
    values: tuple[Any, ...]
    what: str


def _sizes(*mib: int) -> tuple[int, ...]:
    return tuple(m * _MiB for m in mib)


def _lanes(limit: int) -> tuple[int, ...]:
    cpus = os.cpu_count() or 1
    return tuple(n for n in (1, 2, 4, 8) if n <= max(limit, 1) and (n == 1 or n <= cpus))


KNOBS: tuple[Knob, ...] = (
    Knob("engine", ("auto", "io_uring", "threads"), "I/O engine"),
    Knob("direct", (True, False), "O_DIRECT (bypass the page cache)"),
    Knob("block_size", _sizes(1, 2, 4, 8, 16, 32), "bytes per I/O request"),
    Knob("queue_depth", (4, 8, 16, 32, 64), "requests in flight per lane"),
    Knob("intra_op_parallelism", _lanes(8), "lanes splitting one request"),
    Knob("buffer_size", _sizes(16, 32, 64, 128, 256), "bytes per staging buffer"),
    Knob("buffer_count", (2, 3, 4, 8), "staging buffers in the save ring"),
    Knob("read_buffer_size", _sizes(4, 16, 64), "bytes per CUDA-load ring buffer (only matters with --device cuda)"),
    Knob("read_buffer_count", (8, 16, 32), "buffers in the CUDA-load ring (only matters with --device cuda)"),
    Knob("single_submit", (False, True), "one system call per request (io_uring)"),
    Knob("overlap_events", (True, False), "reap completions while submitting"),
    Knob("huge_pages", (True, False), "transparent huge pages for staging rings and load destinations"),
)
QUICK_KNOBS: tuple[Knob, ...] = (
    Knob("engine", ("auto", "io_uring", "threads"), "I/O engine"),
    Knob("direct", (True, False), "O_DIRECT (bypass the page cache)"),
    Knob("block_size", _sizes(2, 8, 16), "bytes per I/O request"),
    Knob("queue_depth", (8, 16, 32), "requests in flight per lane"),
    Knob("intra_op_parallelism", _lanes(2), "lanes splitting one request"),
    Knob("buffer_size", _sizes(32, 64, 128), "bytes per staging buffer"),
    Knob("buffer_count", (2, 4), "staging buffers in the save ring"),
    Knob("huge_pages", (True, False), "transparent huge pages for staging rings and load destinations"),
)


# ============================================================================ backend


class Backend:
    """How the tuner saves and loads. Implementations must make ``save`` durable on return."""

    name = "backend"

    def unavailable(self) -> str | None:
        return None

    def defaults(self) -> dict[str, Any]:
        """The settings in force without tuning (the starting point of the sweep)."""
        raise NotImplementedError

    def validate(self, values: dict[str, Any]) -> None:
        """Raises (ValueError / ConfigError) when ``values`` are not a valid combination."""

    def save(self, state: Any, path: str, settings: dict[str, Any]) -> None:
        raise NotImplementedError

    def load(self, path: str, settings: dict[str, Any], device: torch.device) -> Any:
        raise NotImplementedError


class FastpersistBackend(Backend):
    """fastpersist.save / fastpersist.load with per-call setting overrides."""

    name = "fastpersist"

    def __init__(self) -> None:
        self._api: Any = None
        self._reason: str | None = None
        try:
            import fastpersist

            fastpersist.save, fastpersist.load  # noqa: B018
            self._api = fastpersist
        except Exception as e:  # noqa: BLE001 - any reason it cannot run is reported, not raised
            self._reason = f"fastpersist.save is not importable ({type(e).__name__}: {e})"

    def unavailable(self) -> str | None:
        return self._reason

    def defaults(self) -> dict[str, Any]:

        return config.settings().as_dict()

    def validate(self, values: dict[str, Any]) -> None:

        config.settings().replace(**values)

    def save(self, state, path, settings):
        self._api.save(state, path, **dict(settings, fsync=True))

    def load(self, path, settings, device):
        return self._api.load(path, map_location=device, **settings)


class GdsHandleBackend(Backend):
    """``fastpersist tune --gds`` (ds_nvme_tune's ``--gds``): each tensor written and read by a ``GdsHandle``.

    A save writes every tensor of the state back to back into one file with
    ``sync_pwrite`` at increasing offsets; a load reads each into a new tensor
    on the device. The settings swept are the handle's constructor arguments
    (``block_size``, ``queue_depth``, ``intra_op_parallelism``,
    ``single_submit``, ``overlap_events``); the data path is the ``gds_path``
    setting's. The layout of the last save of each path is kept in memory.
    """

    name = "gds_handle"
    KNOBS = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")
    DEFAULTS = {"block_size": 1 << 20, "queue_depth": 128, "intra_op_parallelism": 1, "single_submit": False}

    def __init__(self) -> None:
        self._layouts: dict[str, list[tuple[str, int, torch.Size, torch.dtype]]] = {}
        self._handles: dict[tuple[Any, ...], Any] = {}
        self.path: str | None = None
        """The data path the handles took (``cufile`` or ``bounce``), once one was made."""

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "--gds needs a CUDA device (GdsHandle moves CUDA tensors)"
        return None

    def defaults(self) -> dict[str, Any]:
        """DeepNVMe's ``gds_handle()`` defaults."""
        return dict(self.DEFAULTS, overlap_events=False)

    def validate(self, values: dict[str, Any]) -> None:
        unknown = sorted(set(values) - set(self.KNOBS))
        if unknown:
            raise ValueError(f"GdsHandle has no setting {', '.join(unknown)}")

    def _handle(self, settings: dict[str, Any]) -> Any:
        from fastpersist.deepnvme.gds import GdsHandle

        values = dict(self.defaults(), **{k: v for k, v in settings.items() if k in self.KNOBS})
        key = tuple(values[k] for k in self.KNOBS)
        handle = self._handles.get(key)
        if handle is None:
            handle = self._handles[key] = GdsHandle(*key)
            self.path = handle.path
        return handle

    def save(self, state, path, settings):
        handle = self._handle(settings)
        layout = []
        offset = 0
        for key, tensor in workloads.flatten_state(state)[0].items():
            data = tensor.contiguous()
            handle.sync_pwrite(data, path, offset)
            layout.append((key, offset, data.shape, data.dtype))
            offset += data.numel() * data.element_size()
        self._layouts[path] = layout

    def load(self, path, settings, device):
        handle = self._handle(settings)
        loaded = {}
        for key, offset, shape, dtype in self._layouts[path]:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            handle.sync_pread(tensor, path, offset)
            loaded[key] = tensor
        return loaded


# ============================================================================ measuring


@dataclasses.dataclass
class Point:
    """One setting combination and its measurements (seconds per round)."""

    knob: str
    value: Any
    settings: dict[str, Any]
    save_seconds: list[float] = dataclasses.field(default_factory=list)
    load_seconds: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None

    def median(self, which: str) -> float | None:
        s = measure.summarize(getattr(self, f"{which}_seconds"))
        return s["median"] if s else None

    def gbps(self, which: str, nbytes: int) -> float | None:
        m = self.median(which)
        return nbytes / m / 1e9 if m else None

    def score(self, nbytes: int, objective: str) -> float | None:
        """GB/s of the objective: save, load, or both (bytes saved + loaded / total time)."""
        if self.error:
            return None
        if objective == "save":
            return self.gbps("save", nbytes)
        if objective == "load":
            return self.gbps("load", nbytes)
        totals = [save + load for save, load in zip(self.save_seconds, self.load_seconds)]
        summary = measure.summarize(totals)
        return 2 * nbytes / summary["median"] / 1e9 if summary else None

    def as_dict(self, nbytes: int, objective: str) -> dict[str, Any]:
        return {
            "knob": self.knob,
            "value": self.value,
            "save_gbps": self.gbps("save", nbytes),
            "load_gbps": self.gbps("load", nbytes),
            "score_gbps": self.score(nbytes, objective),
            "save_seconds": self.save_seconds,
            "load_seconds": self.load_seconds,
            "error": self.error,
        }


@dataclasses.dataclass
class SweepResult:
    """What :func:`sweep` found."""

    recommended: dict[str, Any]
    defaults: dict[str, Any]
    stages: list[tuple[Knob, list[Point], Any]]
    final: dict[str, Point]
    state_bytes: int
    objective: str
    notes: list[str]

    def improvement(self) -> float | None:
        base = self.final["default"].score(self.state_bytes, self.objective)
        best = self.final["recommended"].score(self.state_bytes, self.objective)
        return best / base if base and best else None


def _measure_point(
    backend: Backend,
    point: Point,
    state: Any,
    expected: tuple[dict[str, torch.Tensor], dict[str, Any]],
    directory: str,
    device: torch.device,
    dropper: system.CacheDropper,
    index: int,
) -> None:
    path = os.path.join(directory, f"tune-{index}.pt")
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        backend.save(state, path, point.settings)
        measure.fsync_paths(path)
        save_seconds = time.perf_counter() - start
        dropper.drop([path])
        start = time.perf_counter()
        loaded = backend.load(path, point.settings, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            measure.touch_pages(loaded)
        load_seconds = time.perf_counter() - start
        problem = measure.verify_state(expected, (workloads.flatten_state(loaded)[0], None))
        del loaded
        if problem:
            point.error = f"loaded bytes differ from the saved ones ({problem})"
            return
        point.save_seconds.append(save_seconds)
        point.load_seconds.append(load_seconds)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a failing point is recorded and never chosen
        point.error = f"{type(e).__name__}: {e}"
    finally:
        measure.remove_path(path)
        system.release_memory(collect=False)  # the loaded state is freed by reference counting


def sweep(
    backend: Backend,
    state: Any,
    directory: str,
    *,
    knobs: Sequence[Knob] = QUICK_KNOBS,
    repeats: int = 2,
    objective: str = "both",
    threshold: float = 0.05,
    device: torch.device | str = "cpu",
    dropper: system.CacheDropper | None = None,
    progress: Callable[[str], None] | None = None,
    within_values: bool = False,
) -> SweepResult:
    """Coordinate descent over ``knobs`` with ``backend``, writing only inside ``directory``.

    For each knob in order, every value is measured ``repeats`` times
    (rounds interleave the values), with the other knobs at their best value
    so far. The best median score is adopted only if it beats the current
    value's by more than ``threshold`` (0.05 = 5 %). Values the backend
    rejects (invalid combination, engine that cannot start) or that fail
    (an error, or loaded bytes that differ) are reported and never chosen.
    Ends with a head-to-head of the recommendation against the defaults.
    ``within_values`` (``ds_nvme_tune``'s ``--sweep_config``): the knobs'
    values are the whole space; a default outside them is neither measured
    nor kept, and the recommendation is the best measured point.

    Raises:
        KeyboardInterrupt: passed through; the caller removes ``directory``.
    """
    if objective not in ("both", "save", "load"):
        raise ValueError(f"objective must be both, save or load, got {objective!r}")
    device = torch.device(device)
    dropper = dropper or system.CacheDropper()
    progress = progress or (lambda _text: None)
    expected = workloads.flatten_state(state)
    nbytes = sum(t.numel() * t.element_size() for t in expected[0].values())
    defaults = backend.defaults()
    current = {k.name: defaults[k.name] for k in knobs}
    stages: list[tuple[Knob, list[Point], Any]] = []
    notes: list[str] = []
    counter = [0]

    def run_points(points: list[Point]) -> None:
        for round_index in range(repeats):
            live = [p for p in points if p.error is None]
            shift = round_index % max(len(live), 1)
            for point in live[shift:] + live[:shift]:
                counter[0] += 1
                progress(f"{point.knob}={_show(point.knob, point.value)} (round {round_index + 1}/{repeats})")
                _measure_point(backend, point, state, expected, directory, device, dropper, counter[0])

    for knob in knobs:
        points = []
        for value in knob.values:
            values = dict(current, **{knob.name: value})
            point = Point(knob.name, value, values)
            try:
                backend.validate(values)
            except Exception as e:  # noqa: BLE001 - an invalid combination is recorded and skipped
                point.error = f"not a valid combination: {e}"
            points.append(point)
        outside = not any(p.value == current[knob.name] for p in points)
        if outside and within_values:
            current[knob.name] = knob.values[0]  # the space is the given values: start from the first
        elif outside:
            points.insert(0, Point(knob.name, current[knob.name], dict(current)))
        run_points(points)
        incumbent = next(p for p in points if p.value == current[knob.name])
        base = None if outside and within_values else incumbent.score(nbytes, objective)
        scored = [(p.score(nbytes, objective), p) for p in points if p.score(nbytes, objective) is not None]
        chosen = current[knob.name]
        if scored:
            best_score, best = max(scored, key=lambda sp: sp[0])
            if base is None or best_score > base * (1 + threshold):
                chosen = best.value
        else:
            notes.append(f"{knob.name}: every value failed; kept {current[knob.name]!r}")
        current[knob.name] = chosen
        stages.append((knob, points, chosen))

    final = {
        "default": Point("final", "default", {k.name: defaults[k.name] for k in knobs}),
        "recommended": Point("final", "recommended", dict(current)),
    }
    run_points(list(final.values()))
    result = SweepResult(current, {k.name: defaults[k.name] for k in knobs}, stages, final, nbytes, objective, notes)
    ratio = result.improvement()
    if current != result.defaults and (ratio is None or ratio < 1 + threshold / 2) and not within_values:
        notes.append(
            "the recommendation did not beat the defaults head to head "
            f"({'failed' if ratio is None else f'{ratio:.2f}x'}); recommending the defaults"
        )
        result.recommended = dict(result.defaults)
    return result


# ============================================================================ output


def _show(name: str, value: Any) -> str:
    if name in ("block_size", "buffer_size") and isinstance(value, int):
        return f"{value // _MiB}M" if value % _MiB == 0 else f"{value // 1024}K"
    return str(value)


def _fmt(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "-"


def format_sweep(result: SweepResult) -> str:
    """The sweep as a table: one row per value tried, the chosen value of each knob marked."""
    n, obj = result.state_bytes, result.objective
    header = ("setting", "value", "save GB/s", "load GB/s", f"score ({obj})", "")
    rows: list[tuple[str, ...]] = []
    for knob, points, chosen in result.stages:
        for i, p in enumerate(points):
            mark = "<- chosen" if p.value == chosen else ""
            if p.error:
                mark = "failed: " + (p.error if len(p.error) < 70 else p.error[:67] + "...")
            rows.append(
                (
                    knob.name if i == 0 else "",
                    _show(knob.name, p.value),
                    _fmt(p.gbps("save", n)),
                    _fmt(p.gbps("load", n)),
                    _fmt(p.score(n, obj)),
                    mark,
                )
            )
    for label, p in result.final.items():
        rows.append(
            (
                "head to head" if label == "default" else "",
                label,
                _fmt(p.gbps("save", n)),
                _fmt(p.gbps("load", n)),
                _fmt(p.score(n, obj)),
                p.error or "",
            )
        )
    return display.format_table(header, rows, "<<>>><")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``fastpersist tune`` options to ``parser``."""
    parser.add_argument(
        "--dir",
        default=".",
        help="a directory on the filesystem to tune for; a temporary subdirectory is used and removed "
        "(default: the current directory)",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"where to write the recommended configuration, for FASTPERSIST_CONFIG (default: ./{DEFAULT_OUT})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer values, a smaller state and 2 repeats (about a minute on a small machine)",
    )
    parser.add_argument("--size", default=None, help="checkpoint size to test with (default 1G; --quick: 512M)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds per value (default 3; --quick: 2)")
    parser.add_argument(
        "--optimize",
        choices=("both", "save", "load"),
        default="both",
        help="what to make fast: save + load time together (default), or one of them",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="minimum relative gain to move a setting off its current value (default: 0.05 = 5%%)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where the tensors live: cpu (default), or cuda to tune GPU checkpoints"
    )
    parser.add_argument(
        "--dtype", choices=sorted(workloads.DTYPES), default="bf16", help="tensor dtype (default: bf16)"
    )
    parser.add_argument(
        "--model",
        default=workloads.DEFAULT_MODEL,
        help="whose tensor shapes the test checkpoint has, as many blocks as fit in --size "
        f"(default: {workloads.DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--settings",
        default=None,
        help="comma-separated subset of settings to sweep (default: all of " + ", ".join(k.name for k in KNOBS) + ")",
    )
    parser.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before loads")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every measurement here")
    deepnvme.add_arguments(parser)


def run(args: argparse.Namespace, *, backend: Backend | None = None) -> int:
    """Runs ``fastpersist tune`` with parsed ``args``.

    Returns:
        0 when a configuration was written; 2 when it could not start (no
        fastpersist, bad directory or options); 130 when interrupted (nothing
        written, temporary files removed).
    """
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    args = argparse.Namespace(**{**vars(defaults.parse_args([])), **vars(args)})
    try:
        job = _job(args, backend)
    except UsageError as e:
        print(f"fastpersist tune: {e}", file=sys.stderr)
        return 2
    swept = _sweep_job(args, job)
    if swept is None:
        return 130
    _write_and_report(args, job, *swept)
    return 0


@dataclasses.dataclass(frozen=True)
class _Job:
    """What one ``fastpersist tune`` measures, from its checked options."""

    backend: Backend
    knobs: tuple[Knob, ...]
    repeats: int
    directory: str
    out: str
    device: torch.device
    spec: Any
    dtype: torch.dtype
    layers: int
    nbytes: int


def _job(args: argparse.Namespace, backend: Backend | None) -> _Job:
    """The measurement ``args`` ask for (ds_nvme_tune's options applied first), checked before anything runs.

    Raises:
        UsageError: options that cannot run as given here (the message says why): unknown settings, no
            backend, a missing directory, a bad device or size, too little free space.
    """
    deepnvme.apply(args)
    if args.verbose:
        print(f"args = {args}", file=sys.stderr)
    if deepnvme.is_ds_nvme_tune(args):
        print(f"Running DeepNVMe performance tuning on {args.nvme_dir}", file=sys.stderr)
    backend = backend or (GdsHandleBackend() if getattr(args, "gds", False) else FastpersistBackend())
    reason = backend.unavailable()
    if reason:
        raise UsageError(reason)
    quick = bool(getattr(args, "quick", False))
    knobs = _knobs(args, quick)
    repeats = args.repeats if getattr(args, "repeats", None) else (2 if quick else 3)
    size_text = args.size or ("512M" if quick else "1G")
    directory = os.path.abspath(args.dir)
    out = os.path.abspath(args.out)
    if repeats < 1:
        raise UsageError("--repeats must be at least 1")
    if not os.path.isdir(directory):
        raise UsageError(f"--dir {directory} is not a directory")
    if not os.path.isdir(os.path.dirname(out)):
        raise UsageError(f"cannot write {out}: its directory does not exist")
    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("no CUDA device is available")
        if device.type not in ("cpu", "cuda"):
            raise ValueError("use cpu or cuda[:N]")
        target = config.parse_size(size_text)
        spec = workloads.get_model(getattr(args, "model", workloads.DEFAULT_MODEL))
        dtype = workloads.DTYPES[getattr(args, "dtype", "bf16")]
        layers = workloads.layers_for_size(spec, target, dtype)
    except (ValueError, KeyError, RuntimeError) as e:
        raise UsageError(f"{e}") from None
    nbytes = workloads.state_bytes(spec, dtype, layers)
    free = system.filesystem_of(directory).get("free_bytes")
    if free is not None and free < 2 * nbytes:
        raise UsageError(
            f"{directory} has {workloads.format_bytes(free)} free; need about {workloads.format_bytes(2 * nbytes)}"
        )
    return _Job(backend, knobs, repeats, directory, out, device, spec, dtype, layers, nbytes)


def _knobs(args: argparse.Namespace, quick: bool) -> tuple[Knob, ...]:
    """The settings to sweep: ``--settings`` picks among them, ``knob_values`` (ds_nvme_tune's sweep) sets values.

    Raises:
        UsageError: ``--settings`` names a setting that cannot be swept.
    """
    knobs = QUICK_KNOBS if quick else KNOBS
    if getattr(args, "settings", None):
        wanted = [s.strip() for s in args.settings.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in {k.name for k in KNOBS}]
        if unknown:
            raise UsageError(f"cannot sweep {', '.join(unknown)}; choose from {', '.join(k.name for k in KNOBS)}")
        knobs = tuple(k for k in knobs if k.name in wanted)
    if args.knob_values:
        described = {k.name: k.what for k in KNOBS}
        knobs = tuple(
            Knob(name, values, described[name])
            for name, values in args.knob_values.items()
            if not getattr(args, "settings", None) or name in {k.name for k in knobs}
        )
    return knobs


def _sweep_job(args: argparse.Namespace, job: _Job) -> tuple[SweepResult, float, str] | None:
    """Runs the sweep in a temporary directory under ``job.directory`` (removed at the end, whatever happens).

    Returns:
        The result, the seconds it took and how the page cache was dropped
        (``CacheDropper.mode``); None when interrupted (Ctrl-C or SIGTERM;
        said on stderr).
    """
    dropper = system.CacheDropper(enabled=not getattr(args, "no_drop_caches", False))
    points = sum(len(k.values) for k in job.knobs) * job.repeats + 2 * job.repeats
    print(
        f"tuning fastpersist for {job.directory} with a {workloads.format_bytes(job.nbytes)} "
        f"{getattr(args, 'dtype', 'bf16')} checkpoint on {job.device}: {len(job.knobs)} settings, ~{points} "
        f"save+load rounds, optimizing {args.optimize}",
        file=sys.stderr,
    )
    print(f"  {dropper.detail}", file=sys.stderr)
    work = None
    started = time.perf_counter()
    progress = display.Progress(points, approximate=True)
    with measure.sigterm_as_interrupt():
        try:
            work = tempfile.mkdtemp(prefix=".fastpersist-tune-", dir=job.directory)
            state = workloads.build_state(job.spec, dtype=job.dtype, device=job.device, layers=job.layers)
            result = sweep(
                job.backend,
                state,
                work,
                knobs=job.knobs,
                repeats=job.repeats,
                within_values=bool(getattr(args, "knob_values", None)),
                objective=args.optimize,
                threshold=args.threshold,
                device=job.device,
                dropper=dropper,
                progress=progress,
            )
            del state
            if isinstance(job.backend, GdsHandleBackend):
                result.notes.append(f"GdsHandle data path: {job.backend.path} (gds_path setting; see fastpersist info)")
        except KeyboardInterrupt:
            progress.close()
            print("fastpersist tune: interrupted; temporary files removed, nothing written", file=sys.stderr)
            return None
        finally:
            if work is not None:
                measure.remove_path(work)
            progress.close()
    return result, time.perf_counter() - started, dropper.mode


def _write_and_report(args: argparse.Namespace, job: _Job, result: SweepResult, elapsed: float, cache: str) -> None:
    """Writes the recommended settings to ``job.out`` (and ``--json``, ``--log_dir``'s aio_config.json) and
    prints the sweep, the gain and how to use the file."""
    nbytes, directory, device = job.nbytes, job.directory, job.device
    machine = measure.machine_info(directory, str(device))
    sweep_rows = [p.as_dict(nbytes, args.optimize) for _, pts, _ in result.stages for p in pts]
    final = {label: p.as_dict(nbytes, args.optimize) for label, p in result.final.items()}
    measured = {
        "date": machine["date"],
        "dir": directory,
        "filesystem": machine.get("filesystem"),
        "device": str(device),
        "state_bytes": nbytes,
        "dtype": str(job.dtype).replace("torch.", ""),
        "repeats": job.repeats,
        "objective": args.optimize,
        "threshold": args.threshold,
        "cache": cache,
        "default": final["default"],
        "recommended": final["recommended"],
        "improvement": result.improvement(),
        "notes": result.notes,
        "elapsed_seconds": elapsed,
        "sweep": sweep_rows,
    }

    out = job.out
    config.save_file(out, result.recommended, measured=measured, machine=machine)
    if getattr(args, "json", None):
        measure.write_json(
            {"schema": "fastpersist.tune/1", "settings": result.recommended, "measured": measured, "machine": machine},
            args.json,
        )

    print(format_sweep(result))
    print()
    for note in result.notes:
        print(f"note: {note}")
    ratio = result.improvement()
    d, r = final["default"], final["recommended"]
    print(
        f"defaults:    save {_fmt(d['save_gbps'])} GB/s, load {_fmt(d['load_gbps'])} GB/s\n"
        f"recommended: save {_fmt(r['save_gbps'])} GB/s, load {_fmt(r['load_gbps'])} GB/s"
        + (f"  ({ratio:.2f}x on {args.optimize})" if ratio else "")
    )
    changed = {k: v for k, v in result.recommended.items() if v != result.defaults.get(k)}
    if changed:
        print("changed from the defaults: " + ", ".join(f"{k}={_show(k, v)}" for k, v in changed.items()))
    else:
        print("the defaults are already the best measured here; the file pins them")
    print()
    aio_text = deepnvme.format_aio(result.recommended, r["load_gbps"], r["save_gbps"])
    print(aio_text)
    if args.log_dir is not None:
        with open(os.path.join(args.log_dir, "aio_config.json"), "w") as f:
            f.write(aio_text.split("\n", 1)[1] + "\n")
    print(f"\nwrote {out} ({elapsed:.0f} s). To use it:")
    print(f"  export FASTPERSIST_CONFIG={out}")
    print("or in Python, before saving or loading:")
    print(f"  fastpersist.config.load_file({out!r})")


def main(argv: list[str] | None = None) -> int:
    """``python -m fastpersist.tuning.tuner`` (the same as ``fastpersist tune``)."""
    parser = argparse.ArgumentParser(
        prog="fastpersist tune",
        description="Find the fastest fastpersist settings for a filesystem and write them to a configuration file.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
