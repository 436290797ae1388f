"""A tiny Hugging Face Trainer run (save_steps, save_total_limit, resume), in-process or as a launched program.

    python -m fastpersist.run [--mode snapshot] _hf_trainer_run.py OUT MAX_STEPS STOP_AT RESUME SAVE_STEPS

``STOP_AT``: stop after the checkpoint of that step ("-": run to the end);
``RESUME``: a checkpoint directory ("-": none). The final model and optimizer
state go to OUT/final.bin (by the program's own torch.save) and
fastpersist.patch_stats() to OUT/stats.json, with ``mtime_order``: after each
checkpoint, whether the checkpoints sorted by modification time (the
rotation's order) were in step order, and ``pending``: how many saves were
still pending then. FP_TEST_COMMIT_DELAY=seconds
slows every atomic commit down, so that saves of the snapshot mode are still
pending when the Trainer rotates its checkpoints.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "optimizer.pt",
    "rng_state.pth",
    "scheduler.pt",
    "trainer_state.json",
    "training_args.bin",
]


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


class StopAfterSaving(TrainerCallback):
    def __init__(self, step: int | None):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if self.step is not None and state.global_step >= self.step:
            control.should_training_stop = True  # an interruption right after a checkpoint


class MtimeOrder(TrainerCallback):
    """After each checkpoint (and the rotation), whether sorting the checkpoints by modification time, as the
    rotation does, gives their step order: pending saves must not make an older one look newer."""

    def __init__(self):
        self.orders: list[bool] = []
        self.pending: list[int] = []  # saves still pending when the Trainer had rotated its checkpoints

    def on_save(self, args, state, control, **kwargs):
        import fastpersist

        self.pending.append(len(fastpersist.pending_saves()))
        names = [n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-")]
        by_time = sorted(names, key=lambda n: os.path.getmtime(os.path.join(args.output_dir, n)))
        self.orders.append(by_time == sorted(names, key=lambda n: int(n.split("-")[1])))


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,  # the embedding (128 KiB) and its Adam moments: records fastpersist page-aligns
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def train(out, max_steps=6, stop_at=None, resume=None, save_steps=2) -> dict:
    """Trains; returns copies of the final model and optimizer state."""
    arguments = TrainingArguments(
        str(out),
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    order = MtimeOrder()
    callbacks = [StopAfterSaving(stop_at), order]
    trainer = Trainer(model=model(), args=arguments, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return {
        "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "mtime_order": order.orders,
        "pending": order.pending,
    }


def _slow_commits(delay: float) -> None:
    from fastpersist.io import commit

    replace = commit.replace_file

    def slow(temporary, target, directory, keep=False):
        time.sleep(delay)
        replace(temporary, target, directory, keep)

    commit.replace_file = slow


if __name__ == "__main__":
    out, max_steps, stop_at, resume, save_steps = sys.argv[1:6]
    if os.environ.get("FP_TEST_COMMIT_DELAY"):
        _slow_commits(float(os.environ["FP_TEST_COMMIT_DELAY"]))
    final = train(
        out,
        int(max_steps),
        None if stop_at == "-" else int(stop_at),
        None if resume == "-" else resume,
        int(save_steps),
    )
    orders, pending = final.pop("mtime_order"), final.pop("pending")
    torch.save(final, os.path.join(out, "final.bin"))
    import fastpersist

    with open(os.path.join(out, "stats.json"), "w") as f:
        json.dump({**fastpersist.patch_stats(), "mtime_order": orders, "pending": pending}, f)
