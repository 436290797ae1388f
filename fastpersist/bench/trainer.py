"""Hugging Face Trainer checkpoints through ``fastpersist.patch()``: the time training is blocked, and until durable.

    python -m fastpersist.bench trainer --dir /mnt/nvme/fp --dir /dev/shm/fp --json out.json
    python -m fastpersist.bench trainer --report out.json --svg docs/images/trainer.svg

Each method trains the same Llama-shaped model with ``transformers.Trainer`` in a fresh process per method and
directory, timing every checkpoint from the saving step's end to ``on_save`` (``blocked_s``) and until every file is
durable (``durable_s``): ``unpatched+fsync`` fsyncs every file after, ``patched`` is durable on return,
``patched-async`` when its background saves commit. The last checkpoint is read back with safetensors and
``torch.load`` and compared with the live state; each directory's write ceiling is measured too. See docs/patch.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from fastpersist.bench.bounds import fsync_file
from fastpersist.bench.harness import Benchmark, Rounds, Svg, UsageError, figure, markdown_table, option, spawn
from fastpersist.bench.measure import machine_info, summarize
from fastpersist.io.commit import fsync_directory

__all__ = ["BENCHMARK", "METHODS", "SCHEMA", "fsync_tree", "main", "to_markdown", "to_svg"]

SCHEMA = "fastpersist.bench.trainer/1"
METHODS = ("unpatched", "unpatched+fsync", "patched", "patched-async")
_RUN_OPTIONS = "hidden intermediate layers heads kv_heads vocab batch seq save_steps checkpoints device".split()


def _tree(directory: str):
    """(each directory under ``directory``, the paths of its files), the files of a save in flight left out
    (``.<name>.fastpersist-...tmp``, io.commit): their save makes them durable when it commits."""
    for root, _, files in os.walk(directory):
        saving = [n for n in files if n.startswith(".") and ".fastpersist-" in n and n.endswith(".tmp")]
        yield root, [os.path.join(root, n) for n in files if n not in saving]


def fsync_tree(directory: str) -> int:
    """fsyncs every file of :func:`_tree`, each directory, and ``directory``'s parent; returns the files."""
    count = 0
    for root, files in _tree(directory):
        for path in files:
            fsync_file(path)
        count += len(files)
        fsync_directory(root)
    fsync_directory(os.path.dirname(os.path.abspath(directory)))
    return count


def _callback(method: str, device: str, timings: list[dict]):
    """A TrainerCallback timing each checkpoint from the saving step's end to on_save (and to durable)."""
    import torch
    from transformers import TrainerCallback

    import fastpersist

    class Timer(TrainerCallback):
        started = None

        def on_step_end(self, args, state, control, **kwargs):
            if control.should_save:
                if device == "cuda":
                    torch.cuda.synchronize()  # the step's own kernels are not the checkpoint's cost
                self.started = time.perf_counter()

        def on_save(self, args, state, control, **kwargs):
            record = {"step": state.global_step, "returned_s": time.perf_counter() - self.started}
            if method != "unpatched":
                fsync_tree(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
            record["blocked_s"] = time.perf_counter() - self.started
            if method != "unpatched":  # durable when the last of its background saves is done (none: now)
                pending = fastpersist.pending_saves() if method == "patched-async" else []
                record["pending_saves"] = len(pending)
                done = [time.perf_counter()]
                record["_durable"] = (self.started, done)
                for future in pending:
                    future.add_done_callback(lambda _future: done.append(time.perf_counter()))
            timings.append(record)

    return Timer()


def _verify(trainer, folder: str) -> dict[str, Any]:
    """Reads the last checkpoint with the original safetensors and torch.load; compares with the live state."""
    import safetensors.torch
    import torch

    live = trainer.model.state_dict()
    loaded = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    if set(loaded) != set(live):
        return {"ok": False, "why": f"model.safetensors keys differ: {sorted(set(loaded) ^ set(live))[:4]}"}
    optimizer = torch.load(os.path.join(folder, "optimizer.pt"), map_location="cpu", weights_only=True)["state"]
    pairs = [(f"model.safetensors: {name}", tensor, live[name]) for name, tensor in loaded.items()]
    for key, state in trainer.optimizer.state_dict()["state"].items():
        pairs += [
            (f"optimizer.pt: state {key}.{n}", optimizer[key][n], v) for n, v in state.items() if torch.is_tensor(v)
        ]
    for what, saved, value in pairs:
        if not torch.equal(saved, value.cpu()):
            return {"ok": False, "why": f"{what} differs"}
    return {"ok": True, "tensors": len(pairs)}


def _run_one(args) -> dict[str, Any]:
    """One method's training run in this process (a child of :func:`_measure`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    import fastpersist

    output_dir = os.path.join(args.target, f"trainer-{args.method}-{os.getpid()}")
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 128),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    steps = args.save_steps * args.checkpoints
    timings: list[dict] = []
    tokens = torch.randint(0, args.vocab, (steps * args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    training = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=args.device == "cuda",
        use_cpu=args.device == "cpu",
        seed=0,
    )
    restore = None
    if args.method.startswith("patched"):
        restore = fastpersist.patch(mode="snapshot" if args.method == "patched-async" else "sync")
    try:
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=[{"input_ids": row, "labels": row} for row in tokens],  # the step's shape is what matters
            callbacks=[_callback(args.method, args.device, timings)],
        )
        started = time.perf_counter()
        trainer.train()
        fastpersist.wait_all()
        elapsed = time.perf_counter() - started
        counts = fastpersist.patch_stats() if restore is not None else {}
    finally:
        if restore is not None:
            restore()
    for record in timings:  # every background save has finished (wait_all above)
        if durable := record.pop("_durable", None):
            record["durable_s"] = max(durable[1]) - durable[0]
    last = os.path.join(output_dir, f"checkpoint-{steps}")
    result = {
        "method": args.method,
        "checkpoints": timings,
        "checkpoint_bytes": sum(os.path.getsize(path) for _, files in _tree(last) for path in files),
        "files": sorted(os.listdir(last)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_s": elapsed,
        "steps": steps,
        "verified": _verify(trainer, last),
        "patch_stats": counts,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
    }
    shutil.rmtree(output_dir, ignore_errors=True)
    return result


def _summary(samples: list[dict]) -> dict[str, Any]:
    """First and steady (median of the later checkpoints) blocked and durable seconds of a method's runs."""
    checkpoints = [c for s in samples for c in s["checkpoints"]]
    firsts = [s["checkpoints"][0] for s in samples if s["checkpoints"]]
    later = [c for s in samples for c in s["checkpoints"][1:]] or checkpoints
    medians = {
        p + k: (summarize([r.get(k) for r in rows]) or {}).get("median")
        for p, rows in (("first_", firsts), ("", later))
        for k in ("blocked_s", "durable_s")
    }
    return {"checkpoints": len(checkpoints), **medians}


def _targets(results: dict[str, dict], ceiling: dict | None, nbytes: int) -> dict[str, Any]:
    """The issue's three ratios for one directory (None where a method failed)."""

    def get(method, key):
        return (results.get(method) or {}).get(key)

    patched, fsynced = get("patched", "durable_s"), get("unpatched+fsync", "durable_s")
    asynchronous, unpatched = get("patched-async", "blocked_s"), get("unpatched", "blocked_s")
    ceiling_s = ceiling["best_s"] if ceiling else None
    return {
        "patched_gbps": nbytes / patched / 1e9 if patched else None,
        "ceiling_gbps": nbytes / ceiling_s / 1e9 if ceiling_s else None,
        "patched_of_ceiling": ceiling_s / patched if patched and ceiling_s else None,
        "patched_vs_unpatched_fsync": fsynced / patched if patched and fsynced else None,
        "async_blocked_of_unpatched": asynchronous / unpatched if asynchronous is not None and unpatched else None,
    }


def _measure(args) -> dict[str, Any]:
    """Each method in a fresh process per directory, ``--repeats`` times; the document of them all."""
    from fastpersist.bench import bounds

    if unknown := set(args.methods) - set(METHODS):
        raise UsageError(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    directories = []
    for index, directory in enumerate(args.dir or [tempfile.gettempdir()]):
        os.makedirs(directory, exist_ok=True)

        def run(method: str, _round: int, directory: str = directory) -> dict[str, Any]:
            results, error = spawn("trainer", [*args.argv, "--method", method, "--target", directory])
            if error:
                print(f"{directory} {method}: failed\n{error}", file=sys.stderr)
                raise RuntimeError(error)
            got = _summary(results)
            durable = figure(got["durable_s"], suffix=" s")
            print(f"{directory} {method}: blocked {got['blocked_s']:.2f} s, durable {durable}", file=sys.stderr)
            return results[0]

        # Every other directory starts with the last method: no method always runs first.
        rounds = Rounds(args.repeats, order="reverse").run([args.methods[:: -1 if index % 2 else 1]], run)
        results = {m: {**_summary(runs), "samples": runs} for m in args.methods if (runs := rounds.samples.get(m))}
        results.update({m: {"error": e} for m, e in rounds.errors.items() if m not in results})
        nbytes = max((s["checkpoint_bytes"] for m in results for s in results[m].get("samples", [])), default=0)
        ceiling = bounds.write_ceiling(directory, nbytes) if nbytes and not args.no_ceiling else None
        directories.append(
            {
                "dir": directory,
                "filesystem": (machine_info(directory).get("filesystem") or {}).get("type"),
                "checkpoint_bytes": nbytes,
                "write_ceiling": ceiling,
                "methods": results,
                "targets": _targets(results, ceiling, nbytes),
            }
        )
    import transformers

    return {
        "schema": SCHEMA,
        "benchmark": "trainer",
        "machine": machine_info(directories[0]["dir"], device=args.device),
        "config": {**{k: getattr(args, k) for k in _RUN_OPTIONS}, "repeats": args.repeats, "methods": args.methods},
        "transformers": transformers.__version__,
        "results": directories,
    }


def to_markdown(document: dict[str, Any]) -> str:
    """The document's tables: one per directory, then its target ratios."""
    config = document["config"]
    lines = []
    for entry in document["results"]:
        results = entry["methods"]
        sample = next((r["samples"][0] for r in results.values() if r.get("samples")), None)
        parameters = f"{sample['parameters'] / 1e9:.2f} B parameters, " if sample else ""
        ceiling, nbytes = entry.get("write_ceiling"), entry["checkpoint_bytes"]
        lines += [
            f"Trainer (transformers {document.get('transformers')}) on `{config['device']}`, {parameters}bf16 + "
            f"AdamW, checkpoint {nbytes / 1e9:.2f} GB every {config['save_steps']} steps to `{entry['dir']}` "
            f"({entry.get('filesystem') or '?'}), {config['checkpoints']} checkpoints per run, {config['repeats']} "
            "run(s) per method"
            + (f"; write ceiling {nbytes / ceiling['best_s'] / 1e9:.2f} GB/s ({ceiling['best']})." if ceiling else "."),
            "",
        ]
        header = ["method", "blocked (s)", "durable (s)", "durable GB/s", "first blocked (s)", "first durable (s)"]
        lines += markdown_table([*header, "verified"], "<>>>>><", [])
        for method in [m for m in config["methods"] if m in results]:
            r = results[method]
            if "error" in r:
                lines.append(f"| {method} | failed | | | | | |")
                continue
            gbps = nbytes / r["durable_s"] / 1e9 if r["durable_s"] else None
            verified = all(s["verified"]["ok"] for s in r["samples"])
            lines.append(
                f"| {method} | {figure(r['blocked_s'])} | {figure(r['durable_s'])} | {figure(gbps)} | "
                f"{figure(r['first_blocked_s'])} | {figure(r['first_durable_s'])} | {'yes' if verified else 'NO'} |"
            )
        t = entry["targets"]
        lines += [
            "",
            f"Patched and durable: {figure(t['patched_of_ceiling'], suffix='x')} the write ceiling, "
            f"{figure(t['patched_vs_unpatched_fsync'], suffix='x')} unpatched + fsync; patched-async blocked "
            f"{figure(t['async_blocked_of_unpatched'], '.3f', 'x')} unpatched (the targets, for the disk: "
            "at least 0.9x, at least 2.5x, at most 0.1x).",
            "",
        ]
    return "\n".join(lines)


def to_svg(documents: list[dict[str, Any]]) -> str:
    """Bars of blocked and durable seconds per method, one panel per directory of each document."""
    entries = [(d, e) for d in documents for e in d["results"]]
    bar, gap, left, width = 14, 4, 150, 420
    svg, y = Svg(), 10
    top = max(
        [r.get(k) or 0 for _, e in entries for r in e["methods"].values() for k in ("blocked_s", "durable_s")] + [1.0]
    )
    for document, entry in entries:
        title = f"{document['machine'].get('device_name') or document['config']['device']}: {entry['dir']}"
        title += f" ({entry.get('filesystem') or '?'}), {entry['checkpoint_bytes'] / 1e9:.1f} GB checkpoint"
        svg.title(y + 14, title)
        y += 24
        for method in document["config"]["methods"]:
            r = entry["methods"].get(method) or {}
            if "error" in r or not r:
                continue
            svg.label(left - 6, y + 22, method)
            for key, color in (("blocked_s", "#2a7"), ("durable_s", "#888")):
                value = r.get(key)
                if value is not None:
                    length = width * value / top
                    svg.bar(left, y, length, bar, color)
                    svg.text(f"{left + length + 4:.1f}", y + 11, f"{key.split('_')[0]} {value:.2f} s", 11)
                y += bar + gap
            y += 6
        y += 14
    return svg.document(left + width + 130, y + 10)


def _options(parser: argparse.ArgumentParser) -> None:
    import torch

    gpu = torch.cuda.is_available()
    option(parser, "dir", action="append", help="where checkpoints go; repeat for several (default: a temp dir)")
    option(parser, "device", choices=["cpu", "cuda"], default="cuda" if gpu else "cpu")
    # GPU defaults: TinyLlama-1.1B's shape (a 6.6 GB checkpoint with AdamW in bf16); CPU: a toy of the same shape.
    shape = {"--hidden": (2048, 64), "--intermediate": (5632, 176), "--layers": (22, 2), "--heads": (32, 4)}
    shape.update({"--kv-heads": (4, 2), "--vocab": (32000, 512), "--batch": (4, 2), "--seq": (1024, 32)})
    for flag, (on_gpu, on_cpu) in shape.items():
        parser.add_argument(flag, type=int, default=on_gpu if gpu else on_cpu)
    parser.add_argument("--save-steps", type=int, default=30 if gpu else 2, help="checkpoint every N steps")
    parser.add_argument("--checkpoints", type=int, default=2 if gpu else 3, help="checkpoints per run")
    option(parser, "repeats", default=1, help="runs per method and directory")
    methods = f"comma list (default: {','.join(METHODS)})"
    parser.add_argument(
        "--methods", type=lambda text: [m for m in text.split(",") if m], default=[*METHODS], help=methods
    )
    parser.add_argument("--no-ceiling", action="store_true", help="do not measure the directories' write ceilings")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)


BENCHMARK = Benchmark(
    "trainer", _options, _measure, to_markdown, __doc__.partition("\n")[0], SCHEMA, svg=to_svg, child=_run_one
)
main = BENCHMARK.main
