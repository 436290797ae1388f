"""Libraries' own checkpoints through ``fastpersist.patch`` (issue 45): Hugging Face Trainer, accelerate, Lightning.

Hugging Face Trainer with a tiny model (``save_steps``, ``save_total_limit``,
``resume_from_checkpoint``) under ``patch()``, under the launcher, and in
snapshot mode with slowed commits while the Trainer rotates its checkpoints:
the resumed run's weights and optimizer state equal an uninterrupted run's,
the files were written by fastpersist (its page-aligned records, its counters)
and unpatched transformers and torch load them. accelerate's
``save_state``/``load_state`` and Lightning with its default ``TorchCheckpointIO``
under ``patch()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch

import fastpersist

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import _hf_trainer_run as run
import safetensors.torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORIGINAL_LOAD = torch.load


def page_aligned(path) -> bool:
    """Whether the storages of at least 64 KiB sit at 4 KiB-aligned offsets: fastpersist's layout (torch's is 64 B)."""
    with zipfile.ZipFile(path) as archive:
        large = [i.filename for i in archive.infolist() if "/data/" in i.filename and i.file_size >= 64 << 10]
    reader = torch._C.PyTorchFileReader(str(path))
    return bool(large) and all(reader.get_record_offset(n.split("/", 1)[1]) % 4096 == 0 for n in large)


def equal_states(a: dict, b: dict) -> bool:
    model = a["model"].keys() == b["model"].keys() and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"]
    )
    first, second = a["optimizer"]["state"], b["optimizer"]["state"]
    moments = first.keys() == second.keys() and all(
        torch.equal(first[i][k], second[i][k]) for i in first for k in first[i]
    )
    return model and moments and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


def counts(before: dict, after: dict, route: str = "fastpersist") -> dict:
    return {k: v - before.get(route, {}).get(k, 0) for k, v in after.get(route, {}).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 6 steps without interruption, unpatched."""
    return run.train(tmp_path_factory.mktemp("uninterrupted"), max_steps=6)


def check_checkpoints(out, names: list[str], final: dict | None) -> None:
    """The rotation kept exactly ``names``, each complete and written by fastpersist; unpatched libraries load them."""
    assert torch.load is ORIGINAL_LOAD, "checked without the patch"
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == names
    for name in names:
        assert sorted(os.listdir(out / name)) == run.FILES, name
        assert page_aligned(out / name / "optimizer.pt"), name
    if final is None:
        return
    last = out / names[-1]
    loaded = transformers.LlamaForCausalLM.from_pretrained(last).state_dict()
    assert all(torch.equal(loaded[k], final["model"][k]) for k in loaded)
    optimizer = torch.load(last / "optimizer.pt")
    assert all(
        torch.equal(optimizer["state"][i][k], v) for i, s in final["optimizer"]["state"].items() for k, v in s.items()
    )


def test_trainer_under_patch_resumes_like_an_uninterrupted_run(tmp_path, uninterrupted):
    before = fastpersist.patch_stats()
    with fastpersist.patch():
        run.train(tmp_path, max_steps=6, stop_at=4)
        assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
        resumed = run.train(tmp_path, max_steps=6, resume=tmp_path / "checkpoint-4")
    assert equal_states(resumed, uninterrupted)
    check_checkpoints(tmp_path, ["checkpoint-4", "checkpoint-6"], resumed)
    # Three checkpoints: 3 model.safetensors and 4 torch files each; the resume read the optimizer,
    # scheduler and RNG state (torch.load) and the weights (safetensors) through fastpersist.
    handled = counts(before, fastpersist.patch_stats())
    assert handled["save_file"] == 3 and handled["torch.save"] == 12, handled
    assert handled["torch.load"] >= 3 and handled.get("load_file", 0) + handled.get("safe_open", 0) >= 1, handled
    assert counts(before, fastpersist.patch_stats(), "original").get("torch.save", 0) == 0


def launch(out, *arguments: str, mode: str = "sync", delay: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests", "_workers")]))
    if delay:
        env["FP_TEST_COMMIT_DELAY"] = delay
    command = [sys.executable, "-m", "fastpersist.run", "--mode", mode, run.__file__, str(out), *arguments]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def launched_final(out) -> dict:
    with open(out / "stats.json") as f:
        stats = json.load(f)
    assert stats["fastpersist"]["torch.save"] >= 5 and stats["fastpersist"]["save_file"] >= 1, stats
    assert all(stats["mtime_order"]), "sorted by modification time, the checkpoints were in order"
    assert page_aligned(out / "final.bin")
    return torch.load(out / "final.bin")


def test_trainer_under_the_launcher_resumes_like_an_uninterrupted_run(tmp_path, uninterrupted):
    launch(tmp_path, "6", "4", "-", "2")
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
    launch(tmp_path, "6", "-", str(tmp_path / "checkpoint-4"), "2")
    final = launched_final(tmp_path)
    assert equal_states(final, uninterrupted)
    check_checkpoints(tmp_path, ["checkpoint-4", "checkpoint-6"], final)


def test_trainer_in_snapshot_mode_survives_its_own_rotation_with_saves_pending(tmp_path, uninterrupted):
    """A checkpoint every step, at most two kept, every commit slowed down: the Trainer deletes old checkpoint
    directories (sorted by modification time) while the newest one's saves are still pending."""
    launch(tmp_path, "6", "4", "-", "1", mode="snapshot", delay="0.1")
    check_checkpoints(tmp_path, ["checkpoint-3", "checkpoint-4"], None)
    with open(tmp_path / "stats.json") as f:
        first = json.load(f)
    assert first["mtime_order"] == [True] * 4, "sorted by modification time, the checkpoints are in order"
    assert min(first["pending"]) > 0, "every rotation ran with the newest checkpoint's saves still pending"
    launch(tmp_path, "6", "-", str(tmp_path / "checkpoint-4"), "1", mode="snapshot", delay="0.1")
    final = launched_final(tmp_path)
    assert equal_states(final, uninterrupted)
    check_checkpoints(tmp_path, ["checkpoint-5", "checkpoint-6"], final)
    assert [n for _, _, files in os.walk(tmp_path) for n in files if ".fastpersist-" in n] == []


# ----------------------------------------------------------------------------- accelerate and Lightning


def test_accelerate_save_state_and_load_state_under_patch(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

        def step() -> None:
            loss = model(torch.randn(8, 128)).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

        step()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        moments = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
        before = fastpersist.patch_stats()
        with fastpersist.patch():
            accelerator.save_state(tmp_path / "state")
            step()
            step()
            accelerator.load_state(tmp_path / "state")
        handled = counts(before, fastpersist.patch_stats())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert all(torch.equal(optimizer.state_dict()["state"][0][k], v) for k, v in moments.items())
    assert scheduler.state_dict()["last_epoch"] == 1
    assert handled["save_file"] == 1 and handled["torch.save"] >= 2 and handled["torch.load"] >= 2, handled
    assert page_aligned(tmp_path / "state" / "optimizer.bin")
    assert torch.equal(
        safetensors.torch.load_file(tmp_path / "state" / "model.safetensors")["0.weight"], saved["0.weight"]
    )


def test_lightning_with_its_default_checkpoint_io_under_patch(tmp_path):
    lightning = pytest.importorskip("lightning")

    class Tiny(lightning.pytorch.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(64, 128, generator=generator), torch.randint(0, 2, (64,)))
            return torch.utils.data.DataLoader(data, batch_size=16)

    def fit(root, epochs: int, checkpoint=None) -> Tiny:
        torch.manual_seed(0)
        module = Tiny()
        trainer = lightning.pytorch.Trainer(
            accelerator="cpu",
            max_epochs=epochs,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(root),
        )
        trainer.fit(module, ckpt_path=checkpoint)
        return module

    reference = fit(tmp_path / "reference", 2)
    before = fastpersist.patch_stats()
    with fastpersist.patch():
        fit(tmp_path / "run", 1)
        (checkpoint,) = (tmp_path / "run" / "checkpoints").iterdir()
        resumed = fit(tmp_path / "run", 2, checkpoint=str(checkpoint))
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), reference.state_dict().values()))
    # TorchCheckpointIO pickles into a BytesIO (streamed by fastpersist) and loads from a file object (torch's).
    assert counts(before, fastpersist.patch_stats())["torch.save"] == 2
    assert counts(before, fastpersist.patch_stats(), "original")["torch.load"] >= 1
    assert page_aligned(checkpoint)
