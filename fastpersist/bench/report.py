"""Checkpoint-benchmark documents as text, Markdown and charts, and the docs' generated blocks.

The docs' figures are never typed: ``--update-docs`` regenerates their ``<!-- fastpersist:NAME -->`` blocks
from docs/results/ (``summary``: the README's table, ``results``: every checkpoint result, or a benchmark's name).
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from fastpersist import display
from fastpersist.bench import SUBCOMMANDS
from fastpersist.bench.harness import figure, markdown_table, read_document

SCHEMA_PREFIX = "fastpersist.bench.checkpoint/"
CEILING_OP = {"save": "write", "load": "read"}
RESULTS_DIR = os.path.join("docs", "results")
_SCHEMAS = {  # the benchmarks whose documents name them only in their schema (the others: a "benchmark" key)
    "ranks": "fastpersist.bench.ranks/",
    "training": "fastpersist-training-bench/",
    "safetensors": "fastpersist.bench.safetensors/",
}


def load_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint-benchmark document at ``path``; ValueError when it is not one."""
    return read_document(os.fspath(path), "checkpoint", SCHEMA_PREFIX)


def benchmark_of(document: dict[str, Any]) -> str | None:
    if document.get("benchmark"):
        return str(document["benchmark"])
    schema = str(document.get("schema", ""))
    return next((name for name, prefix in _SCHEMAS.items() if schema.startswith(prefix)), None)


def _gb(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _seconds(t: float) -> str:
    return f"{t:.2f}" if t >= 0.1 else f"{t:.4f}"


def _mib(n: float) -> str:
    return f"{'+' if n >= 0 else '-'}{abs(n) / 2**20:,.0f} MiB"


def _median(document: dict[str, Any], op: str, method: str) -> float | None:
    for r in document["results"]:
        if r["op"] == op and r["method"] == method and r["status"] == "ok" and r["summary"].get("gbps"):
            return r["summary"]["gbps"]["median"]
    return None


def annotate_ceiling(document: dict[str, Any]) -> None:
    """Adds to every result its ``ceiling_ratio`` (median GB/s over its run's storage ceiling, None without one)
    and ``measurement_problem``: above 1.0 it is no result, the ceiling being the best any tool did there."""
    ceiling = document.get("ceiling") or {}
    for r in document["results"]:
        limit = (ceiling.get(CEILING_OP[r["op"]]) or {}).get("gbps")
        gbps = (r.get("summary") or {}).get("gbps")
        ratio = gbps["median"] / limit if limit and gbps and r["status"] == "ok" else None
        r.update(ceiling_ratio=ratio, measurement_problem=ratio is not None and ratio > 1.0)


def measurement_problems(document: dict[str, Any]) -> list[str]:
    return [f"{r['op']} {r['label']}" for r in document["results"] if r.get("measurement_problem")]


_COLUMNS = [  # a row's key, its heading in the terminal's table and in Markdown (None: not there), alignment
    ("op", None, "op", "<"),
    ("label", "method", "method", "<"),
    ("gbps", "GB/s", "GB/s", ">"),
    ("range", "range", "range", ">"),
    ("seconds", "time s", "time s", ">"),
    ("blocked", "blocked s", "blocked s", ">"),
    ("rss_delta", "RSS delta", "RSS delta", ">"),
    ("peak_rss", "peak RSS", None, ">"),
    ("ratio", "vs", "vs baseline", ">"),
    ("ceiling_ratio", "of ceiling", "of ceiling", ">"),
    ("status", "result", "result", "<"),
]
_FIGURES = [key for key, *_ in _COLUMNS[2:-1]]


def _ceiling_row(document: dict[str, Any], op: str) -> dict[str, str] | None:
    ceiling, kind = document.get("ceiling") or {}, CEILING_OP[op]
    part = ceiling.get(kind)
    row = {"op": op, "method": f"ceiling-{kind}", "label": f"storage {kind} ceiling", **dict.fromkeys(_FIGURES, "-")}
    if ceiling.get("error"):
        return dict(row, status=f"not measured: {ceiling['error']}")
    if not part:
        return None
    if not part.get("best"):
        return dict(row, status="FAILED: no candidate completed and verified")
    best, values = part["best"], [s["gbps"] for s in part["samples"] if s.get("gbps")]
    tools = "fio and engine" if (ceiling.get("fio") or {}).get("path") else "engine (fio not installed)"
    size = f"{best['block_size'] >> 20}M" if best["block_size"] >= 1 << 20 else f"{best['block_size'] >> 10}K"
    row.update(gbps=f"{part['gbps']:.2f}", range=f"{min(values):.2f}-{max(values):.2f}", ceiling_ratio="1.00x")
    label = f"{kind} ceiling: {best['tool']} {size} QD{best['queue_depth']} (best of {tools} grid)"
    return dict(row, label=label, status="verified (bytes read back compared)")


def _row(document: dict[str, Any], r: dict[str, Any]) -> dict[str, str]:
    row = {"op": r["op"], "method": r["method"], "label": r["label"], **dict.fromkeys(_FIGURES, "-")}
    s, limit = r["summary"], r.get("ceiling_ratio")
    if r["status"] != "ok" or not s.get("gbps"):
        reason = r.get("reason") or ("no timed samples" if r["status"] == "ok" else "")
        return dict(row, status=f"{r['status']}: {reason}" if reason else r["status"])
    g, base = s["gbps"], _median(document, r["op"], document.get("baselines", {}).get(r["op"], ""))
    row.update(gbps=f"{g['median']:.2f}", range=f"{g['min']:.2f}-{g['max']:.2f}")
    row.update(seconds=_seconds(s["seconds"]["median"]), rss_delta=_mib(s["rss_delta_bytes"]["median"]))
    row["blocked"] = _seconds(s["blocked_seconds"]["median"]) if s.get("blocked_seconds") else "-"
    row["peak_rss"] = _mib(s["peak_rss_bytes"]["median"]).lstrip("+")
    row["ratio"] = f"{g['median'] / base:.2f}x" if base else "-"
    row["ceiling_ratio"] = figure(limit, suffix="x")
    row["status"] = "verified" if r.get("timed", True) else "verified (not selected; ran to feed a load)"
    if r.get("measurement_problem"):
        row["status"] = f"MEASUREMENT PROBLEM: {limit:.2f}x the storage ceiling, not a result"
    return row


def rows(document: dict[str, Any]) -> list[dict[str, str]]:
    """Display strings per method (op, method, label, status and the figures of _COLUMNS, ``-`` for a failed
    or skipped one), saves then loads, each operation's storage ceiling after its methods."""
    out = []
    for op in CEILING_OP:
        out += [_row(document, r) for r in document["results"] if r["op"] == op]
        out += [row for row in [_ceiling_row(document, op)] if row]
    return out


def _headline(document: dict[str, Any]) -> list[str]:
    st, se, m = document["state"], document["settings"], document["machine"]
    fs, code, order = m.get("filesystem", {}), m.get("code") or {}, document.get("order")
    what = (
        f"{se['model']} ({se['layers']} of {se['model_layers']} blocks), {_gb(st['bytes'])} {se['dtype']}"
        f"{' training state' if se.get('training_state') else ''}, {st['tensors']} tensors, on {se['device']}"
        + (f" ({m.get('device_name')})" if se["device"] != "cpu" else "")
    )
    host = (
        f"machine: {m.get('hostname')}, {m.get('cpu_count')} CPUs, {(m.get('ram_bytes') or 0) / 2**30:.0f} GiB RAM, "
        f"torch {m.get('torch')}, {m.get('date')}"
        + (f", load average {m['loadavg'][0]:.1f} at the end" if m.get("loadavg") else "")
    )
    version = f"code: fastpersist {code.get('fastpersist', '?')} at commit {(code.get('commit') or 'unknown')[:12]}"
    rounds = f"median of {se['repeats']} rounds after {se['warmup']} warm-up"
    if se.get("load_repeats", 1) > 1:
        rounds += f" (loads: {se['load_repeats']} per round, {se['repeats'] * se['load_repeats']} in all)"
    rounds += ", " + (f"methods in random order (seed {order['seed']})" if order else "methods interleaved")
    rounds += "; range is min-max"
    conditions = ""
    if "memory_settle_seconds" in (order or {}):  # how every method of an operation had the same conditions
        pause, settle = order["memory_settle_seconds"], order.get("settle_seconds", 0)
        conditions = "equal conditions: before every load, memory released and the page cache dropped"
        if pause:
            conditions += (
                f", then a {pause:g} s pause in which the host takes freed memory back (free page reporting); "
                "the same pause before each round's saves"
            )
        conditions += f"; every loaded file at least {settle:g} s old" if settle else ""
    where = f"dir: {fs.get('path', se['dir'])} ({fs.get('type', '?')} on {fs.get('device', '?')})"
    version += " with uncommitted changes" if code.get("dirty") else ""
    return [what, where, host, version, rounds, se.get("cache_detail", ""), conditions]


def _baseline_note(document: dict[str, Any]) -> str:
    b = document.get("baselines", {})
    return f"vs = median GB/s relative to {b.get('save', '?')} (saves) and {b.get('load', '?')} (loads) in the same run"


def format_table(document: dict[str, Any], status_width: int = 70) -> str:
    """The terminal's report: a headline, a table of saves and one of loads (reasons cut at ``status_width``)."""
    headline = _headline(document)
    lines = ["", "fastpersist checkpoint benchmark: " + headline[0]] + ["  " + text for text in headline[1:] if text]
    cold = document["settings"].get("cache") in ("drop_caches", "fadvise")
    load = "load (cold: page cache dropped)" if cold else "load (page cache NOT dropped)"
    titles = {"save": "save (time to durable: fsync of files and directory)", "load": load}
    everything = rows(document)
    for op, title in titles.items():
        op_rows = [r for r in everything if r["op"] == op]
        for r in op_rows:
            r["status"] = r["status"] if len(r["status"]) <= status_width else r["status"][: status_width - 3] + "..."
        blocked = any(r["blocked"] != "-" for r in op_rows)
        columns = [c for c in _COLUMNS if c[1] and (c[0] != "blocked" or blocked)]
        if op_rows:
            cells = [[r[key] for key, *_ in columns] for r in op_rows]
            table = display.format_table([c[1] for c in columns], cells, "".join(c[3] for c in columns))
            lines += ["", title, table]
    lines += ["", _baseline_note(document) + "; GB = 10^9 bytes of tensor data"]
    lines.append("blocked s = time async_save kept the caller; RSS delta = peak minus RSS before the call")
    return "\n".join(lines)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(documents: dict[str, Any] | Sequence[dict[str, Any]]) -> str:
    """Markdown of one or more result documents: each a headline and a table of every method."""
    columns = [c for c in _COLUMNS if c[2]]
    parts = []
    for document in [documents] if isinstance(documents, dict) else documents:
        headline = _headline(document)
        parts += [f"**{_md_escape(headline[0])}**  "] + [f"{_md_escape(text)}  " for text in headline[1:] if text]
        table = [[_md_escape(r[key]) for key, *_ in columns] for r in rows(document)]
        parts += ["", *markdown_table([c[2] for c in columns], "".join(c[3] for c in columns), table)]
        parts += ["", f"_{_baseline_note(document)}._", ""]
    return "\n".join(parts)


def save_png(document: dict[str, Any] | Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> str:
    """A bar chart of median GB/s with min-max whiskers, saves and loads side by side; returns the path written,
    or why nothing was (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install matplotlib)"
    documents = [document] if isinstance(document, dict) else list(document)
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.5 + 0.45 * max(4, len(documents[0]["results"]))), squeeze=False)
    for ax, op in zip(axes[0], ("save", "load")):
        bars = [  # (label, median, min, max) of every verified method of this operation
            (r["label"] + (f" [{index + 1}]" if len(documents) > 1 else ""), g["median"], g["min"], g["max"])
            for index, doc in enumerate(documents)
            for r in doc["results"]
            if r["op"] == op and (g := r["summary"].get("gbps") if r["status"] == "ok" else None)
        ]
        if not bars:
            ax.set_visible(False)
            continue
        labels, medians = [b[0] for b in bars], [b[1] for b in bars]
        lows, highs = [b[1] - b[2] for b in bars], [b[3] - b[1] for b in bars]
        y = list(range(len(labels)))[::-1]
        ax.barh(y, medians, xerr=[lows, highs], color="#4878a8" if op == "save" else "#6aa84f", capsize=3)
        ax.set_yticks(y, labels)
        ax.set_xlabel("GB/s (median, min-max)")
        ax.set_title("save, time to durable" if op == "save" else "load, cold cache")
        right = max(m + h for m, h in zip(medians, highs))
        for yi, value, high in zip(y, medians, highs):
            ax.text(value + high + 0.01 * right, yi, f" {value:.2f}", va="center")
        ax.set_xlim(0, right * 1.15)
    fig.suptitle(_headline(documents[0])[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
    return f"written to {os.fspath(path)}"


def _summary_cell(document: dict[str, Any], op: str, method: str, baseline: str | None = None) -> str:
    value = _median(document, op, method)
    if value is None:
        return "-"
    base = _median(document, op, baseline) if baseline else None
    result = next(r for r in document["results"] if r["op"] == op and r["method"] == method)
    problem = " MEASUREMENT PROBLEM" if result.get("measurement_problem") else ""
    return f"{value:.2f}" + (f" ({value / base:.2f}x)" if base else "") + problem


def summary_markdown(documents: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The README's table: a row per (file name, document); GB/s medians, ratios to torch in the same run."""
    header = ["result", "checkpoint", "torch.save + fsync", "fastpersist.save", "write ceiling", "torch.load"]
    lines = markdown_table([*header, "fastpersist.load", "read ceiling"], "<<>>>>>>", [])
    for name, document in documents:
        st, se, m = document["state"], document["settings"], document["machine"]
        device = se["device"] if se["device"] == "cpu" else m.get("device_name", se["device"])
        ceiling = document.get("ceiling") or {}
        cells = [
            f"[{name}](docs/results/{name})",
            f"{_gb(st['bytes'])} {se['dtype']} {se['model']} on {device}, "
            f"{(m.get('filesystem') or {}).get('type', '?')}; {m.get('hostname')}, {m.get('cpu_count')} CPUs",
        ]
        for op, ours in (("save", "fastpersist"), ("load", "fastpersist.load")):
            baseline = f"torch.{op}"
            cells += [_summary_cell(document, op, baseline), _summary_cell(document, op, ours, baseline)]
            cells.append(figure((ceiling.get(CEILING_OP[op]) or {}).get("gbps") or None))
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _results_markdown(documents: Sequence[tuple[str, dict[str, Any]]]) -> str:
    parts = []
    for name, document in documents:
        regenerated = f"`docs/results/{name}`, regenerated by `python -m fastpersist.bench report --update-docs`:"
        parts += [f"### {name}", "", regenerated, "", to_markdown(document).rstrip("\n"), ""]
    return "\n".join(parts)


def _rendered_by(name: str, documents: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Benchmark ``name``'s rendering of the documents (its module imported only when a block of it is rendered)."""
    benchmark = importlib.import_module(SUBCOMMANDS[name][0]).BENCHMARK
    return benchmark.render_documents([(f"docs/results/{file}", document) for file, document in documents])


RENDERERS: dict[str, Any] = {  # docs block name -> renderer: every registered benchmark has its block
    "summary": summary_markdown,
    "results": _results_markdown,
    **{name: functools.partial(_rendered_by, name) for name in SUBCOMMANDS if name not in ("checkpoint", "report")},
}


def load_results(directory: str) -> list[tuple[str, dict[str, Any]]]:
    """Every ``*.json`` of ``directory`` (sorted) as (name, document), checkpoint results annotated with their
    ceiling ratios; ValueError for a file that is no result or records no code version, settings or machine."""
    documents = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        # Results of other benchmarks ("benchmark" key) are kept too; those with a block type render there.
        document = raw if isinstance(raw, dict) and benchmark_of(raw) else load_result(path)
        code = (document.get("machine") or {}).get("code") or {}
        if not code.get("commit") or not (document.get("settings") or document.get("config")):
            raise ValueError(f"{path}: records no code version (commit), settings or machine; re-measure it")
        if str(document.get("schema", "")).startswith(SCHEMA_PREFIX):
            annotate_ceiling(document)
        documents.append((os.path.basename(path), document))
    return documents


def render_docs(text: str, documents: Sequence[tuple[str, dict[str, Any]]]) -> str:
    def fill(match: re.Match[str]) -> str:
        kind = match.group(2)
        if kind in ("summary", "results"):  # the checkpoint benchmark's
            chosen = [(n, d) for n, d in documents if str(d.get("schema", "")).startswith(SCHEMA_PREFIX)]
        else:
            chosen = [(n, d) for n, d in documents if benchmark_of(d) == kind]
        body = RENDERERS[kind](chosen)
        if not chosen:
            body = "_No results in docs/results/ yet: run examples/gpu_acceptance.sh or the benchmark with --json._\n"
        return match.group(1) + body + match.group(4)

    names = "|".join(map(re.escape, RENDERERS))
    return re.sub(rf"(<!-- fastpersist:({names}) -->\n)(.*?)(<!-- /fastpersist -->)", fill, text, flags=re.DOTALL)


def doc_files(root: str) -> list[str]:
    pattern = os.path.join(root, "docs", "**", "*.md")
    return [os.path.join(root, "README.md")] + sorted(glob.glob(pattern, recursive=True))


def update_docs(root: str = ".", check: bool = False) -> list[str]:
    """Regenerates the docs' blocks under ``root`` (``check``: only compares); returns the files that differed."""
    documents = load_results(os.path.join(root, RESULTS_DIR))
    changed = []
    for path in doc_files(root):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = render_docs(text, documents)
        if new != text:
            changed.append(path)
            if not check:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    """``python -m fastpersist.bench report``: Markdown of result files, or the docs regenerated from docs/results/.

    Returns:
        0 on success; 1 when ``--check-docs`` finds stale docs; 2 on unreadable results.
    """
    parser = argparse.ArgumentParser(prog="python -m fastpersist.bench report", description=main.__doc__)
    parser.add_argument("results", nargs="*", help="result JSON files to print as Markdown")
    parser.add_argument(
        "--update-docs", action="store_true", help="rewrite the generated tables of README.md and docs/"
    )
    parser.add_argument("--check-docs", action="store_true", help="exit 1 if a generated table is stale")
    parser.add_argument("--root", default=".", help="repository root (default: the current directory)")
    args = parser.parse_args(argv)
    try:
        if args.update_docs or args.check_docs:
            changed = update_docs(args.root, check=args.check_docs)
            what = "stale" if args.check_docs else "regenerated"
            print("\n".join(f"{what}: {path}" for path in changed) or "docs match docs/results/")
            return 1 if args.check_docs and changed else 0
        if not args.results:
            parser.error("give result files, --update-docs or --check-docs")
        print(to_markdown([load_result(p) for p in args.results]), end="")
        return 0
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
