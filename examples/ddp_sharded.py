"""Data-parallel training where every rank writes its slice of each checkpoint.

    torchrun --nproc-per-node 2 examples/ddp_sharded.py --dir /tmp/ddp          # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 examples/ddp_sharded.py --dir /tmp/ddp --async-mode pipelined   # in the background

Each rank holds the same replicated model and optimizer (DDP). With a
fastpersist that has sharded saves (``fastpersist.save(obj, path,
group=...)``) every rank writes a disjoint byte range of one ordinary
checkpoint file, which plain ``torch.load`` reads; otherwise rank 0 writes
it all (the example says which). With ``--async-mode`` the saves go on in
the background while training continues: ``fastpersist.Checkpointer(optimizer,
group=...)`` on every rank, whose optimizer hook holds each step until the
pending save has read (pipelined) or copied (snapshot) this rank's share.
Then every rank resumes from the file and checks it ends with the same
weights as the uninterrupted run.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fastpersist


def build(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(device)
    return model


def step(ddp, optimizer, index, device):
    generator = torch.Generator().manual_seed(index * 100 + dist.get_rank())
    x = torch.randn(32, 64, generator=generator).to(device)
    loss = ddp(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def save(state, path, sharded: bool, checkpointer=None):
    if checkpointer is not None:
        return checkpointer.save(state, path)  # collective, in the background: every rank writes its share
    if sharded:
        fastpersist.save(state, path, group=dist.group.WORLD)  # collective: every rank writes its slice
    else:
        if dist.get_rank() == 0:
            fastpersist.save(state, path)
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--async-mode", choices=["pipelined", "snapshot"], default=None)
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    sharded = "group" in inspect.signature(fastpersist.save).parameters
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "ddp.pt")

    model = build(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    checkpointer = future = None
    if args.async_mode:
        checkpointer = fastpersist.Checkpointer(optimizer, mode=args.async_mode, group=dist.group.WORLD)
    for index in range(args.steps):
        step(ddp, optimizer, index, device)
        if (index + 1) % args.every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": index + 1}
            future = save(state, path, sharded, checkpointer)
    if checkpointer is not None:
        checkpointer.close()  # waits for the pending saves, raises the first error
        wrote = [None] * dist.get_world_size()
        dist.all_gather_object(wrote, future.stats.bytes_written)  # this rank's share of the last checkpoint
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    # Resume every rank from the checkpoint, replay the remaining steps, compare.
    model = build(device)
    state = fastpersist.load(path, map_location=device)
    model.load_state_dict(state["model"])
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    optimizer.load_state_dict(state["optimizer"])
    for index in range(state["step"], args.steps):
        step(ddp, optimizer, index, device)
    same = all(torch.equal(model.state_dict()[k], v) for k, v in reference.items())
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, same)
    if rank == 0:
        plain = torch.load(path, map_location="cpu")  # an ordinary checkpoint
        how = f"in the background ({args.async_mode}), bytes per rank {wrote}" if checkpointer else "synchronous"
        print(
            f"ranks={dist.get_world_size()} backend={dist.get_backend()} "
            f"writers={'every rank (sharded)' if sharded else 'rank 0'} saves={how} step={plain['step']} "
            f"resumed weights identical on all ranks={all(flags)}"
        )
    # Leave nothing of the process group to the interpreter's exit: DDP keeps a reference to it, and a group
    # destroyed during finalization can abort the process (gloo's worker threads release tensors and need
    # the GIL then). Drop the wrappers, then destroy the group while the interpreter is fully alive.
    del ddp, optimizer, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if not all(flags):
        raise SystemExit("a resumed rank differs")


if __name__ == "__main__":
    main()
