"""DeepSpeed's FastFileWriter (deepspeed/io, taken from the checkout given to
run_deepspeed_aio.sh) on top of fastpersist.AioHandle: ``torch.save`` through it
writes files that ``torch.load`` reads back exactly.

Not collected by the repository's own test run (it needs the DeepSpeed path);
run_deepspeed_aio.sh passes it to pytest explicitly.
"""

import pytest
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.io import FastFileWriter, FastFileWriterConfig
from deepspeed.ops.op_builder import AsyncIOBuilder

import fastpersist

PINNED_BYTES = 4 << 20


def _state(device):
    generator = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(1000, 333, generator=generator),
        "b": torch.randn(4097, generator=generator).to(torch.bfloat16),
        "i": torch.arange(12345, dtype=torch.int64),
        "odd": torch.randint(0, 255, (4095,), dtype=torch.uint8, generator=generator),
        "empty": torch.empty(0),
        "meta": {"step": 7, "name": "x"},
    }
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def _pinned(handle, use_cuda_pinned):
    if use_cuda_pinned:
        return torch.zeros(PINNED_BYTES, dtype=torch.uint8).pin_memory()
    return handle.new_cpu_locked_tensor(PINNED_BYTES, torch.empty(0, dtype=torch.uint8))


def _devices():
    devices = ["cpu"]
    if get_accelerator().device_name() == "cuda":
        devices.append("cuda")
    return devices


def test_builder_is_fastpersist():
    handle = AsyncIOBuilder().load().aio_handle()
    assert isinstance(handle, fastpersist.AioHandle)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("double_buffer", [True, False])
@pytest.mark.parametrize("intra_op_parallelism", [1, 2])
def test_torch_save_through_fast_file_writer(tmp_path, device, double_buffer, intra_op_parallelism):
    handle = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, False, intra_op_parallelism)
    use_cuda_pinned = get_accelerator().device_name() == "cuda"
    pinned = _pinned(handle, use_cuda_pinned)
    path = tmp_path / "ckpt.pt"
    state = _state(device)
    config = FastFileWriterConfig(
        dnvme_handle=handle,
        pinned_tensor=pinned,
        double_buffer=double_buffer,
        num_parallel_writers=1,
        writer_rank=0,
    )
    writer = FastFileWriter(file_path=str(path), config=config)
    torch.save(state, writer)
    writer.close()
    loaded = torch.load(path, map_location="cpu", weights_only=False)
    assert _equal(state, loaded)
    # Everything torch.save wrote went through the handle or the writer's unaligned tail.
    assert path.stat().st_size == writer._stats["bytes"]
    if not use_cuda_pinned:
        handle.free_cpu_locked_tensor(pinned)
