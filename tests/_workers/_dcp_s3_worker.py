"""One rank of a 2-rank gloo world for tests/objectstore/test_s3_dcp.py: ``python _dcp_s3_worker.py URL ROOT``.

RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the AWS_* variables (pointing
at the test's moto server) come from the environment; URL is the
``s3://bucket/run`` the checkpoints go under. Each scenario's outcome ("ok"
or the error) goes into ROOT/s3.RANK.json; the test asserts on them, and on
the store.

Scenarios, in order:
  save        -- a DTensor-sharded (6 MiB a rank: two 5 MiB parts) and replicated state to URL/step-1;
  load        -- loaded back from URL/step-1 with FastPersistReader, checked against the full tensors;
  async_save  -- dcp.async_save to URL/async, then loaded back;
  failing     -- a save over URL/step-1 in which rank 1's second UploadPart fails: every rank must raise
                 a CheckpointException naming rank 1 (reported in "failure").
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fastpersist.dcp import FastPersistReader, FastPersistWriter
from fastpersist.io.targets.s3 import connection

SETTINGS = {"s3_part_size": "5M", "s3_concurrency": 2}


def full_state() -> dict:
    """The same full tensors on every rank (seeded); the test process rebuilds them to check the store."""
    generator = torch.Generator().manual_seed(4321)
    return {
        "layer.big": torch.randn(3072, 1024, generator=generator),  # 12 MiB: 6 MiB a rank
        "layer.uneven": torch.randn(31, 7, generator=generator).to(torch.bfloat16),
        "replicated": torch.randn(10, 10, generator=generator),
        "replicated_dtensor": torch.arange(12, dtype=torch.int32),
    }


def sharded(mesh, full: dict, *, blank: bool = False) -> dict:
    state = {}
    for name, tensor in full.items():
        source = torch.zeros_like(tensor) if blank else tensor
        if name == "replicated":
            state[name] = source.clone()
        elif name == "replicated_dtensor":
            state[name] = distribute_tensor(source, mesh, [Replicate()])
        else:
            state[name] = distribute_tensor(source, mesh, [Shard(0)])
    state["step"] = 0 if blank else 42
    return state


def load_and_check(mesh, url: str) -> None:
    full = full_state()
    state = sharded(mesh, full, blank=True)
    dcp.load(state, storage_reader=FastPersistReader(url, **SETTINGS))
    for name, tensor in full.items():
        value = state[name]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if not torch.equal(value, tensor):
            raise AssertionError(f"{name} differs after load")
    if state["step"] != 42:
        raise AssertionError(f"step is {state['step']}")


class FailingClient:
    """A real boto3 client whose n-th ``upload_part`` raises a network error."""

    def __init__(self, client, nth: int):
        self._client = client
        self.meta = client.meta
        self._nth = nth
        self._count = 0

    def __getattr__(self, name):
        method = getattr(self._client, name)
        if name != "upload_part":
            return method

        def upload_part(**arguments):
            self._count += 1
            if self._count == self._nth:
                from botocore.exceptions import ConnectionClosedError

                raise ConnectionClosedError(endpoint_url="http://127.0.0.1:1/injected")
            return method(**arguments)

        return upload_part


def scenario(report: dict, name: str, function) -> None:
    try:
        function()
        report[name] = "ok"
    except BaseException as e:  # noqa: BLE001 - reported to the test
        report[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    dist.barrier()


def main() -> int:
    url, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = full_state()
    report: dict = {}

    scenario(
        report,
        "save",
        lambda: dcp.save(sharded(mesh, full), storage_writer=FastPersistWriter(f"{url}/step-1", **SETTINGS)),
    )
    scenario(report, "load", lambda: load_and_check(mesh, f"{url}/step-1"))

    def async_save() -> None:
        response = dcp.async_save(sharded(mesh, full), storage_writer=FastPersistWriter(f"{url}/async", **SETTINGS))
        getattr(response, "upload_completion", response).result()
        load_and_check(mesh, f"{url}/async")

    scenario(report, "async_save", async_save)

    failure = {"raised": False}

    def failing_save() -> None:
        if rank == 1:
            real = connection.make_client
            connection.make_client = lambda concurrency: FailingClient(real(concurrency), nth=2)
        try:
            dcp.save(sharded(mesh, full), storage_writer=FastPersistWriter(f"{url}/step-1", **SETTINGS))
        except BaseException as e:  # noqa: BLE001 - what every rank raised goes to the test
            inner = [str(f[0] if isinstance(f, tuple) else f) for f in getattr(e, "failures", {}).values()]
            failure.update(raised=True, type=type(e).__name__, ranks=sorted(getattr(e, "failures", {})), inner=inner)
        finally:
            if rank == 1:
                connection.make_client = real

    scenario(report, "failing_ran", failing_save)
    report["failure"] = failure

    with open(os.path.join(root, f"s3.{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
