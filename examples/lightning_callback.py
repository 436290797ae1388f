"""Lightning with fastpersist in one line: the FastPersistCheckpoint callback, then resuming.

    python examples/lightning_callback.py --dir /tmp/lit                 # CPU or one GPU
    python examples/lightning_callback.py --dir /tmp/lit --devices 2     # DDP: every rank writes its slice
    python examples/lightning_callback.py --dir /tmp/lit --async-mode snapshot

Trains a small classifier for --epochs epochs with FastPersistCheckpoint
(a drop-in ModelCheckpoint: top-2 by loss plus last.ckpt), then starts a new
Trainer that resumes from last.ckpt with ``ckpt_path=`` and trains one more
epoch. Runs in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import os

import torch
from lightning.pytorch import LightningModule, Trainer

import fastpersist
from fastpersist.integrations.lightning import FastPersistCheckpoint


class Classifier(LightningModule):
    def __init__(self, width: int = 64, hidden: int = 256):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, 4),
        )  # fmt: skip

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(256, self.hparams.width, generator=generator)
        y = torch.randint(0, 4, (256,), generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def make_trainer(args, epochs: int) -> Trainer:
    callback = FastPersistCheckpoint(
        dirpath=os.path.join(args.dir, "checkpoints"), monitor="train_loss", save_top_k=2, save_last=True,
        every_n_train_steps=4, async_mode=args.async_mode,
    )  # fmt: skip
    return Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=args.dir, callbacks=[callback],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--async-mode", choices=["snapshot", "pipelined"], default=None)
    parser.add_argument("--check", action="store_true", help="assert the checkpoint and the resume (tests)")
    args = parser.parse_args()

    trainer = make_trainer(args, args.epochs)
    model = Classifier()
    trainer.fit(model)
    last = os.path.join(args.dir, "checkpoints", "last.ckpt")
    if trainer.is_global_zero:
        state = torch.load(last, weights_only=False, map_location="cpu")  # an ordinary torch checkpoint
        print(f"saved {sorted(os.listdir(os.path.dirname(last)))}, global_step={state['global_step']}, "
              f"ranks={trainer.world_size}, io={type(trainer.strategy.checkpoint_io).__name__}")  # fmt: skip
        if args.check:
            fastpersist.verify(last)
            weights = {k: v.cpu() for k, v in model.state_dict().items()}
            assert all(torch.equal(state["state_dict"][k], v) for k, v in weights.items())
            assert len(os.listdir(os.path.dirname(last))) == 3

    resumed = make_trainer(args, args.epochs + 1)
    resumed.fit(Classifier(), ckpt_path=last)
    if resumed.is_global_zero:
        print(f"resumed at epoch {args.epochs}, finished epoch {resumed.current_epoch} "
              f"at global_step={resumed.global_step}")  # fmt: skip
        if args.check:
            assert resumed.current_epoch == args.epochs + 1


if __name__ == "__main__":
    main()
