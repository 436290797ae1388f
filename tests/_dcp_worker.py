"""One rank of a gloo world for tests/test_dcp.py: ``python _dcp_worker.py PHASE ROOT``.

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment.
Each scenario's outcome ("ok" or the error) goes into ROOT/PHASE.RANK.json;
the test asserts on them, so one failing scenario does not hide the others.

Phases (run in this order by the test):
  save2  -- 2 ranks save a DTensor-sharded + replicated state with fastpersist, read it back both ways;
  world4 -- 4 ranks: save with fastpersist and FileSystemWriter, cross-read, load the 2-rank
            checkpoint (resharding 2 -> 4), async_save, and a save where rank 2 fails;
  load2  -- 2 ranks load the 4-rank checkpoints (resharding 4 -> 2).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fastpersist.dcp import FastPersistReader, FastPersistWriter
from fastpersist.io import engine


def full_state() -> dict:
    """The same full tensors on every rank (seeded)."""
    generator = torch.Generator().manual_seed(1234)
    return {
        "layer.weight": torch.randn(64, 24, generator=generator),
        "layer.uneven": torch.randn(30, 7, generator=generator).to(
            torch.bfloat16
        ),  # 30 rows over 4 ranks
        "layer.big": torch.randn(
            256, 1024, generator=generator
        ),  # 1 MiB: the zero-copy direct path
        "replicated": torch.randn(10, 10, generator=generator),
        "replicated_dtensor": torch.arange(12, dtype=torch.int32),
    }


def sharded(mesh, full: dict, *, blank: bool = False) -> dict:
    state = {}
    for name, tensor in full.items():
        source = (torch.zeros_like(tensor) if blank else tensor).to(mesh.device_type)
        if name == "replicated":
            state[name] = source.clone()
        elif name == "replicated_dtensor":
            state[name] = distribute_tensor(source, mesh, [Replicate()])
        else:
            state[name] = distribute_tensor(source, mesh, [Shard(0)])
    state["step"] = 0 if blank else 42
    state["extra"] = {"lr": 0.0 if blank else 0.5}
    return state


def check(state: dict, full: dict) -> None:
    for name, tensor in full.items():
        value = state[name]
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if not torch.equal(value.cpu(), tensor):
            raise AssertionError(f"{name} differs after load")
    if state["step"] != 42 or state["extra"]["lr"] != 0.5:
        raise AssertionError(
            f"non-tensor values differ: {state['step']}, {state['extra']}"
        )


def load_and_check(mesh, path: str, reader) -> None:
    full = full_state()
    state = sharded(mesh, full, blank=True)
    dcp.load(state, storage_reader=reader(path))
    check(state, full)


def scenario(report: dict, name: str, function) -> None:
    try:
        function()
        report[name] = "ok"
    except BaseException as e:  # noqa: BLE001 - reported to the test
        report[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    dist.barrier()


def main() -> int:
    phase, root = sys.argv[1], sys.argv[2]
    device = os.environ.get("DCP_TEST_DEVICE", "cpu")
    if (
        device == "cuda"
    ):  # NCCL for the tensors, gloo for DCP's object collectives and async_save
        torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device, (world,))
    full = full_state()
    report: dict = {}
    path = lambda name: os.path.join(root, name)

    if phase == "save2":
        scenario(report, "save_fastpersist",
                 lambda: dcp.save(sharded(mesh, full), storage_writer=FastPersistWriter(path("fp2"))))  # fmt: skip
        scenario(
            report,
            "load_fastpersist",
            lambda: load_and_check(mesh, path("fp2"), FastPersistReader),
        )
        scenario(
            report,
            "load_filesystem_reader",
            lambda: load_and_check(mesh, path("fp2"), FileSystemReader),
        )
    elif phase == "world4":
        scenario(report, "save_fastpersist",
                 lambda: dcp.save(sharded(mesh, full), storage_writer=FastPersistWriter(path("fp4"))))  # fmt: skip
        scenario(report, "save_filesystem_writer",
                 lambda: dcp.save(sharded(mesh, full), storage_writer=FileSystemWriter(path("fs4"))))  # fmt: skip
        scenario(
            report,
            "load_fastpersist",
            lambda: load_and_check(mesh, path("fp4"), FastPersistReader),
        )
        scenario(
            report,
            "filesystem_reader_reads_ours",
            lambda: load_and_check(mesh, path("fp4"), FileSystemReader),
        )
        scenario(report, "fastpersist_reads_filesystem_writer",
                 lambda: load_and_check(mesh, path("fs4"), FastPersistReader))  # fmt: skip
        scenario(
            report,
            "reshard_2_to_4",
            lambda: load_and_check(mesh, path("fp2"), FastPersistReader),
        )

        def async_save() -> None:
            response = dcp.async_save(
                sharded(mesh, full), storage_writer=FastPersistWriter(path("async4"))
            )
            getattr(response, "upload_completion", response).result()
            load_and_check(mesh, path("async4"), FastPersistReader)

        scenario(report, "async_save", async_save)

        failure = {"raised": False}

        def failing_save() -> None:
            state = sharded(mesh, full)
            try:
                if rank == 2:
                    with engine.inject_fault(nth=1, op="write"):
                        dcp.save(state, storage_writer=FastPersistWriter(path("fail4")))
                else:
                    dcp.save(state, storage_writer=FastPersistWriter(path("fail4")))
            except BaseException as e:  # noqa: BLE001
                failure.update(
                    raised=True,
                    type=type(e).__name__,
                    message=str(e) + repr(getattr(e, "failures", "")),
                )

        scenario(report, "failing_save_ran", failing_save)
        report["failing_rank"] = failure
    elif phase == "nccl":
        scenario(report, "save_fastpersist",
                 lambda: dcp.save(sharded(mesh, full), storage_writer=FastPersistWriter(path("nccl"))))  # fmt: skip
        scenario(
            report,
            "load_fastpersist",
            lambda: load_and_check(mesh, path("nccl"), FastPersistReader),
        )
        scenario(
            report,
            "load_filesystem_reader",
            lambda: load_and_check(mesh, path("nccl"), FileSystemReader),
        )

        def async_save() -> None:
            response = dcp.async_save(
                sharded(mesh, full),
                storage_writer=FastPersistWriter(path("nccl-async")),
            )
            getattr(response, "upload_completion", response).result()
            load_and_check(mesh, path("nccl-async"), FastPersistReader)

        scenario(report, "async_save", async_save)
    elif phase == "load2":
        scenario(
            report,
            "reshard_4_to_2",
            lambda: load_and_check(mesh, path("fp4"), FastPersistReader),
        )
        scenario(report, "reshard_4_to_2_filesystem_writer",
                 lambda: load_and_check(mesh, path("fs4"), FastPersistReader))  # fmt: skip
    else:
        raise SystemExit(f"unknown phase {phase!r}")

    with open(os.path.join(root, f"{phase}.{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
