"""async_save: both modes, torn-checkpoint detection, errors, bounded in flight, exit, fork, Checkpointer."""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import types
import warnings

import pytest
import torch

import fastpersist
from fastpersist.api import futures
from fastpersist.format.serializer import plan_save
from fastpersist.io import queue, staging

SMALL = {"buffer_size": "64K", "block_size": "64K"}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_error_left_unchecked(saves_checked):
    """Every test here ends with no async save failed and unchecked (tests/conftest.py)."""


class Gate:
    """Holds the background worker busy until opened, so what happens before a save runs is deterministic."""

    def __init__(self):
        self.event = threading.Event()
        self.future = futures.SaveFuture("<gate>", "pipelined")
        self.future._work = self.event.wait
        with queue._lock:
            queue._in_flight.append(self.future)
        assert queue._worker.submit(self.future)

    def open(self):
        self.event.set()
        self.future.result(timeout=60)


def state(seed=0, n=200_000):
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=generator), "b": torch.randn(7, generator=generator), "step": seed}


def same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_modes_round_trip(tmp_path):
    for mode in ("pipelined", "snapshot"):
        obj = state(1)
        future = fastpersist.async_save(obj, tmp_path / f"{mode}.pt", mode=mode)
        assert future.mode == mode
        assert future.wait(timeout=60) is None and future.done()
        assert same(obj, torch.load(tmp_path / f"{mode}.pt")) and same(obj, fastpersist.load(tmp_path / f"{mode}.pt"))


def test_pipelined_mutation_fails_the_save_and_commits_nothing(tmp_path):
    path = tmp_path / "ckpt.pt"
    old = state(1)
    fastpersist.save(old, path)
    obj = state(2)
    gate = Gate()
    future = fastpersist.async_save(obj, path, mode="pipelined", async_max_pending=2, **SMALL)
    with torch.no_grad():
        obj["w"].mul_(3)  # the optimizer step a training loop would do next
    gate.open()
    with pytest.raises(fastpersist.TensorModifiedError) as info:
        future.result(timeout=60)
    assert "float32[200000]" in str(info.value) and info.value.path == str(path)
    assert info.value.names == ("w (float32[200000] on cpu)",)  # named by its key path, as the divergence warning
    assert same(old, fastpersist.load(path)), "the previous checkpoint must stay"
    assert os.listdir(tmp_path) == ["ckpt.pt"], "no temporary file may be left"


@pytest.mark.parametrize("kind", ["parameter", "custom pickle module"])
def test_pipelined_mutation_outside_the_serializers_shortcut_is_detected(kind, tmp_path):
    """Tensors the serializer does not record itself (subclasses, ...) are recorded by the slower pickler."""
    import pickle

    model = torch.nn.Linear(300, 300)
    obj = {"weight": model.weight}  # an nn.Parameter
    module = (
        types.SimpleNamespace(Pickler=pickle.Pickler, Unpickler=pickle.Unpickler) if kind.startswith("c") else pickle
    )
    gate = Gate()
    future = fastpersist.async_save(obj, tmp_path / "m.pt", module, async_max_pending=2)
    with torch.no_grad():
        model.weight.add_(1)
    gate.open()
    with pytest.raises(fastpersist.TensorModifiedError):
        future.result(timeout=60)
    assert not (tmp_path / "m.pt").exists()


def test_the_serializer_records_the_plain_tensors_it_pickles():
    from fastpersist.format.serializer import plan_save

    a, b = torch.zeros(3), torch.ones(4)
    b.add_(1)
    recorded = []
    plan_save({"a": a, "b": b, "again": a}, "x", tensors=recorded)
    assert [(t is a or t is b, v) for t, v in recorded] == [(True, 0), (True, 1)]


def test_pipelined_mutation_through_a_view_is_detected(tmp_path):
    model = torch.nn.Linear(300, 300)
    gate = Gate()
    future = fastpersist.async_save(model.state_dict(), tmp_path / "m.pt", async_max_pending=2)
    with torch.no_grad():
        model.weight[0].zero_()  # a view of the parameter: shares its version counter
    gate.open()
    with pytest.raises(fastpersist.TensorModifiedError):
        future.result(timeout=60)
    assert not (tmp_path / "m.pt").exists()


def test_pipelined_mutation_while_reading(tmp_path):
    """A mutation that races with the reads (no gate): either detected or not torn, never a mixed file."""
    path = tmp_path / "ckpt.pt"
    for _attempt in range(3):
        obj = {"w": torch.zeros(4_000_000)}
        future = fastpersist.async_save(obj, path, **SMALL)
        obj["w"].add_(1)
        error = future.exception(timeout=60)
        if error is None:
            loaded = torch.load(path)["w"]
            assert bool((loaded == 0).all()) or bool((loaded == 1).all())
        else:
            assert isinstance(error, fastpersist.TensorModifiedError)


def test_snapshot_mutation_after_return_never_reaches_the_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    obj = state(3)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in obj.items()}
    gate = Gate()
    future = fastpersist.async_save(obj, path, mode="snapshot", async_max_pending=2, **SMALL)
    with torch.no_grad():
        obj["w"].fill_(7)
        obj["b"].zero_()
    gate.open()
    future.result(timeout=60)
    assert same(expected, fastpersist.load(path)) and same(expected, torch.load(path))


def test_snapshot_area_is_reused_and_grows_and_is_released(tmp_path):
    fastpersist.release_buffers()
    fastpersist.async_save(state(0, 100_000), tmp_path / "a.pt", mode="snapshot").result(timeout=60)
    first = staging.staged_bytes()
    assert first >= 100_000 * 4
    fastpersist.async_save(state(1, 100_000), tmp_path / "b.pt", mode="snapshot").result(timeout=60)
    assert staging.staged_bytes() == first, "the same area is reused"
    fastpersist.async_save(state(2, 3_000_000), tmp_path / "c.pt", mode="snapshot").result(timeout=60)
    grown = staging.staged_bytes()
    assert grown >= 3_000_000 * 4 and grown != first, "the area grows for a larger checkpoint"
    assert fastpersist.release_buffers() >= grown
    assert staging.staged_bytes() == 0
    fastpersist.async_save(state(4, 10), tmp_path / "d.pt", mode="snapshot").result(timeout=60)  # allocates again
    assert same(state(4, 10), fastpersist.load(tmp_path / "d.pt"))


def test_background_error_is_raised_by_result_wait_and_exception(tmp_path):
    from fastpersist.io import engine

    path = tmp_path / "ckpt.pt"
    for mode in ("pipelined", "snapshot"):
        with engine.inject_fault(nth=1, errno=28, op="write"):
            future = fastpersist.async_save(state(5), path, mode=mode, **SMALL)
            error = future.exception(timeout=60)
        assert isinstance(error, OSError) and error.errno == 28
        with pytest.raises(OSError):
            future.result()
        with pytest.raises(OSError):
            future.wait()
        assert not path.exists() and os.listdir(tmp_path) == []


def test_unchecked_error_warns_at_the_next_save(tmp_path):
    gate = Gate()
    obj = state(6)
    failed = fastpersist.async_save(obj, tmp_path / "a.pt", async_max_pending=2)
    obj["w"].add_(1)
    gate.open()
    failed._finished.wait(60)
    with pytest.warns(RuntimeWarning, match="never checked"):
        fastpersist.async_save(state(7), tmp_path / "b.pt").result(timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        fastpersist.async_save(state(7), tmp_path / "c.pt").result(timeout=60)
    assert isinstance(failed.exception(), fastpersist.TensorModifiedError)


def test_saves_in_flight_are_bounded(tmp_path):
    for bound in (1, 2, 3):
        gate = Gate()
        started = []
        for index in range(bound):
            started.append(fastpersist.async_save(state(index), tmp_path / f"{index}.pt", async_max_pending=bound + 1))
        assert len(futures.pending_saves()) == bound + 1  # the gate and ours
        finished = threading.Event()

        def one_more(started=started, finished=finished, bound=bound):
            started.append(fastpersist.async_save(state(9), tmp_path / "more.pt", async_max_pending=bound + 1))
            finished.set()

        thread = threading.Thread(target=one_more)
        thread.start()
        assert not finished.wait(0.3), "a save over the bound must wait for the oldest"
        gate.open()
        assert finished.wait(60)
        thread.join()
        fastpersist.wait_all(timeout=60)
        assert all(f.done() for f in started)


def test_same_path_saves_land_in_call_order(tmp_path):
    path = tmp_path / "ckpt.pt"
    saves = [fastpersist.async_save(state(i, 1000), path, async_max_pending=4) for i in range(4)]
    for future in saves:
        future.result(timeout=60)
    assert same(state(3, 1000), fastpersist.load(path))


def test_checkpointer_waits_before_the_optimizer_step(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = {}
    with fastpersist.Checkpointer(optimizer, model=model, **SMALL) as checkpointer:
        for step in range(6):
            loss = model(torch.randn(32, 64)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
            checkpointer.save(state, tmp_path / f"step{step}.pt")
    for step, reference in expected.items():
        loaded = fastpersist.load(tmp_path / f"step{step}.pt")
        assert loaded["step"] == step
        assert all(torch.equal(loaded["model"][k], v) for k, v in reference.items())


def test_checkpointer_raises_a_failed_save_before_the_next_step(tmp_path):
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = fastpersist.Checkpointer(optimizer, mode="snapshot")
    from fastpersist.io import engine

    with engine.inject_fault(nth=1, errno=5, op="write"):
        checkpointer.save(model.state_dict(), tmp_path / "a.pt")
        for future in futures.pending_saves():
            future._finished.wait(60)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(OSError):
        optimizer.step()
    optimizer.step()  # reported once; training goes on
    checkpointer.close()


class HeldCommit:
    """Holds every atomic save between its last written byte and its rename until opened."""

    def __init__(self, monkeypatch):
        from fastpersist.io import commit

        self.written = threading.Event()
        self.go = threading.Event()
        replace = commit.replace_file

        def held(temporary, target, directory, keep=False):
            self.written.set()
            assert self.go.wait(60), "the test never let the save commit"
            replace(temporary, target, directory, keep)

        monkeypatch.setattr(commit, "replace_file", held)


def test_checkpointer_pipelined_save_behind_a_pending_one_returns_at_once(tmp_path, monkeypatch):
    """Under a Checkpointer's hooks a pipelined save does not wait for a slot (the hooks bound the saves in
    flight): it returns while the one before is held; the next step waits until it has read the state."""
    held = HeldCommit(monkeypatch)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    checkpointer = fastpersist.Checkpointer(optimizer, mode="pipelined", **SMALL)
    first = checkpointer.save({"model": model.state_dict()}, tmp_path / "a.pt")
    assert held.written.wait(60)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    second = checkpointer.save({"model": model.state_dict()}, tmp_path / "b.pt")  # `first` is still held
    assert not first.done() and not second.done()
    held.go.set()
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # after `second` has read the state
    checkpointer.close()
    loaded = fastpersist.load(tmp_path / "b.pt")
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in expected.items()), "the step ran"


def test_checkpointer_step_waits_for_the_reads_not_the_write(tmp_path, monkeypatch):
    """The optimizer step goes on once the pending save has read the state; the write lands pre-step values."""
    held = HeldCommit(monkeypatch)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    checkpointer = fastpersist.Checkpointer(optimizer, **SMALL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    future = checkpointer.save({"model": model.state_dict()}, tmp_path / "c.pt")
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # would wait for the commit (forever) if the hook waited for the whole save
    assert held.written.wait(60) and not future.done()
    assert not torch.equal(model.weight, before["weight"])
    held.go.set()
    checkpointer.close()
    loaded = fastpersist.load(tmp_path / "c.pt")["model"]
    assert all(torch.equal(loaded[k], v) for k, v in before.items())


def test_checkpointer_state_larger_than_the_ring_is_read_completely_before_the_step(tmp_path, monkeypatch):
    held = HeldCommit(monkeypatch)
    model = torch.nn.Linear(512, 1024)  # 2 MiB of weights against a 512 KiB ring
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    checkpointer = fastpersist.Checkpointer(optimizer, **SMALL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer.save(model.state_dict(), tmp_path / "c.pt")
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    held.go.set()
    checkpointer.close()
    loaded = fastpersist.load(tmp_path / "c.pt")
    assert all(torch.equal(loaded[k], v) for k, v in before.items())


def test_checkpointer_change_before_the_release_fails_the_save(tmp_path):
    """An in-place change the hooks did not order after the reads: the save fails, nothing is committed."""
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = fastpersist.Checkpointer(optimizer, async_max_pending=2)  # the gate holds one
    gate = Gate()
    future = checkpointer.save(model.state_dict(), tmp_path / "c.pt")
    with torch.no_grad():
        model.bias.add_(1)  # not through the optimizer: no hook runs first
    gate.open()
    model(torch.randn(2, 8)).sum().backward()
    try:
        optimizer.step()  # the release decides: the bias changed before it
    except fastpersist.TensorModifiedError:
        pass  # the save reached its commit first and decided there; the step's hook reports it
    assert isinstance(future.exception(timeout=60), fastpersist.TensorModifiedError)
    assert not (tmp_path / "c.pt").exists()
    checkpointer.detach()


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_checkpointer_hook_returns_when_the_save_failed_before_reading(mode, tmp_path, monkeypatch):
    from fastpersist.io import commit, engine

    def refused(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(engine, "File", refused)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = fastpersist.Checkpointer(optimizer, mode=mode)
    checkpointer.save(model.state_dict(), tmp_path / "c.pt")
    model(torch.randn(2, 8)).sum().backward()
    for future in futures.pending_saves():
        future._finished.wait(60)
    with pytest.raises(OSError):
        optimizer.step()
    assert commit.live_temporaries() == set()
    checkpointer.close()


def test_checkpointer_detach_releases_pending_saves(tmp_path, monkeypatch):
    held = HeldCommit(monkeypatch)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = fastpersist.Checkpointer(optimizer)
    before = model.weight.clone()
    future = checkpointer.save({"w": model.weight}, tmp_path / "c.pt")
    checkpointer.detach()  # returns once the save has read the state (not written it)
    assert future._release._decided and not future.done()
    with torch.no_grad():
        model.weight.add_(1)
    held.go.set()
    future.result(timeout=60)
    assert torch.equal(fastpersist.load(tmp_path / "c.pt")["w"], before)


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_checkpointer_prepare_allocates_what_the_first_save_uses(mode, tmp_path):
    from fastpersist.io import memory

    fastpersist.release_buffers()
    model = torch.nn.Linear(256, 1024)
    checkpointer = fastpersist.Checkpointer(torch.optim.SGD(model.parameters(), lr=0.1), mode=mode, **SMALL)
    reserved = checkpointer.prepare(model.state_dict())
    held = memory.pooled_bytes() + staging.staged_bytes()
    assert reserved >= sum(t.numel() * t.element_size() for t in model.state_dict().values()) or mode == "pipelined"
    assert reserved > 0 and held >= reserved
    checkpointer.save(model.state_dict(), tmp_path / "c.pt")
    checkpointer.close()
    assert memory.pooled_bytes() + staging.staged_bytes() == held, "the first save allocated more"
    assert same(model.state_dict(), fastpersist.load(tmp_path / "c.pt"))


def test_pending_saves_complete_at_exit_and_unchecked_errors_fail_the_exit(tmp_path):
    script = textwrap.dedent(
        """
        import sys, torch, fastpersist
        directory, fail = sys.argv[1], sys.argv[2] == "1"
        obj = {"w": torch.arange(3_000_000, dtype=torch.float32)}
        fastpersist.async_save(obj, directory + "/done.pt", buffer_size="64K", block_size="64K")
        if fail:
            other = {"w": torch.zeros(1000)}
            fastpersist.async_save(other, directory + "/torn.pt", async_max_pending=2)
            other["w"].add_(1)
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    ok = subprocess.run([sys.executable, "-c", script, str(tmp_path), "0"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert torch.equal(torch.load(tmp_path / "done.pt")["w"], torch.arange(3_000_000, dtype=torch.float32))
    os.unlink(tmp_path / "done.pt")
    bad = subprocess.run([sys.executable, "-c", script, str(tmp_path), "1"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1
    assert "torn.pt" in bad.stderr and "never checked" in bad.stderr and "TensorModifiedError" in bad.stderr
    assert (tmp_path / "done.pt").exists() and not (tmp_path / "torn.pt").exists()


def _child_saves(path: str, queue) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(30, exit=True)
    try:
        fastpersist.async_save({"child": torch.ones(5)}, path).result(timeout=60)
        queue.put("ok")
    except BaseException as e:  # noqa: BLE001
        queue.put(repr(e))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_async_save_works_in_a_forked_child(tmp_path):
    fastpersist.async_save(state(1), tmp_path / "parent.pt").result(timeout=60)  # the worker exists now
    # Native handles of earlier tests still waiting in reference cycles would be destroyed in the child,
    # where their engine threads do not exist (fork safety of the engine is issue 8's): collect them here.
    gc.collect()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_saves, args=(str(tmp_path / "child.pt"), queue))
    child.start()
    assert queue.get(timeout=120) == "ok"
    child.join(60)
    assert child.exitcode == 0
    fastpersist.async_save(state(2), tmp_path / "parent.pt").result(timeout=60)  # the parent is unaffected
    assert same(state(2), fastpersist.load(tmp_path / "parent.pt"))


def test_invalid_mode_and_bound_raise_at_once(tmp_path):
    with pytest.raises(fastpersist.ConfigError):
        fastpersist.async_save({}, tmp_path / "x.pt", mode="eager")
    with pytest.raises(fastpersist.ConfigError):
        fastpersist.async_save({}, tmp_path / "x.pt", async_max_pending=0)
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_cuda_mutation_right_after_the_call(mode, tmp_path):
    path = tmp_path / "ckpt.pt"
    x = torch.zeros(16 << 20, device="cuda")
    gc.collect()  # an earlier test's garbage freed in the middle would make the count below drop
    before = torch.cuda.memory_allocated()
    future = fastpersist.async_save({"x": x}, path, mode=mode)
    assert torch.cuda.memory_allocated() == before, "no GPU copy of the state"
    x.add_(1)  # queued on the current stream right after the call
    if mode == "snapshot":
        future.result(timeout=60)
        assert bool((fastpersist.load(path)["x"] == 0).all())
    else:
        error = future.exception(timeout=60)
        assert isinstance(error, fastpersist.TensorModifiedError) and not path.exists()


@pytest.mark.gpu
def test_cuda_checkpointer_training_loop(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    checkpointer = fastpersist.Checkpointer(optimizer, model=model)
    for _step in range(5):
        model(torch.randn(64, 512, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        checkpointer.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt")
    checkpointer.close()
    loaded = fastpersist.load(tmp_path / "c.pt", map_location="cuda")
    assert all(torch.equal(loaded["model"][k], v) for k, v in reference.items())


@pytest.mark.gpu
def test_cuda_snapshot_of_small_and_large_storages(tmp_path):
    """Small GPU storages are gathered into one copy: every value lands, in place, unaffected by later writes."""
    path = tmp_path / "ckpt.pt"
    generator = torch.Generator(device="cuda").manual_seed(3)
    sizes = [1, 3, 17, 1000, 16 << 10, (64 << 10) // 4 - 1, 64 << 10, 1 << 20]
    state = {f"t{i}": torch.randn(n, device="cuda", generator=generator) for i, n in enumerate(sizes)}
    state["half"] = torch.randn(33, device="cuda", generator=generator).half()
    state["view"] = state["t6"][5:9]  # shares a storage with t6
    state["cpu"] = torch.arange(10)
    expected = {k: v.cpu().clone() for k, v in state.items()}  # .cpu() of a CPU tensor is the tensor itself
    future = fastpersist.async_save({**state, "temporary": state["t3"] * 2}, path, mode="snapshot")
    expected["temporary"] = expected["t3"] * 2
    for tensor in state.values():
        tensor.add_(1)  # queued right after the call; freed temporaries are reused by the allocator
    torch.cuda.synchronize()
    future.result(timeout=60)
    loaded = torch.load(path, map_location="cpu")
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert loaded["view"].untyped_storage().data_ptr() == loaded["t6"].untyped_storage().data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_cuda_checkpointer_step_is_ordered_after_the_reads(mode, tmp_path, monkeypatch):
    """The step is queued while the save is unwritten (held); its kernels run after the copies, whose values land."""
    held = HeldCommit(monkeypatch)
    model = torch.nn.Linear(4096, 4096).cuda()  # 64 MiB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    checkpointer = fastpersist.Checkpointer(optimizer, mode=mode)
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    future = checkpointer.save(model.state_dict(), tmp_path / "c.pt")
    optimizer.step()  # queued at once, before any copy may have run
    torch.cuda.synchronize()
    assert not future.done()
    held.go.set()
    checkpointer.close()
    loaded = fastpersist.load(tmp_path / "c.pt", map_location="cuda")
    assert all(torch.equal(loaded[k], v) for k, v in before.items())


def _snapshot_threads(monkeypatch, delay: float = 0.0) -> list[str]:
    """Records the thread of every snapshot taken (slowed by ``delay`` seconds); returns the list it fills."""
    threads: list[str] = []
    take = staging.snapshot_plan

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        time.sleep(delay)
        return take(*args, **kwargs)

    monkeypatch.setattr(staging, "snapshot_plan", recording)
    return threads


def test_snapshot_on_caller_streams_needs_caller_waits_off():
    plan = plan_save({"x": torch.ones(4)}, "a")
    with pytest.raises(ValueError, match="caller's stream"):
        staging.snapshot_plan(plan, caller_waits=True, streams={})


def test_snapshot_lease_is_given_back_when_the_copies_fail(monkeypatch):
    """A lease handed to snapshot_plan is consumed: back in the pool after a failed snapshot, not lent twice."""
    staging.release_idle_areas()
    plan = plan_save({"x": torch.ones(1 << 16)}, "a")
    leased = staging.lease(plan)
    area, capacity = leased.area, leased.area.capacity
    assert staging.staged_bytes() == capacity

    def failing_copy(self, *args, **kwargs):
        raise RuntimeError("copy failed")

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "copy_", failing_copy)
        with pytest.raises(RuntimeError, match="copy failed"):
            staging.snapshot_plan(plan, leased=leased)
    leased.release()  # a second release of a consumed lease does nothing
    again = staging.lease(plan)
    assert again.area is area, "the failed snapshot's area went back to the pool once"
    again.release()
    assert staging.release_idle_areas() == capacity


@pytest.mark.gpu
def test_cuda_checkpointer_snapshot_copies_on_the_save_thread(tmp_path, monkeypatch):
    """With the save queue idle, a Checkpointer's snapshot is taken by the save thread; a step issued at once waits
    for its copies to be queued and runs after them, so the file holds the pre-step values."""
    threads = _snapshot_threads(monkeypatch, delay=0.3)  # the step is issued long before the copies are queued
    model = torch.nn.Linear(4096, 4096).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    checkpointer = fastpersist.Checkpointer(optimizer, mode="snapshot")
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer.save(model.state_dict(), tmp_path / "c.pt")
    optimizer.step()
    checkpointer.close()
    assert threads == ["fastpersist-save"]
    loaded = fastpersist.load(tmp_path / "c.pt", map_location="cuda")
    assert all(torch.equal(loaded[k], v) for k, v in before.items())
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "the step ran"


@pytest.mark.gpu
def test_cuda_checkpointer_snapshot_behind_a_pending_save_copies_at_once(tmp_path, monkeypatch):
    """A snapshot queued behind a pending save is taken by the caller: the step must not wait for that write."""
    held = HeldCommit(monkeypatch)
    threads = _snapshot_threads(monkeypatch)
    model = torch.nn.Linear(1024, 1024).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    checkpointer = fastpersist.Checkpointer(optimizer, mode="snapshot", async_max_pending=2)
    first = checkpointer.save(model.state_dict(), tmp_path / "a.pt")
    assert held.written.wait(60)
    second_state = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer.save(model.state_dict(), tmp_path / "b.pt")
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    optimizer.step()  # returns although the first save is still held before its commit
    assert not first.done()
    held.go.set()
    checkpointer.close()
    assert threads == ["fastpersist-save", threading.current_thread().name]
    loaded = fastpersist.load(tmp_path / "b.pt", map_location="cuda")
    assert all(torch.equal(loaded[k], v) for k, v in second_state.items())


@pytest.mark.gpu
def test_cuda_checkpointer_snapshot_failures(tmp_path, monkeypatch):
    """No staging area: the caller gets the error, nothing is queued. Copies failing on the save thread: the
    future raises, the step is not held up, and the area goes back to the pool."""
    model = torch.nn.Linear(256, 256).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    checkpointer = fastpersist.Checkpointer(optimizer, mode="snapshot")
    staging.release_idle_areas()

    def no_memory(self, nbytes):
        raise MemoryError("no pinned memory")

    with monkeypatch.context() as patch:
        patch.setattr(staging._Pool, "acquire", no_memory)
        with pytest.raises(MemoryError, match="no pinned memory"):
            checkpointer.save(model.state_dict(), tmp_path / "c.pt")
    assert not fastpersist.pending_saves() and not (tmp_path / "c.pt").exists()

    def broken(*args, **kwargs):
        raise RuntimeError("copies failed")

    with monkeypatch.context() as patch:
        patch.setattr(staging, "_copy_from_device", broken)
        future = checkpointer.save(model.state_dict(), tmp_path / "c.pt")
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        checkpointer._release()  # what the step's hook does first: it must not wait forever
        assert isinstance(future.exception(timeout=60), RuntimeError)
        with pytest.raises(RuntimeError, match="copies failed"):
            optimizer.step()  # the hook raises the failed save's error before the step
    assert not (tmp_path / "c.pt").exists()
    assert staging.staged_bytes() == staging.release_idle_areas(), "no area is still lent"
    checkpointer.detach()


@pytest.mark.gpu
def test_cuda_checkpointer_snapshots_from_two_threads(tmp_path):
    """Two training threads, each with its own Checkpointer in snapshot mode, save at once: every file holds its
    thread's pre-step values, whichever thread's snapshot the save thread took."""
    errors = []

    def train(name: str) -> None:
        try:
            torch.manual_seed(len(name))
            model = torch.nn.Linear(1024, 1024).cuda()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            checkpointer = fastpersist.Checkpointer(optimizer, mode="snapshot")
            for step in range(6):
                model(torch.randn(8, 1024, device="cuda")).sum().backward()
                before = {k: v.clone() for k, v in model.state_dict().items()}
                checkpointer.save(model.state_dict(), tmp_path / f"{name}-{step}.pt")
                optimizer.step()
                optimizer.zero_grad()
                checkpointer.wait()
                loaded = fastpersist.load(tmp_path / f"{name}-{step}.pt", map_location="cuda")
                assert all(torch.equal(loaded[k], v) for k, v in before.items()), (name, step)
            checkpointer.close()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=train, args=(name,)) for name in ("a", "bb")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors


@pytest.mark.gpu
def test_cuda_checkpointer_snapshot_in_an_atexit_handler(tmp_path):
    """A Checkpointer snapshot saved by an atexit handler (no save thread any more) is taken and written there."""
    script = textwrap.dedent(
        """
        import atexit, sys, torch, fastpersist
        model = torch.nn.Linear(256, 256).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        checkpointer = fastpersist.Checkpointer(optimizer, mode="snapshot")
        def last_words():
            checkpointer.save(model.state_dict(), sys.argv[1])
            checkpointer.close()
        atexit.register(last_words)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, sys.argv[1] + ".expected")
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    path = tmp_path / "c.pt"
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    expected = torch.load(str(path) + ".expected")
    loaded = fastpersist.load(path, map_location="cpu")
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_a_failed_save_lets_go_of_the_state_without_waiting_for_the_garbage_collector(tmp_path, mode):
    # The future outlives the save, and its error's traceback held the frames that held the plan: the
    # state's memory (a model's GPU tensors) stayed taken after the failure until some later collection.
    import weakref

    import numpy

    from fastpersist.io import engine

    memory = numpy.ones(300_000, dtype=numpy.float32)  # the storage below keeps it alive, and only that
    freed = weakref.ref(memory)
    obj = {"w": torch.from_numpy(memory), "step": 3}
    del memory
    gc.collect()
    gc.disable()
    try:
        with engine.inject_fault(nth=1, errno=5, op="write"):
            future = fastpersist.async_save(obj, tmp_path / "x.pt", mode=mode)
            error = future.exception(timeout=60)
        assert isinstance(error, OSError) and error.errno == 5
        assert "fastpersist" in "".join(traceback.format_exception(error))  # still says where it failed
        del obj
        assert freed() is None, "the failed save still holds the state"
        assert future.exception() is error  # the future itself stays usable
    finally:
        gc.enable()
