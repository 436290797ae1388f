"""One rank of the multi-process tests in test_distributed.py (spawned by torch.multiprocessing).

``run(rank, world, port, directory, steps)`` joins a gloo group, runs the
named steps in order and writes ``result-<rank>.json`` into ``directory``:
what each step returned, or the error it raised (type, message, failures).
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist


def make_state(seed: int = 0, rank: int = 0, variant: str | None = None) -> dict:
    """Uneven sizes: records straddle rank boundaries, one empty tensor, shared storage, non-tensor items.

    ``variant``: ``"per_rank"`` adds what differs between real data-parallel
    ranks: a per-rank 4 MiB permutation and a tiny RNG-like tensor (same key
    and size, other values), a per-rank Python int, and the same values held
    with another ``requires_grad``, storage offset or memory layout (one of
    them column-major on rank 1: same key, size and values, other bytes);
    ``"drift"`` does that and also makes one replicated weight drift.
    """
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(3000, 7, generator=generator)
    state = {
        "weights": [torch.randn(1000 + 97 * i, 113, generator=generator) for i in range(5)],
        "half": torch.randn(4097, 3, generator=generator).to(torch.bfloat16),
        "ints": torch.arange(12345, dtype=torch.int64),
        "empty": torch.empty(0),
        "view": base[10:20],
        "base": base,
        "step": 17,
        "name": "model",
    }
    if variant in ("per_rank", "drift"):
        own = torch.Generator().manual_seed(1000 + rank)
        state["sampler"] = torch.randperm(1 << 19, generator=own)
        state["rng"] = torch.randint(0, 1 << 30, (5,), generator=own)
        state["position"] = 100 + rank
        state["flagged"] = state["weights"][0].clone().requires_grad_(rank == 1)
        state["shifted"] = torch.cat([torch.zeros(7 * rank), base.flatten()])[7 * rank :]
        state["layout"] = base.t().contiguous() if rank == 0 else base.t()
        # Same key and size, same values, other bytes: rank 1 keeps this weight column-major.
        state["colmajor"] = state["weights"][1] * 2 if rank == 0 else (state["weights"][1] * 2).t().contiguous().t()
    if variant == "drift":
        state["weights"][2] = state["weights"][2] + rank * 1e-3
    return state


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def make_big(seed: int = 0) -> torch.Tensor:
    """16 MiB: with ``s3_part_size="5M"`` each of two ranks uploads its share as a multipart upload."""
    return torch.randn(4 << 20, generator=torch.Generator().manual_seed(seed))


class FaultyClient:
    """A real boto3 client whose methods named in ``fail`` raise a network error at their n-th call (1-based)."""

    def __init__(self, client, fail: dict):
        import threading

        self._client = client
        self._fail = fail
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self.meta = client.meta

    def __getattr__(self, name):
        method = getattr(self._client, name)
        if name not in self._fail:
            return method

        def call(**arguments):
            from botocore.exceptions import ConnectionClosedError

            with self._lock:
                count = self._calls[name] = self._calls.get(name, 0) + 1
            if count == self._fail[name]:
                raise ConnectionClosedError(endpoint_url=f"http://127.0.0.1:1/injected-{name}")
            return method(**arguments)

        return call


_REAL_MAKE_CLIENT: dict = {}
_PENDING: list = []  # async saves a step left pending on purpose


def _on_device(state: dict, step: dict, rank: int) -> dict:
    if step.get("device") != "cuda":
        return state
    # Every rank's tensors on its GPU (ranks share GPUs when there are fewer).
    torch.cuda.set_device(rank % torch.cuda.device_count())
    state = {
        k: v.cuda() if isinstance(v, torch.Tensor) else [t.cuda() for t in v] if isinstance(v, list) else v
        for k, v in state.items()
    }
    if "base" in state:
        state["view"] = state["base"][10:20]  # still a view of "base" (one storage), as on the CPU
    return state


def _burst(rank: int, directory: str, step: dict, options: dict, overrides: dict) -> dict:
    """``count`` asynchronous collective saves in a row, modes alternating, not waited for one by one; after
    every ``every``-th a synchronous collective save and a collective load of the last async one."""
    import fastpersist

    group = dist.group.WORLD
    futures, loads = [], []
    for i in range(step["count"]):
        state = _on_device(make_state(100 + i), step, rank)
        mode = "pipelined" if i % 2 else "snapshot"
        where = os.path.join(directory, f"burst-{i}.pt")
        futures.append(fastpersist.async_save(state, where, group=group, mode=mode, **options, **overrides))
        if (i + 1) % step["every"] == 0:
            k = (i + 1) // step["every"] - 1
            state = _on_device(make_state(200 + k), step, rank)
            fastpersist.save(state, os.path.join(directory, f"sync-{k}.pt"), group=group, **options, **overrides)
            loaded = fastpersist.load(where, group=group, timeout=options["timeout"], map_location="cpu")
            loads.append(same(_to_cpu(loaded), make_state(100 + i)))
    for future in futures:
        future.result()
    return {"loads": loads}


def _path(directory: str, rank: int, step: dict) -> str:
    if "url" in step:  # s3://bucket/key (tests/objectstore): the same on every rank
        return step["url"]
    where = step.get("dirs")
    name = step.get("name", "ckpt.pt").format(rank=rank)  # "r{rank}.pt": per-rank paths (a mistake)
    return os.path.join(where[rank] if where else directory, name)


def _per_rank(value, rank: int):
    """A step's option, or (a list) each rank's own value of it (a mistake a test makes on purpose)."""
    return value[rank] if isinstance(value, list) else value


def _do(rank: int, world: int, directory: str, step: dict):
    import fastpersist
    from fastpersist.distributed import save as dsave
    from fastpersist.io import engine

    kind = step["op"]
    path = _path(directory, rank, step)
    seed = rank if step.get("seed") == "rank" else step.get("seed", 0)  # "rank": nothing in common
    state = make_state(seed, rank, step.get("variant"))
    if step.get("big"):
        state["big"] = make_big(seed)
    if step.get("only") is not None and step["only"] != rank:
        return {"skipped": True}  # a call made on one rank only (inside `if rank == ...:`)
    state = _on_device(state, step, rank)
    options = dict(
        layout=_per_rank(step.get("layout", None if "url" in step else "file"), rank),
        writers=_per_rank(step.get("writers", "all"), rank),
        timeout=step.get("timeout", 20),
    )
    if options["timeout"] is None:
        del options["timeout"]  # the default (600 s)
    if "divergence" in step:
        options["divergence"] = step["divergence"]
    if "per_rank" in step:
        options["per_rank"] = step["per_rank"]
    overrides = dict(buffer_size=256 << 10, block_size=64 << 10)
    if "s3_part_size" in step:
        overrides["s3_part_size"] = step["s3_part_size"]
    if "url" in step:
        from fastpersist.io.targets.s3 import connection

        connection.make_client = _REAL_MAKE_CLIENT.setdefault("s3", connection.make_client)  # no earlier step's fault
        fail = step.get("s3_faults", {}).get(str(rank))  # {rank: {client method: the n-th call that fails}}
        if fail:
            real = connection.make_client
            connection.make_client = lambda concurrency: FaultyClient(real(concurrency), fail)
    if kind == "save":
        bad = step.get("bad")
        if bad == rank and step.get("fault") == "exception":
            state["bad"] = lambda: None  # not picklable: UnsupportedObjectError on this rank only
        if bad == rank and step.get("fault") == "kill":

            def die(*args, **kwargs):
                os._exit(17)

            dsave.write_plan = die
        if bad == rank and step.get("fault") == "interrupt":

            def interrupt(*args, **kwargs):
                raise KeyboardInterrupt

            dsave.write_plan = interrupt

        gate = None
        if bad == rank and step.get("fault") == "modify":  # the write waits until the caller changed a tensor
            import threading

            gate, real = threading.Event(), dsave.write_plan

            def held(*args, **kwargs):
                gate.wait(30)
                return real(*args, **kwargs)

            dsave.write_plan = held

        def save():
            if not dsave.is_collective(dist.group.WORLD):  # a group of one rank: the public save, a plain one
                fastpersist.save(state, path, group=dist.group.WORLD, **options, **overrides)
                return None
            if step.get("async"):  # fastpersist.async_save(group=...): its future carries the stats
                future = fastpersist.async_save(
                    state, path, group=dist.group.WORLD, mode=step["async"], **options, **overrides
                )
                if gate is not None:
                    with torch.no_grad():
                        state["weights"][0].add_(1)  # the optimizer step, too early
                    gate.set()
                if step.get("pending"):  # leave it pending: the process exits next (see run)
                    _PENDING.append(future)
                    return None
                future.result()
                return future.stats
            settings = fastpersist.config.resolve(overrides)
            return dsave.save(state, path, group=dist.group.WORLD, settings=settings, **options)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if bad == rank and step.get("fault") == "enospc":
                    with engine.inject_fault(nth=1, errno=errno.ENOSPC, op="write"):
                        stats = save()
                else:
                    stats = save()
            finally:
                if gate is not None:
                    dsave.write_plan = real
        if stats is None:
            return {"plain": True}
        return {
            "bytes": stats.bytes_written,
            "size": stats.file_size,
            "writers": stats.writers,
            "shared": stats.shared_bytes,
            "divergent": list(stats.divergent),
            "repaired": stats.repaired_bytes,
            "warnings": [
                f"{w.category.__name__}: {w.message}"
                for w in caught
                if issubclass(w.category, fastpersist.errors.ReplicaDivergenceWarning)
            ],
            "warned_at": [
                os.path.basename(w.filename)
                for w in caught
                if issubclass(w.category, fastpersist.errors.ReplicaDivergenceWarning)
            ],
        }
    if kind == "burst":
        return _burst(rank, directory, step, options, overrides)
    if kind == "load":
        where = step.get("map_location", "cpu")
        if where == "own":  # this rank's GPU, whatever device the file names (as torch.load(map_location=...))
            where = f"cuda:{rank % torch.cuda.device_count()}"
        loaded = fastpersist.load(path, group=dist.group.WORLD, timeout=step.get("timeout", 20), map_location=where)
        devices = sorted({str(t.device) for t in _tensors(loaded)})
        expected = make_state(step.get("seed", 0), 0, step.get("variant"))
        if step.get("big"):
            expected["big"] = make_big(step.get("seed", 0))
        return {"same": same(_to_cpu(loaded), expected), "devices": devices}
    if kind == "exchange":  # the coordinator alone: which steps leave every rank's "read" mark in the store
        from fastpersist.distributed.coordinator import Coordinator

        coordinator = Coordinator(dist.group.WORLD, 20, "exchange", step.get("name", ""))
        assert coordinator.exchange("first", rank, last=False) == list(range(world))
        assert coordinator.exchange("last", rank) == list(range(world))
        failed = None
        try:
            coordinator.exchange("failing", rank, error=ValueError("bad") if rank == world - 1 else None, last=False)
        except fastpersist.errors.DistributedCheckpointError as error:
            failed = sorted(error.failures)
        dist.barrier()
        prefix = f"{coordinator.namespace}/{coordinator.call}/"
        marks = {
            name: bool(coordinator.store.check([f"{prefix}{name}/read/{r}" for r in range(world)]))
            for name in ("first", "last", "failing")
        }
        dist.barrier()  # rank 0 hosts the store: it stays until every rank has looked
        return {"marks": marks, "failed": failed}
    raise ValueError(kind)


def _tensors(item) -> list:
    if isinstance(item, torch.Tensor):
        return [item]
    if isinstance(item, dict):
        return [t for v in item.values() for t in _tensors(v)]
    if isinstance(item, (list, tuple)):
        return [t for v in item for t in _tensors(v)]
    return []


def _to_cpu(item):
    if isinstance(item, torch.Tensor):
        return item.cpu()
    if isinstance(item, dict):
        return {k: _to_cpu(v) for k, v in item.items()}
    if isinstance(item, list):
        return [_to_cpu(v) for v in item]
    return item


def tag_as_cuda(rank: int) -> None:
    """Pickle this rank's CPU storages with the location tag ``cuda:<rank>``, as one GPU per rank does."""
    torch.serialization.register_package(
        1, lambda s: f"cuda:{rank}" if s.device.type == "cpu" else None, lambda s, location: None
    )


def run(
    rank: int, world: int, port: int, directory: str, steps: list, backend: str = "gloo", tag_cuda: bool = False
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    results = []
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if tag_cuda:
            tag_as_cuda(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        for step in steps:
            began = time.monotonic()
            try:
                results.append({"ok": _do(rank, world, directory, step)})
            except BaseException as e:  # noqa: BLE001 - reported to the test (KeyboardInterrupt too)
                results.append(
                    {
                        "error": type(e).__name__,
                        "message": str(e),
                        "failures": {str(k): v for k, v in getattr(e, "failures", {}).items()},
                        "traceback": traceback.format_exc(),
                    }
                )
                if step.get("stop_on_error"):
                    results[-1]["seconds"] = time.monotonic() - began
                    break
            results[-1]["seconds"] = time.monotonic() - began
    finally:
        with open(os.path.join(directory, f"result-{rank}.json"), "w") as handle:
            json.dump(results, handle)
    if _PENDING:
        return  # an ordinary exit, with a save pending: the interpreter's exit must complete it
    _finish_background_work()
    os._exit(0)  # no teardown: a peer may be dead, and the group's shutdown is not under test


def _finish_background_work() -> None:
    """Finishes what an ordinary exit would (the unlinks of replaced parts on workers' background thread), which
    os._exit skips: a marker queued after them runs once they are done (the thread runs its tasks in order)."""
    from fastpersist.io import workers

    done = threading.Event()
    workers.in_background(done.set)
    done.wait(60)
