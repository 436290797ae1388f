"""Lightning: the CheckpointIO plugins, the FastPersistCheckpoint callback, Fabric, DDP (gloo, 2 ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import fastpersist

lightning = pytest.importorskip("lightning")
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from fastpersist.integrations.lightning import (
    AsyncFastPersistCheckpointIO,
    FastPersistCheckpoint,
    FastPersistCheckpointIO,
    install_sharded_save,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TinyModel(LightningModule):
    def __init__(self, width: int = 32):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 2))

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, self.hparams.width, generator=generator)
        y = torch.randint(0, 2, (64,), generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def trainer(tmp_path, **kwargs):
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    options.update(kwargs)
    return Trainer(**options)


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_resume(tmp_path, make_trainer, checkpoint):
    """Fit 2 epochs, then resume from ``checkpoint`` to 3 epochs: the loop state and weights carry over."""
    resumed_model = TinyModel()
    second = make_trainer(max_epochs=3)
    second.fit(resumed_model, ckpt_path=checkpoint)
    assert second.current_epoch == 3 and second.global_step == 12
    return second


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_plugin_fit_and_resume(tmp_path):
    def make(**kw):
        return trainer(
            tmp_path,
            plugins=[FastPersistCheckpointIO()],
            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
            **kw,
        )

    first = make()
    model = TinyModel()
    first.fit(model)
    assert isinstance(first.strategy.checkpoint_io, FastPersistCheckpointIO)
    last = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=False)  # an ordinary torch checkpoint
    assert saved["global_step"] == 8 and same_state(saved["state_dict"], model.state_dict())
    assert fastpersist.verify(str(last)).checksummed
    check_resume(tmp_path, make, str(last))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("async_mode", [None, "snapshot", "pipelined"])
def test_callback_top_k_save_last_and_resume(tmp_path, async_mode):
    directory = tmp_path / "ckpt"

    def make(**kw):
        callback = FastPersistCheckpoint(
            dirpath=directory,
            monitor="train_loss",
            save_top_k=2,
            save_last=True,
            every_n_train_steps=1,
            async_mode=async_mode,
        )
        return trainer(tmp_path, callbacks=[callback], **kw), callback

    first, callback = make()
    model = TinyModel()
    first.fit(model)
    io = first.strategy.checkpoint_io
    assert isinstance(io, AsyncFastPersistCheckpointIO if async_mode else FastPersistCheckpointIO)
    if async_mode:
        assert io.mode == async_mode
    files = sorted(os.listdir(directory))
    assert "last.ckpt" in files and len(files) == 3, files  # top 2 + last, the others removed in order
    assert not [f for f in files if "fastpersist" in f], "no temporary left"
    for name in files:
        state = fastpersist.load(directory / name, weights_only=False)
        assert set(state) >= {"state_dict", "optimizer_states", "loops", "callbacks", "global_step"}
    last = torch.load(directory / "last.ckpt", weights_only=False)
    assert last["global_step"] == 8 and same_state(last["state_dict"], model.state_dict())
    best = callback.best_model_path
    assert os.path.exists(best) and os.path.dirname(best) == str(directory)
    second = check_resume(tmp_path, lambda **kw: make(**kw)[0], str(directory / "last.ckpt"))
    assert isinstance(second.strategy.checkpoint_io, FastPersistCheckpointIO)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("plugin", [FastPersistCheckpointIO, AsyncFastPersistCheckpointIO])
def test_trainer_save_checkpoint(tmp_path, plugin):
    t = trainer(tmp_path, plugins=[plugin()], max_epochs=1, enable_checkpointing=False)
    model = TinyModel()
    t.fit(model)
    path = tmp_path / "manual" / "model.ckpt"  # a directory that does not exist yet
    t.save_checkpoint(path)
    t.strategy.checkpoint_io.teardown()
    loaded = torch.load(path, weights_only=False)
    assert same_state(loaded["state_dict"], model.state_dict())
    weights = tmp_path / "weights.ckpt"
    t.save_checkpoint(weights, weights_only=True)
    t.strategy.checkpoint_io.teardown()
    assert "optimizer_states" not in torch.load(weights, weights_only=False)
    restored = TinyModel.load_from_checkpoint(path)
    assert same_state(restored.state_dict(), model.state_dict())


def test_async_plugin_orders_removal_after_pending_writes(tmp_path):
    io = AsyncFastPersistCheckpointIO()
    path = tmp_path / "a.ckpt"
    state = {"w": torch.randn(1_000_000)}
    for _ in range(3):
        io.save_checkpoint(state, path)
        io.remove_checkpoint(path)  # queued behind the pending write of the same path
    io.save_checkpoint(state, tmp_path / "b.ckpt")
    io.teardown()
    assert not path.exists() and (tmp_path / "b.ckpt").exists()
    assert os.listdir(tmp_path) == ["b.ckpt"]


def test_async_plugin_surfaces_errors_at_next_save_and_teardown(tmp_path):
    from fastpersist.io import engine

    io = AsyncFastPersistCheckpointIO()
    with engine.inject_fault(nth=1, errno=28, op="write"):
        io.save_checkpoint({"w": torch.randn(1000)}, tmp_path / "a.ckpt")
        for future in fastpersist.pending_saves():
            future._finished.wait(60)
    with pytest.raises(OSError):
        io.save_checkpoint({"w": torch.randn(1000)}, tmp_path / "b.ckpt")
    io.teardown()
    with engine.inject_fault(nth=1, errno=28, op="write"):
        io.save_checkpoint({"w": torch.randn(1000)}, tmp_path / "c.ckpt")
        with pytest.raises(OSError):
            io.teardown()
    assert not (tmp_path / "a.ckpt").exists() and not (tmp_path / "c.ckpt").exists()


def test_async_plugin_uses_no_device_copy(tmp_path):
    """Lightning's AsyncCheckpointIO clones every tensor; ours reads the tensors in place (pipelined) or
    copies them to host staging (snapshot): the plan's storages are the caller's own."""
    state = {"w": torch.randn(1000)}
    io = AsyncFastPersistCheckpointIO(mode="pipelined")
    pointer = state["w"].data_ptr()
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    io.teardown()
    assert state["w"].data_ptr() == pointer and torch.equal(torch.load(tmp_path / "a.ckpt")["w"], state["w"])


def test_plugin_rejects_unknown_storage_options_and_takes_settings(tmp_path):
    io = FastPersistCheckpointIO()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"a": torch.ones(2)}, tmp_path / "x.ckpt", storage_options="s3")
    io.save_checkpoint({"a": torch.ones(2)}, tmp_path / "x.ckpt", storage_options={"fsync": False})
    assert torch.equal(io.load_checkpoint(tmp_path / "x.ckpt")["a"], torch.ones(2))
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.remove_checkpoint(tmp_path / "x.ckpt")
    io.remove_checkpoint(tmp_path / "x.ckpt")  # already gone: no error
    assert not (tmp_path / "x.ckpt").exists()


def test_fabric_save_and_load(tmp_path):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FastPersistCheckpointIO()])
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    other = torch.nn.Linear(8, 4)
    state = {"model": other, "step": 0}
    remainder = fabric.load(tmp_path / "f.ckpt", state)
    assert state["step"] == 3 and "optimizer" in remainder
    assert torch.equal(other.weight, model.weight)


def test_strategies_that_bypass_checkpoint_io_are_refused_clearly():
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    for cls in (FSDPStrategy, DeepSpeedStrategy):
        strategy = cls.__new__(cls)  # no process group or deepspeed needed to check the refusal
        with pytest.raises(TypeError, match="does not go through CheckpointIO"):
            install_sharded_save(strategy)


def test_importing_fastpersist_does_not_import_lightning():
    code = "import sys, fastpersist, fastpersist.integrations; assert 'lightning' not in sys.modules"
    code += " and 'pytorch_lightning' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": REPO}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_pytorch_lightning_flavour(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from fastpersist.integrations.lightning import for_package

    classes = for_package("pytorch_lightning")
    t = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[classes.FastPersistCheckpoint(dirpath=tmp_path / "c", save_last=True)],
    )

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(Model())
    assert isinstance(t.strategy.checkpoint_io, classes.FastPersistCheckpointIO)
    assert torch.load(tmp_path / "c" / "last.ckpt", weights_only=False)["global_step"] == 2


@pytest.mark.parametrize(
    "variant",
    [
        ["--io", "callback"],
        ["--io", "callback", "--async-mode", "pipelined"],
        ["--io", "callback", "--async-mode", "snapshot"],
        ["--io", "strategy"],
        ["--io", "plugin"],
    ],
    ids=lambda v: "-".join(v[1::2]),
)
def test_ddp_gloo_two_ranks(tmp_path, variant):
    """Trainer(strategy='ddp', devices=2) on CPU (gloo): fit with a Timer and an unsynchronized monitored metric,
    top-k + last, resume; last.ckpt is rank 0's checkpoint dict, the resumed weights equal an uninterrupted run.
    The per-rank state (the Timer's, the metric's best score) is no divergence: fastpersist warns of nothing.
    Asynchronous modes are collective saves: both ranks wrote their shares in the background."""
    env = {**os.environ, "PYTHONPATH": REPO}
    script = os.path.join(REPO, "examples", "lightning_callback.py")
    run = subprocess.run(
        [
            sys.executable,
            script,
            "--dir",
            str(tmp_path),
            "--devices",
            "2",
            "--epochs",
            "2",
            "--accelerator",
            "cpu",
            "--check",
            *variant,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "resumed at epoch 2" in run.stdout and "ranks=2" in run.stdout
    assert "ReplicaDivergenceWarning" not in run.stderr and "fastpersist" not in run.stderr, run.stderr[-3000:]
    if "--async-mode" in variant:
        assert "rank 0: collective saves in the background" in run.stdout
        assert "rank 1: collective saves in the background" in run.stdout
    assert "last.ckpt holds rank 0's checkpoint" in run.stdout and "weights equal an uninterrupted run" in run.stdout


class _FakeStrategy:
    """Enough of a Lightning strategy for the hook: a CheckpointIO slot and a rank-0-only save."""

    is_global_zero = False  # a non-zero rank: Lightning's own save_checkpoint would skip CheckpointIO

    def __init__(self):
        self._checkpoint_io = None
        self.checkpoint_io = None
        self.rank_zero_saves = 0

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        self.rank_zero_saves += 1


def test_sharded_hook_calls_save_with_the_group_on_every_rank(tmp_path, monkeypatch):
    import torch.distributed as dist

    from fastpersist.integrations import lightning as integration

    calls = []
    real_save = fastpersist.save

    def save_with_group(obj, f, *args, group=None, **kwargs):  # the signature of issue 9's sharded save
        calls.append(group)
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(fastpersist, "save", save_with_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert integration.save_supports_group()
    strategy = install_sharded_save(_FakeStrategy())
    assert isinstance(strategy.checkpoint_io, FastPersistCheckpointIO)
    strategy.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    assert len(calls) == 1 and strategy.rank_zero_saves == 0, "this rank wrote its slice through fastpersist"
    assert torch.equal(torch.load(tmp_path / "a.ckpt")["w"], torch.ones(3))


def test_sharded_hook_falls_back_to_rank_zero_without_group_support(tmp_path, monkeypatch):
    import torch.distributed as dist

    def save_without_group(obj, f, **kwargs):
        raise AssertionError("must not be called on this rank")

    monkeypatch.setattr(fastpersist, "save", save_without_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    strategy = install_sharded_save(_FakeStrategy())
    with pytest.warns(RuntimeWarning, match="no sharded save"):
        strategy.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    strategy.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")  # warned once
    assert strategy.rank_zero_saves == 2
