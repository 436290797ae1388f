"""A plain PyTorch training loop that checkpoints every N steps, then resumes.

    python examples/train_loop.py --dir /tmp/loop --mode sync
    python examples/train_loop.py --dir /tmp/loop --mode pipelined   # async, no copy; waits before optimizer.step
    python examples/train_loop.py --dir /tmp/loop --mode snapshot    # async, pinned host copy first

Trains a small MLP for --steps steps, saving model + optimizer + step every
--every steps to one file, then starts over from that file and checks that
the resumed run ends with exactly the weights of an uninterrupted one.
Runs in seconds on a CPU; uses the GPU when there is one.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import fastpersist


def build(device: str, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def batch(step: int, device: str):
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 128, generator=generator)
    y = torch.randint(0, 10, (64,), generator=generator)
    return x.to(device), y.to(device)


def train(model, optimizer, start: int, stop: int, device: str, save=None, every: int = 0) -> None:
    for step in range(start, stop):
        x, y = batch(step, device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()  # with a Checkpointer: waits here for a pending pipelined save
        optimizer.zero_grad(set_to_none=True)
        if save is not None and (step + 1) % every == 0:
            save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mode", choices=["sync", "pipelined", "snapshot"], default="pipelined")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"{args.mode}.pt")

    # 1. Train, checkpointing every --every steps.
    model, optimizer = build(args.device)
    started = time.perf_counter()
    if args.mode == "sync":
        train(model, optimizer, 0, args.steps, args.device, lambda state: fastpersist.save(state, path), args.every)
    else:
        with fastpersist.Checkpointer(optimizer, model=model, mode=args.mode) as checkpointer:
            train(
                model, optimizer, 0, args.steps, args.device, lambda state: checkpointer.save(state, path), args.every
            )
        # leaving the block waited for the last save and raised any error
    elapsed = time.perf_counter() - started
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    # 2. "Crash" after step --steps and resume from the checkpoint, in a fresh model and optimizer.
    model, optimizer = build(args.device, seed=123)
    state = fastpersist.load(path, map_location=args.device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    assert state["step"] == args.steps - args.steps % args.every
    train(model, optimizer, state["step"], args.steps, args.device)
    same = all(torch.equal(model.state_dict()[k], v) for k, v in reference.items())
    print(
        f"mode={args.mode} device={args.device} steps={args.steps} saves={args.steps // args.every} "
        f"train+checkpoint {elapsed:.2f}s; resumed from step {state['step']}: weights identical={same}"
    )
    if not same:
        raise SystemExit("the resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
