"""``python -m fastpersist.bench s3``: checkpoints in an S3-compatible store, fastpersist against boto3 and s3fs.

One CPU state saved (durable on return) and loaded against a moto server in a child process (the client side
measured, not a network) or ``--endpoint``: fastpersist, torch.save + boto3 (same part size and concurrency), s3fs
and s3torchconnector (their failures are their results). Every object is loaded back, compared and read by the other
library; an untimed warm-up allocates fastpersist's pooled ring, whose cost is reported apart. See
docs/object-storage.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from fastpersist import config, system
from fastpersist.bench import harness, measure
from fastpersist.bench.harness import Benchmark, Rounds, free_port, markdown_table, option, timed
from fastpersist.tuning import workloads

__all__ = ["BENCHMARK", "SCHEMA", "main", "make_state", "moto_server", "to_markdown"]

SCHEMA = "fastpersist.bench.s3/1"
_MiB = 1 << 20
_LABELS = {  # method: (its save, its load), as the table names them
    "fastpersist": ("fastpersist.save(state, 's3://...')", "fastpersist.load('s3://...')"),
    "fastpersist-one-get": (
        "",
        "fastpersist.load('s3://...') of the same object in one GET (s3_part_size >= its size)",
    ),
    "boto3": ("torch.save to BytesIO + boto3 upload_fileobj", "boto3 get_object -> BytesIO -> torch.load"),
    "s3fs": ("torch.save to s3fs fs.open(url, 'wb')", "torch.load(fs.open(url, 'rb'))"),
    "s3torchconnector": ("torch.save to S3Checkpoint.writer", "torch.load(S3Checkpoint.reader)"),
}
_OTHERS = ("s3fs", "s3torchconnector")  # other libraries, where importable: their failures are their results


def _options(p: argparse.ArgumentParser) -> None:
    option(p, "size", type=str, default="256M", help="state size, e.g. 256M (binary units; default 256M)")
    option(p, "repeats", help="repeats per method; median, min, max (default 3)")
    p.add_argument("--part-size", default=None, help="fastpersist's s3_part_size (and boto3's chunk size)")
    p.add_argument("--concurrency", type=int, default=None, help="fastpersist's s3_concurrency (and boto3's)")
    endpoint = "an S3-compatible endpoint URL; credentials from the environment (default: start a moto server)"
    p.add_argument("--endpoint", default=None, help=endpoint)
    p.add_argument("--bucket", default="fastpersist-bench", help="bucket (created if missing; default %(default)s)")
    p.add_argument("--prefix", default="fastpersist-bench/", help="key prefix of the objects (deleted at the end)")


def make_state(size: int, seed: int = 0) -> dict[str, Any]:
    """``size`` bytes of random CPU tensors of about 16 MiB each (bf16 and float32 in turn), and two other leaves."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    left = size
    while left > 0:
        dtype = torch.bfloat16 if len(tensors) % 2 == 0 else torch.float32
        count = max(1, min(16 * _MiB, left) // dtype.itemsize)
        shape = (count // 1024, 1024) if count % 1024 == 0 else (count,)
        tensors[f"layers.{len(tensors)}.weight"] = torch.randn(shape, generator=generator).to(dtype)
        left -= count * dtype.itemsize
    return {"model": tensors, "step": 1000, "config": {"lr": 3e-4, "name": "bench"}}


@contextlib.contextmanager
def moto_server(timeout: float = 60.0) -> Iterator[str]:
    """Runs moto's S3 server on a free port of 127.0.0.1 and yields its URL; RuntimeError when it exits or does
    not answer within ``timeout`` seconds. A child process: its memory and its Python work stay out of ours."""
    port = free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if child.poll() is not None:
                raise RuntimeError(f"moto's server exited with status {child.returncode} before answering")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto's server did not answer on 127.0.0.1:{port} within {timeout:.0f} s")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@contextlib.contextmanager
def _endpoint(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(endpoint URL, description) with boto3's environment pointing at it for the block."""
    if args.endpoint:
        with mock.patch.dict(os.environ, AWS_ENDPOINT_URL=args.endpoint):
            yield args.endpoint, "given endpoint, credentials from the environment"
        return
    with moto_server() as url:
        # moto's fixed credentials, and nothing of a real account's configuration that could redirect boto3
        fake = dict(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        fake.update(AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        with mock.patch.dict(os.environ, fake, AWS_EC2_METADATA_DISABLED="true"):
            for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
                os.environ.pop(name, None)  # put back with the rest after the block
            import moto

            yield url, f"moto {moto.__version__} server (in-memory, Python) in a child process on 127.0.0.1"


def _methods(endpoint: str, bucket: str, settings: config.Settings, client, size: int):
    """name -> (save(state, key), load(key)) of every method that can run (save None: it loads fastpersist's
    object), and why each other library cannot."""
    import boto3.s3.transfer

    import fastpersist

    overrides = {"s3_part_size": settings.s3_part_size, "s3_concurrency": settings.s3_concurrency}
    part = settings.s3_part_size
    transfer = boto3.s3.transfer.TransferConfig(
        multipart_threshold=part, multipart_chunksize=part, max_concurrency=settings.s3_concurrency
    )
    # Load-only context: moto answers a ranged GET by reading the whole object and slicing it.
    one_get = dict(overrides, s3_part_size=min(5 << 30, max(part, -(-size // _MiB) * _MiB)))

    def fastpersist_save(state: dict[str, Any], key: str) -> None:
        fastpersist.save(state, f"s3://{bucket}/{key}", **overrides)

    def ours(**chosen: Any) -> Callable[[str], Any]:
        return lambda key: fastpersist.load(f"s3://{bucket}/{key}", weights_only=True, **chosen)

    def boto3_save(state: dict[str, Any], key: str) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        client.upload_fileobj(buffer, bucket, key, Config=transfer)

    def boto3_load(key: str) -> Any:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        return torch.load(io.BytesIO(body.read()), weights_only=True)

    def streamed(writer: Callable[[str], Any], reader: Callable[[str], Any]) -> tuple[Callable, Callable]:
        def save(state: dict[str, Any], key: str) -> None:
            with writer(f"s3://{bucket}/{key}") as f:
                torch.save(state, f)

        def load(key: str) -> Any:
            with reader(f"s3://{bucket}/{key}") as f:
                return torch.load(f, weights_only=True)

        return save, load

    def s3fs_files() -> tuple[Callable, Callable]:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        return lambda u: fs.open(u, "wb", block_size=part), lambda u: fs.open(u, "rb", block_size=part)

    def connector_files() -> tuple[Callable, Callable]:
        from s3torchconnector import S3Checkpoint

        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
        checkpoint = S3Checkpoint(region=region, endpoint=endpoint)
        return checkpoint.writer, checkpoint.reader

    methods: dict[str, tuple[Callable | None, Callable]] = {
        "fastpersist": (fastpersist_save, ours(**overrides)),
        "fastpersist-one-get": (None, ours(**one_get)),
        "boto3": (boto3_save, boto3_load),
    }
    skipped: dict[str, str] = {}
    for name, files in zip(_OTHERS, (s3fs_files, connector_files)):
        try:
            methods[name] = streamed(*files())
        except ImportError as e:
            skipped[name] = str(e)
    return methods, skipped


def _section(kind: str, skipped: dict[str, str], rounds: Rounds, verified: dict, nbytes: int, problems: list[str]):
    """The ``kind`` (save or load) results of every method: its summary, or why it was skipped or failed."""
    out: dict[str, Any] = {}
    for name, labels in _LABELS.items():
        label = labels[kind == "load"]
        own, save_error = rounds.errors.get((kind, name)), rounds.errors.get(("save", name))
        if not label:  # a load-only method
            continue
        if name in skipped:
            out[name] = {"label": label, "status": "skipped", "reason": skipped[name]}
        elif own or save_error:
            reason = own or f"its save failed: {save_error}"
            out[name] = {"label": label, "status": "failed", "reason": reason}
            if own and name not in _OTHERS:  # another library failing is its result, not a problem of ours
                problems.append(f"{kind} {name} failed: {reason}")
        else:
            samples = rounds.samples[(kind, name)]
            seconds, peaks = [s["seconds"] for s in samples], [s["peak_rss_delta"] for s in samples]
            stats = measure.summarize(seconds)
            rate = {k: nbytes / stats[s] / 1e9 for k, s in (("median", "median"), ("min", "max"), ("max", "min"))}
            out[name] = {
                "label": label,
                "status": "ok",
                "seconds": stats,
                "samples_s": seconds,
                "gb_per_s": rate,
                "peak_extra_rss_bytes": {"median": sorted(peaks)[len(peaks) // 2], "max": max(peaks)},
            }
            if kind == "load":
                out[name]["verified"] = verified.get(name, "not loaded")
    return out


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """The result document; ImportError without boto3 (or moto), RuntimeError when moto's server does not start."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    from fastpersist.io import memory

    given = (("s3_part_size", args.part_size), ("s3_concurrency", args.concurrency))
    overrides: dict[str, Any] = {name: value for name, value in given if value is not None}
    settings = config.resolve(overrides)
    state = make_state(config.parse_size(args.size))
    expected = workloads.flatten_state(state)
    nbytes = sum(t.numel() * t.element_size() for t in expected[0].values())
    keys = {name: f"{args.prefix}{name}.pt" for name in ("fastpersist", "boto3", *_OTHERS, "warm-up")}
    problems, verified, cross = [], {}, {}

    with _endpoint(args) as (endpoint, endpoint_detail):
        pool = Config(max_pool_connections=max(10, settings.s3_concurrency + 2))
        client = boto3.session.Session().client("s3", config=pool)
        try:
            client.head_bucket(Bucket=args.bucket)
        except ClientError as e:  # a missing bucket is created
            if str(e.response.get("Error", {}).get("Code")) not in ("404", "NoSuchBucket", "NotFound"):
                raise
            client.create_bucket(Bucket=args.bucket)
        methods, skipped = _methods(endpoint, args.bucket, settings, client, nbytes + _MiB)
        rounds = Rounds(args.repeats)
        saves = [name for name, (save, _) in methods.items() if save is not None]
        for name in saves:  # untimed, on a tiny state: imports, connections, fastpersist's pooled ring
            try:
                methods[name][0]({"warm-up": torch.ones(1)}, keys["warm-up"])
                methods[name][1](keys["warm-up"])
            except Exception as e:  # noqa: BLE001 - a method that cannot run is reported, not fatal
                rounds.errors[("save", name)] = f"warm-up: {type(e).__name__}: {e}"
        methods["fastpersist"][0](state, keys["warm-up"])  # the ring at full size

        def save(name: str, index: int) -> dict[str, float]:
            system.release_memory()
            return timed(lambda: methods[name][0](state, keys[name]), memory=True)[1]

        def load(name: str, index: int) -> dict[str, float] | None:
            if ("save", name) in rounds.errors:
                return None  # its save failed: nothing to load
            system.release_memory()
            key = keys.get(name, keys["fastpersist"])  # fastpersist-one-get reads fastpersist's object
            result, stats = timed(lambda: methods[name][1](key), memory=True, touch=True)
            if index == 0:
                verified[name] = harness.check(expected, result, problems, f"load {name}")
            return stats

        rounds.run_ops(saves, methods, save, load)
        saved = rounds.samples.get(("save", "fastpersist"))
        if saved and rounds.samples.get(("save", "boto3")):  # each library reads the other's object, untimed
            name = "fastpersist.load of the torch.save object"
            cross[name] = harness.check(expected, methods["fastpersist"][1](keys["boto3"]), problems, name)
            name = "torch.load of the fastpersist object"
            cross[name] = harness.check(expected, methods["boto3"][1](keys["fastpersist"]), problems, name)
        if saved:  # the ring's cost: one fastpersist save after the pool is freed (its time is not a result)
            memory.release_pooled_buffers()
            system.release_memory()
            ring = timed(lambda: methods["fastpersist"][0](state, keys["fastpersist"]), memory=True)
        for key in keys.values():
            with contextlib.suppress(Exception):
                client.delete_object(Bucket=args.bucket, Key=key)

    results = {kind: _section(kind, skipped, rounds, verified, nbytes, problems) for kind in ("save", "load")}
    if saved:
        results["save"]["fastpersist"]["first_save_peak_extra_rss_bytes"] = ring[1]["peak_rss_delta"]
    ratios = harness.ratios(
        [("save", "fastpersist", "boto3"), ("load", "fastpersist", "boto3")],
        lambda kind, name: (results[kind].get(name) or {}).get("gb_per_s", {}).get("median"),
    )
    run = {"bytes": nbytes, "size": args.size, "tensors": len(expected[0])}
    run.update(dtypes="bf16 and float32, about 16 MiB a tensor", repeats=args.repeats)
    run.update(s3_part_size=settings.s3_part_size, s3_concurrency=settings.s3_concurrency, endpoint=endpoint)
    run.update(server=endpoint_detail, bucket=args.bucket, boto3=boto3.__version__)
    return {
        "benchmark": "s3",
        "schema": SCHEMA,
        "machine": measure.machine_info(None, "cpu"),
        "config": run,
        "results": results,
        "cross_reads": cross,
        "ratios": ratios,
        "problems": problems,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / _MiB:+,.0f} MiB"


def _row(kind: str, entry: dict[str, Any]) -> list[str]:
    if entry["status"] != "ok":
        return [kind, entry["label"], f"{entry['status']}: {entry['reason']}", "-", "-", "-"]
    s, g, check = entry["seconds"], entry["gb_per_s"], entry.get("verified", "-")
    rss = _mib(entry["peak_extra_rss_bytes"]["median"])
    if "first_save_peak_extra_rss_bytes" in entry:
        rss += f" ({_mib(entry['first_save_peak_extra_rss_bytes'])} first save)"
    spread = [f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})" for x in (s, g)]
    return [kind, entry["label"], *spread, rss, "yes" if check is True else str(check)]


def to_markdown(document: dict[str, Any]) -> str:
    """The result as Markdown: one row per operation and method, skipped methods with their reason, the ratios."""
    cfg, machine = document["config"], document["machine"]
    rows = [_row(kind, entry) for kind in ("save", "load") for entry in document["results"][kind].values()]
    header = ["operation", "method", "seconds median (min-max)", "GB/s median (min-max)", "peak extra RSS", "verified"]
    lines = [
        f"{workloads.format_bytes(cfg['bytes'])} in {cfg['tensors']} CPU tensors ({cfg['dtypes']}), "
        f"{cfg['repeats']} repeats, s3_part_size {cfg['s3_part_size'] // _MiB} MiB, "
        f"s3_concurrency {cfg['s3_concurrency']}; {cfg['server']}; "
        f"{machine.get('cpu_count')} CPUs ({machine.get('cpu_model') or 'unknown CPU'})",
        "",
        *markdown_table(header, "<<>>><", rows),
        "",
        *(f"- {name}: {ratio:.2f}x" for name, ratio in document["ratios"].items()),
        *(f"- {name}: {'verified' if ok is True else ok}" for name, ok in document.get("cross_reads", {}).items()),
        *(f"- PROBLEM: {problem}" for problem in document["problems"]),
    ]
    return "\n".join(lines) + "\n"


BENCHMARK = Benchmark(
    "s3",
    _options,
    _measure,
    to_markdown,
    __doc__.partition("\n")[0],
    SCHEMA,
    requires=lambda args: ("boto3",) if args.endpoint else ("boto3", "moto.server"),
    status=lambda document: 1 if document["problems"] else 0,
)
main = BENCHMARK.main
