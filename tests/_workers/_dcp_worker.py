"""One rank of a gloo world for tests/dcp/test_dcp.py: ``python _dcp_worker.py PHASE ROOT``.

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment.
Each scenario's outcome ("ok" or the error) goes into ROOT/PHASE.RANK.json;
the test asserts on them, so one failing scenario does not hide the others.

Phases (run in this order by the test):
  save2  -- 2 ranks save a DTensor-sharded + replicated state with fastpersist, read it back both ways;
  world4 -- 4 ranks: save with fastpersist and FileSystemWriter, cross-read, load the 2-rank
            checkpoint (resharding 2 -> 4), async_save, and a save where rank 2 fails;
  load2  -- 2 ranks load the 4-rank checkpoints (resharding 4 -> 2);
  fsdp2  -- 2 ranks: an FSDP2 (fully_shard) model and its AdamW state, saved and resumed through
            fastpersist and FileSystemWriter/Reader both ways (gloo on CPU, NCCL on two GPUs);
  nccl   -- 2 ranks on two GPUs: DTensor save, load both ways, async_save.
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
        "layer.uneven": torch.randn(30, 7, generator=generator).to(torch.bfloat16),  # 30 rows over 4 ranks
        "layer.big": torch.randn(256, 1024, generator=generator),  # 1 MiB: the zero-copy direct path
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
        raise AssertionError(f"non-tensor values differ: {state['step']}, {state['extra']}")


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


def fsdp2(report: dict, mesh, device: str, rank: int, path) -> None:
    """FSDP2 (``fully_shard``) model and AdamW state through DCP: ours and FileSystemWriter/Reader both ways.

    A loaded run continues exactly like the one that saved (two more steps, bitwise equal).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 20)).to(device)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, optimizer, first: int, count: int) -> None:
        for step in range(first, first + count):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step * 10 + rank)).to(device)
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    def full(model) -> dict:
        return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}

    model, optimizer = build()
    train(model, optimizer, 0, 3)

    def save(writer, name: str) -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, storage_writer=writer(path(name)))

    def resume(reader, name: str) -> None:
        other, other_optimizer = build()
        model_state, optimizer_state = get_state_dict(other, other_optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        dcp.load(state, storage_reader=reader(path(name)))
        set_state_dict(other, other_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if any(not torch.equal(v, saved[k]) for k, v in full(other).items()):
            raise AssertionError("loaded weights differ")
        train(other, other_optimizer, 3, 2)
        if any(not torch.equal(v, continued[k]) for k, v in full(other).items()):
            raise AssertionError("a resumed run differs from the run that saved")

    scenario(report, "fsdp2_save_fastpersist", lambda: save(FastPersistWriter, "fsdp-fp"))
    scenario(report, "fsdp2_save_filesystem_writer", lambda: save(FileSystemWriter, "fsdp-fs"))
    saved = full(model)
    train(model, optimizer, 3, 2)  # the run that saved goes on: what every resumed run must reach
    continued = full(model)
    scenario(report, "fsdp2_load_fastpersist", lambda: resume(FastPersistReader, "fsdp-fp"))
    scenario(report, "fsdp2_filesystem_reader_reads_ours", lambda: resume(FileSystemReader, "fsdp-fp"))
    scenario(report, "fsdp2_fastpersist_reads_filesystem_writer", lambda: resume(FastPersistReader, "fsdp-fs"))


def main() -> int:
    phase, root = sys.argv[1], sys.argv[2]
    device = os.environ.get("DCP_TEST_DEVICE", "cpu")
    if device == "cuda":  # NCCL for the tensors, gloo for DCP's object collectives and async_save
        torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device, (world,))
    full = full_state()
    report: dict = {}

    def path(name):
        return os.path.join(root, name)

    if phase == "save2":
        scenario(
            report,
            "save_fastpersist",
            lambda: dcp.save(sharded(mesh, full), storage_writer=FastPersistWriter(path("fp2"))),
        )
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
        scenario(
            report,
            "save_fastpersist",
            lambda: dcp.save(sharded(mesh, full), storage_writer=FastPersistWriter(path("fp4"))),
        )
        scenario(
            report,
            "save_filesystem_writer",
            lambda: dcp.save(sharded(mesh, full), storage_writer=FileSystemWriter(path("fs4"))),
        )
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
        scenario(
            report, "fastpersist_reads_filesystem_writer", lambda: load_and_check(mesh, path("fs4"), FastPersistReader)
        )
        scenario(
            report,
            "reshard_2_to_4",
            lambda: load_and_check(mesh, path("fp2"), FastPersistReader),
        )

        def async_save() -> None:
            response = dcp.async_save(sharded(mesh, full), storage_writer=FastPersistWriter(path("async4")))
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
        scenario(
            report,
            "save_fastpersist",
            lambda: dcp.save(sharded(mesh, full), storage_writer=FastPersistWriter(path("nccl"))),
        )
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
    elif phase == "fsdp2":
        fsdp2(report, mesh, device, rank, path)
    elif phase == "load2":
        scenario(
            report,
            "reshard_4_to_2",
            lambda: load_and_check(mesh, path("fp4"), FastPersistReader),
        )
        scenario(
            report, "reshard_4_to_2_filesystem_writer", lambda: load_and_check(mesh, path("fs4"), FastPersistReader)
        )
    else:
        raise SystemExit(f"unknown phase {phase!r}")

    with open(os.path.join(root, f"{phase}.{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
