"""One rank of the multi-process tests in test_distributed.py (spawned by torch.multiprocessing).

``run(rank, world, port, directory, steps)`` joins a gloo group, runs the
named steps in order and writes ``result-<rank>.json`` into ``directory``:
what each step returned, or the error it raised (type, message, failures).
"""

from __future__ import annotations

import errno
import json
import os
import traceback

import torch
import torch.distributed as dist


def make_state(seed: int = 0) -> dict:
    """Uneven sizes: records straddle rank boundaries, one empty tensor, shared storage, non-tensor items."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(3000, 7, generator=generator)
    return {
        "weights": [torch.randn(1000 + 97 * i, 113, generator=generator) for i in range(5)],
        "half": torch.randn(4097, 3, generator=generator).to(torch.bfloat16),
        "ints": torch.arange(12345, dtype=torch.int64),
        "empty": torch.empty(0),
        "view": base[10:20],
        "base": base,
        "step": 17,
        "name": "model",
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def _path(directory: str, rank: int, step: dict) -> str:
    where = step.get("dirs")
    return os.path.join(where[rank] if where else directory, step.get("name", "ckpt.pt"))


def _do(rank: int, world: int, directory: str, step: dict):
    import fastpersist
    from fastpersist.distributed import save as dsave
    from fastpersist.io import engine

    kind = step["op"]
    path = _path(directory, rank, step)
    state = make_state(step.get("seed", 0))
    if step.get("device") == "cuda":  # every rank's tensors on its GPU (ranks share GPUs when there are fewer)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        state = {k: v.cuda() if isinstance(v, torch.Tensor) else [t.cuda() for t in v] if isinstance(v, list) else v
                 for k, v in state.items()}  # fmt: skip
    options = dict(group=dist.group.WORLD, layout=step.get("layout", "file"), writers=step.get("writers", "all"),
                   timeout=step.get("timeout", 20), buffer_size=256 << 10, block_size=64 << 10)  # fmt: skip
    if kind == "save":
        bad = step.get("bad")
        if bad == rank and step.get("fault") == "exception":
            state["bad"] = lambda: None  # not picklable: UnsupportedObjectError on this rank only
        if bad == rank and step.get("fault") == "kill":
            def die(*args, **kwargs):
                os._exit(17)

            dsave.write_plan = die
        if bad == rank and step.get("fault") == "enospc":
            with engine.inject_fault(nth=1, errno=errno.ENOSPC, op="write"):
                fastpersist.save(state, path, **options)
        else:
            fastpersist.save(state, path, **options)
        stats = dsave.last_stats()
        if stats is None:
            return {"plain": True}
        dsave._last.clear()
        return {"bytes": stats.bytes_written, "size": stats.file_size, "writers": stats.writers}
    if kind == "load":
        loaded = fastpersist.load(path, group=dist.group.WORLD, timeout=step.get("timeout", 20), map_location="cpu")
        return {"same": same(loaded, make_state(step.get("seed", 0)))}
    raise ValueError(kind)


def run(rank: int, world: int, port: int, directory: str, steps: list, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    results = []
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world)
        for step in steps:
            try:
                results.append({"ok": _do(rank, world, directory, step)})
            except Exception as e:  # noqa: BLE001 - reported to the test
                results.append({"error": type(e).__name__, "message": str(e),
                                "failures": {str(k): v for k, v in getattr(e, "failures", {}).items()},
                                "traceback": traceback.format_exc()})  # fmt: skip
                if step.get("stop_on_error"):
                    break
    finally:
        with open(os.path.join(directory, f"result-{rank}.json"), "w") as handle:
            json.dump(results, handle)
    os._exit(0)  # no teardown: a peer may be dead, and the group's shutdown is not under test
