"""The one runner of every benchmark subcommand: command line, rounds, child processes, document, tables, charts."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import random
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from fastpersist import config
from fastpersist.tuning import workloads
from fastpersist.tuning.measure import summarize, verify_state, write_json

__all__ = [
    "Benchmark",
    "Rounds",
    "Svg",
    "UsageError",
    "bf16_state",
    "check",
    "figure",
    "free_port",
    "markdown_table",
    "option",
    "ratios",
    "read_document",
    "size",
    "spawn",
    "summarize",
    "timed",
    "write_json",
]

size = config.size_argument  # the one size syntax of every option (binary units: 4G = 4 GiB)


class UsageError(ValueError):
    """A command line that cannot run as given; the message says what to use instead (a usage error, exit 2)."""


_OPTIONS: dict[str, dict[str, Any]] = {  # the shared options, by name (their flag: --name with dashes)
    "dir": {"help": "directory on the storage to measure (default: a temporary one)"},
    "json": {"metavar": "PATH", "help": "write the result document here"},
    "report": {"nargs": "+", "metavar": "JSON", "help": "do not measure: print the tables of earlier --json documents"},
    "svg": {"metavar": "PATH", "help": "write a chart of the documents here"},
    "repeats": {"type": int, "default": 3, "help": "timed rounds, the methods interleaved; medians are reported"},
    "device": {"default": "cpu", "help": "where the state lives and loads go: cpu or cuda[:N]"},
    "size": {"type": size, "help": "bytes (binary units: 4G = 4 GiB)"},
    "no_drop_caches": {"action": "store_true", "help": "warm loads: leave the page cache alone before each load"},
}


def option(parser: argparse.ArgumentParser | Any, name: str, *flags: str, **changes: Any) -> None:
    """Adds the shared option ``name`` to ``parser``; ``flags`` rename it, ``changes`` override its settings."""
    parser.add_argument(*(flags or ["--" + name.replace("_", "-")]), **{**_OPTIONS[name], **changes})


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One subcommand, declared as data (``BENCHMARK = Benchmark(...)``, ``main = BENCHMARK.main``)."""

    name: str
    options: Callable[[argparse.ArgumentParser], None]  # adds its own options (the shared ones: option())
    # The document of the arguments (None: nothing to report); may raise UsageError or SystemExit(status).
    measure: Callable[[argparse.Namespace], dict[str, Any] | None]
    markdown: Callable[[dict[str, Any]], str] | None  # one document as Markdown (None: no table)
    description: str = ""
    schema: str | None = None  # the prefix of its documents' schema, checked when --report reads one
    show: Callable[[dict[str, Any]], str] | None = None  # the terminal's text (default: markdown)
    # (path, document) pairs as Markdown: what --report prints and the docs' block holds (default: render_documents)
    render: Callable[[list[tuple[str, dict[str, Any]]]], str] | None = None
    svg: Callable[[list[dict[str, Any]]], str] | None = None  # a chart of the documents (adds --svg)
    png: Callable[[dict[str, Any], str], str] | None = None  # one document drawn into a PNG (adds --png)
    json: str = "path"  # --json PATH writes the document; "print": --json prints it; "either": both
    report: str | None = "--report"  # the option that reads earlier documents (None: none)
    requires: tuple[str, ...] | Callable[[argparse.Namespace], Sequence[str]] = ()  # modules it needs (exit 2)
    child: Callable[[argparse.Namespace], Any] | None = None  # runs a child of spawn(); returns what it hands back
    status: Callable[[dict[str, Any]], int] | None = None  # the exit status of a document (default 0)
    redirect: tuple[str, str] | None = None  # (option, subcommand): a command line naming it runs that one

    def parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=f"python -m fastpersist.bench {self.name}", description=self.description)
        self.options(parser)
        if self.json == "print":
            parser.add_argument("--json", action="store_true", help="print the result document as JSON, no table")
        elif self.json == "either":
            option(parser, "json", nargs="?", const="-", help="print the result document as JSON (or write it to PATH)")
        else:
            option(parser, "json")
        if self.report:
            option(parser, "report", self.report)
        if self.svg:
            option(parser, "svg")
        if self.png:
            parser.add_argument("--png", metavar="PATH", help="bar chart of the medians (needs matplotlib)")
        if self.child:
            parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
            parser.add_argument("--out", help=argparse.SUPPRESS)
        return parser

    def render_documents(self, documents: list[tuple[str, dict[str, Any]]]) -> str:
        """(path, document) pairs as Markdown: :attr:`render`, or each document under its path and commit."""
        if self.render is not None:
            return self.render(documents)
        parts = []
        for path, document in documents:
            commit = (((document.get("machine") or {}).get("code") or {}).get("commit") or "")[:12]
            parts += [f"`{path}` (commit {commit})", "", self.markdown(document).rstrip("\n"), ""]
        return "\n".join(parts)

    def main(self, argv: list[str] | None = None) -> int:
        """A child's part, a report of earlier documents or a measurement; returns 0 or the document's
        :attr:`status`, 2 on a usage error or a missing module."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if self.redirect and any(a == self.redirect[0] or a.startswith(self.redirect[0] + "=") for a in argv):
            from fastpersist.bench import SUBCOMMANDS

            return importlib.import_module(SUBCOMMANDS[self.redirect[1]][0]).main(argv)
        parser = self.parser()
        args = parser.parse_args(argv)
        args.argv = argv  # what spawn passes on to the children
        paths = getattr(args, self.report.lstrip("-").replace("-", "_"), None) if self.report else None
        needed = self.requires(args) if callable(self.requires) else self.requires
        missing = [m for m in needed if not _importable(m)]
        if missing and not paths:
            print(f"the {self.name} benchmark needs {', '.join(missing)} (pip install them)", file=sys.stderr)
            return 2
        if getattr(args, "child", False):
            result = self.child(args)
            if result is not None:
                write_json(result, f"{args.out}.{os.environ.get('RANK', '0')}")
            return 0
        try:
            if paths:
                documents = [read_document(path, self.name, self.schema) for path in paths]
                print(self.render_documents(list(zip(paths, documents))), end="")
            else:
                documents = [self.measure(args)]
        except UsageError as e:
            parser.error(str(e))
        except SystemExit as e:  # a measure's own exit status (a message: raised on)
            if not isinstance(e.code, int):
                raise
            return e.code
        if documents[0] is None:
            return 0
        if not paths:
            if args.json in (True, "-"):
                print(json.dumps(documents[0], indent=2, default=str))
            else:
                print((self.show or self.markdown)(documents[0]).rstrip("\n"))
                if args.json:
                    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                    write_json(documents[0], args.json)
                    print(f"\nresults written to {args.json}")
            if getattr(args, "png", None):
                print(f"chart: {self.png(documents[0], args.png)}")
        if getattr(args, "svg", None):
            with open(args.svg, "w") as f:
                f.write(self.svg(documents))
        return self.status(documents[0]) if self.status and not paths else 0


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_document(path: str, name: str, schema: str | None) -> dict[str, Any]:
    """The document at ``path`` of benchmark ``name`` (its schema starting with ``schema``, if given);
    UsageError when it is unreadable, not JSON or not one of its results."""
    try:
        document = _read_json(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: {e}") from e
    if not isinstance(document, dict) or (schema and not str(document.get("schema", "")).startswith(schema)):
        raise UsageError(f"{path}: not a result of 'python -m fastpersist.bench {name} --json'")
    return document


class Rounds:
    """Methods measured round by round (``warmup`` untimed ones first), interleaved so that no method always
    follows another: each round runs the phases (lists of methods) in turn, a phase's methods in ``order``
    (``fixed``, ``rotate``, ``reverse`` every other round, seeded ``shuffle``). With ``catch``, a method that
    raises has ``Type: message`` in :attr:`errors` and is left out of the later rounds."""

    def __init__(self, repeats: int, warmup: int = 0, order: str = "fixed", seed: int = 0, catch: bool = True):
        self.repeats, self.warmup, self.order, self.catch = repeats, warmup, order, catch
        self.rng = random.Random(seed)
        self.samples: dict[Hashable, list[Any]] = {}
        self.errors: dict[Hashable, str] = {}

    def ordered(self, methods: Sequence[Any], index: int) -> list[Any]:
        methods = list(methods)
        if self.order == "rotate" and methods:
            shift = index % len(methods)
            return methods[shift:] + methods[:shift]
        if self.order == "reverse" and index % 2:
            return methods[::-1]
        if self.order == "shuffle":
            self.rng.shuffle(methods)
        return methods

    def run(self, phases: Sequence[Sequence[Hashable]], run: Callable[[Any, int], Any]) -> Rounds:
        """Every round; ``run(method, round)``'s samples (None: none) of the timed rounds go to :attr:`samples`."""
        for index in range(self.warmup + self.repeats):
            for phase in phases:
                for method in self.ordered(phase, index):
                    if method in self.errors:
                        continue
                    try:
                        sample = run(method, index)
                    except Exception as e:  # a method's failure is recorded, the others go on
                        if not self.catch:
                            raise
                        self.errors[method] = f"{type(e).__name__}: {e}"
                        continue
                    samples = self.samples.setdefault(method, [])
                    if index >= self.warmup and sample is not None:
                        samples.append(sample)
        return self

    def run_ops(self, saves: Iterable[str], loads: Iterable[str], save: Callable, load: Callable) -> Rounds:
        """:meth:`run` over ``("save", name)`` of ``saves`` (``save(name, round)`` gives a sample), then
        ``("load", name)`` of ``loads``: the save and load methods compared in one run."""
        phases = [[("save", name) for name in saves], [("load", name) for name in loads]]
        return self.run(phases, lambda method, index: (save if method[0] == "save" else load)(method[1], index))

    def median(self, method: Hashable, key: str | None = None) -> float | None:
        """The median of ``method``'s samples (of their ``key``), None without samples."""
        stats = summarize([s[key] if key else s for s in self.samples.get(method, [])])
        return stats["median"] if stats else None


def timed(
    action: Callable[[], Any], device: Any = None, memory: bool = False, touch: bool = False
) -> tuple[Any, dict[str, float]]:
    """``action()`` and ``{"seconds", "cpu_seconds"}`` of the call (``memory``: + ``peak_rss_delta``). The
    clock starts and stops with a CUDA ``device`` idle; CPU seconds (all threads) are the software's cost whatever
    the contention; ``touch`` reads every page of the result before the clock stops (a lazy load ends only then)."""
    import torch

    from fastpersist.bench.measure import PeakMemory, touch_pages

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    cuda = device is not None and torch.device(device).type == "cuda"
    peak = PeakMemory() if memory else None
    if cuda:
        torch.cuda.synchronize(device)
    with peak or contextlib.nullcontext():
        cpu_before, start = cpu(), time.perf_counter()
        result = action()
        if touch and result is not None:
            touch_pages(result)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        cpu_seconds = cpu() - cpu_before
    return result, {"seconds": seconds, "cpu_seconds": cpu_seconds, **({"peak_rss_delta": peak.delta} if peak else {})}


def check(
    expected: tuple[dict[str, Any], dict[str, Any]], loaded: Any, problems: list[str], what: str, device: Any = None
) -> bool | str:
    """True when ``loaded`` is the flattened ``expected`` byte for byte, else what differs (also appended to
    ``problems`` as ``what: difference``)."""
    problem = verify_state(expected, workloads.flatten_state(loaded), device)
    if problem is not None:
        problems.append(f"{what}: {problem}")
    return True if problem is None else problem


def ratios(pairs: Iterable[tuple[str, str, str]], value: Callable[[str, str], float | None]) -> dict[str, float]:
    """``"op: ours / baseline"`` -> the ratio of their ``value(op, name)`` (3 decimals) where both are known."""
    out = {}
    for op, ours, baseline in pairs:
        mine, theirs = value(op, ours), value(op, baseline)
        if mine is not None and theirs is not None:
            out[f"{op}: {ours} / {baseline}"] = round(mine / theirs, 3)
    return out


def bf16_state(nbytes: int, device: str = "cpu", odd_tail: bool = False) -> dict[str, Any]:
    """``nbytes`` of seeded random bf16 (the same in every process) in 64 MiB tensors ``t0``, ``t1``...;
    ``odd_tail``: the last 2000 bytes in a tensor of their own, so that ranges and records do not line up."""
    import torch

    device = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device
    generator = torch.Generator(device=device).manual_seed(0)
    state, left = {}, nbytes // 2
    while left > 0:
        count = min(left, 32 << 20)
        if odd_tail and left - count == 0 and count > 1000:
            count -= 1000
        values = torch.randn(count, dtype=torch.float32, device=device, generator=generator)
        state[f"t{len(state)}"] = values.to(torch.bfloat16)
        left -= count
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    name: str, argv: Sequence[str], ranks: int = 1, capture: bool = True, group: bool | None = None
) -> tuple[list[Any], str | None]:
    """Runs ``python -m fastpersist.bench name *argv --child`` in ``ranks`` fresh processes, one process group
    with ``group`` (default: several ranks); ``capture`` keeps their output. Returns what each rank's
    :attr:`Benchmark.child` returned and None, or ``[]`` and the end of their output when one failed."""
    group = ranks > 1 if group is None else group
    with tempfile.TemporaryDirectory() as scratch, tempfile.TemporaryFile("w+") as log:
        out = os.path.join(scratch, "child")
        command = [sys.executable, "-m", "fastpersist.bench", name, *argv, "--child", "--out", out]
        env = dict(os.environ)
        if group:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks))
        output = {"stdout": log, "stderr": subprocess.STDOUT} if capture else {}
        envs = [dict(env, RANK=str(r), LOCAL_RANK=str(r)) if group else env for r in range(ranks)]
        processes = [subprocess.Popen(command, env=e, **output) for e in envs]  # all started, then waited for
        codes = [p.wait() for p in processes]
        if any(codes):
            log.seek(0)
            return [], (log.read() if capture else f"exit statuses {codes}")[-3000:]
        return [_read_json(f"{out}.{rank}") if os.path.exists(f"{out}.{rank}") else None for rank in range(ranks)], None


def markdown_table(header: Sequence[str], align: str, rows: Sequence[Sequence[Any]]) -> list[str]:
    """Lines of a Markdown table; ``align`` has a ``<`` (left) or ``>`` (right) per column."""
    rule = "| " + " | ".join("---:" if a == ">" else "---" for a in align) + " |"
    return ["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(map(str, row)) + " |" for row in rows]


def figure(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """A table's cell: ``-`` when there is no value."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


class Svg:
    """A horizontal bar chart drawn as SVG elements, top to bottom; :meth:`document` closes it."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def text(self, x: Any, y: Any, text: str, size: int = 12, extra: str = "") -> None:
        self.parts.append(f'<text x="{x}" y="{y}" font-size="{size}"{extra}>{text}</text>')

    def title(self, y: Any, text: str, size: int = 14) -> None:
        self.text(10, y, text, size, ' font-weight="bold"')

    def label(self, x: Any, y: Any, text: str) -> None:
        self.text(x, y, text, 12, ' text-anchor="end"')

    def bar(self, x: Any, y: Any, length: float, height: int, color: str) -> None:
        self.parts.append(f'<rect x="{x}" y="{y}" width="{length:.1f}" height="{height}" fill="{color}"/>')

    def line(self, x1: float, y1: Any, x2: float, y2: Any, style: str) -> None:
        self.parts.append(f'<line x1="{x1:.1f}" y1="{y1}" x2="{x2:.1f}" y2="{y2}" {style}/>')

    def document(self, width: int, height: int) -> str:
        header = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>'
        )
        return header + "".join(self.parts) + "</svg>\n"
