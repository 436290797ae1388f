"""Replaced files kept for the next save of the same path (``reuse_replaced``, fastpersist.io.spares).

A save into a spare must give the file a fresh save gives, and must never write over a file that anyone can
still see: a reader's descriptor or mapping, another link, or a file someone else put at the path.
"""

import mmap
import os
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.io import commit, spares

ALWAYS = {"reuse_replaced": "always"}


@pytest.fixture(autouse=True)
def small_files_are_set_aside(monkeypatch):
    monkeypatch.setattr(commit, "DEFER_REMOVAL_BYTES", 1)  # a spare needs a set-aside file (64 MiB and up)
    yield
    spares.release()


def _state(value: float, numel: int = 1 << 18) -> dict:
    return {"t": torch.full((numel,), value), "step": int(value)}


def _wait_until(condition) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _hidden(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


def test_a_save_writes_into_the_file_the_last_save_of_its_path_replaced(any_dir):
    path = os.path.join(any_dir, "ckpt.pt")
    inodes = []
    for step, numel in enumerate([1 << 18, 3 << 18, 1 << 17, 1 << 18]):  # larger, then smaller: truncated
        state = _state(float(step), numel)
        fastpersist.save(state, path, **ALWAYS)
        inodes.append(os.stat(path).st_ino)
        loaded = torch.load(path)
        assert torch.equal(loaded["t"], state["t"]) and loaded["step"] == step
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None  # every record's CRC-32, and nothing after the end record
        fresh = os.path.join(any_dir, "fresh", "ckpt.pt")
        os.makedirs(os.path.dirname(fresh), exist_ok=True)
        fastpersist.save(state, fresh, reuse_replaced="never")
        assert os.path.getsize(fresh) == os.path.getsize(path)
        assert len(_hidden(any_dir)) == (1 if step else 0)  # one spare at most
    assert inodes[2] == inodes[0] and inodes[3] == inodes[1]  # each save took the file replaced before it
    assert spares.kept() == {path: os.path.join(any_dir, _hidden(any_dir)[0])}
    assert fastpersist.release_buffers() >= os.path.getsize(path)
    assert _hidden(any_dir) == [] and spares.kept() == {}


def test_plain_saves_keep_nothing_by_default_and_never_keeps_nothing(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    for options in ({}, {"reuse_replaced": "never"}, {"reuse_replaced": "auto"}):
        for step in range(3):
            fastpersist.save(_state(step), path, **options)
        _wait_until(lambda: _hidden(tmp_path) == [])  # the replaced file is freed on a helper thread
        assert spares.kept() == {}


def test_a_checkpointer_keeps_them_unless_the_setting_says_never(tmp_path, saves_checked):
    path = str(tmp_path / "ckpt.pt")
    with fastpersist.Checkpointer() as checkpointer:
        for step in range(3):
            checkpointer.save(_state(step), path)
            checkpointer.wait()
    assert list(spares.kept()) == [path]
    assert torch.load(path)["step"] == 2
    spares.release()
    with fastpersist.config.override(reuse_replaced="never"), fastpersist.Checkpointer() as checkpointer:
        for step in range(3):
            checkpointer.save(_state(step), path)
            checkpointer.wait()
    assert spares.kept() == {}
    with fastpersist.Checkpointer(reuse_replaced="never") as checkpointer:
        checkpointer.save(_state(0), path)
        checkpointer.wait()
        checkpointer.save(_state(1), path)
    assert spares.kept() == {}


@pytest.mark.parametrize("hold", ["descriptor", "mapping"])
def test_a_reader_of_a_replaced_checkpoint_keeps_it_intact(tmp_path, hold):
    path = str(tmp_path / "ckpt.pt")
    fastpersist.save(_state(1.0), path, **ALWAYS)
    with open(path, "rb") as f:
        before = f.read()
        held = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if hold == "mapping" else os.dup(f.fileno())
    try:
        fastpersist.save(_state(2.0), path, **ALWAYS)  # the first file is the spare now, still open here
        fastpersist.save(_state(3.0), path, **ALWAYS)  # so this one is written to a fresh file
        assert torch.load(path)["step"] == 3
        if hold == "mapping":
            assert held[:] == before
        else:
            assert os.pread(held, len(before) + 1, 0) == before
    finally:
        held.close() if hold == "mapping" else os.close(held)
    _wait_until(lambda: len(_hidden(tmp_path)) == 1)  # the refused spare is freed; the second file is kept


def test_a_path_someone_else_replaced_or_a_linked_spare_is_not_written_over(tmp_path):
    path, other = str(tmp_path / "ckpt.pt"), str(tmp_path / "other.pt")
    fastpersist.save(_state(1.0), path, **ALWAYS)
    fastpersist.save(_state(2.0), path, **ALWAYS)
    torch.save(_state(9.0), other)
    os.link(path, str(tmp_path / "keep.pt"))
    os.replace(other, path)  # the file this process wrote is not at the path any more
    fastpersist.save(_state(3.0), path, **ALWAYS)
    assert torch.load(str(tmp_path / "keep.pt"))["step"] == 2
    assert torch.load(path)["step"] == 3
    spare = spares.kept()[path]
    link = str(tmp_path / "linked.pt")
    os.link(spare, link)  # the spare (torch.save's file) has a second name now
    fastpersist.save(_state(4.0), path, **ALWAYS)
    assert torch.load(link)["step"] == 9 and torch.load(path)["step"] == 4


def test_an_unused_spare_is_freed_after_its_time(tmp_path, monkeypatch):
    monkeypatch.setattr(spares, "SPARE_SECONDS", 0.2)
    path = str(tmp_path / "ckpt.pt")
    fastpersist.save(_state(1.0), path, **ALWAYS)
    fastpersist.save(_state(2.0), path, **ALWAYS)
    assert len(_hidden(tmp_path)) == 1
    _wait_until(lambda: _hidden(tmp_path) == [] and spares.kept() == {})
    fastpersist.save(_state(3.0), path, **ALWAYS)
    assert torch.load(path)["step"] == 3


def test_a_save_that_fails_in_a_spare_removes_it_and_leaves_the_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    fastpersist.save(_state(1.0), path, **ALWAYS)
    fastpersist.save(_state(2.0), path, **ALWAYS)
    spare = spares.kept()[path]

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(commit, "write_plan", fail)
    with pytest.raises(OSError, match="No space left"):
        fastpersist.save(_state(3.0), path, **ALWAYS)
    assert not os.path.exists(spare) and _hidden(tmp_path) == [] and spares.kept() == {}
    assert torch.load(path)["step"] == 2


def test_a_spares_extra_xattrs_do_not_reach_the_new_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    fastpersist.save(_state(1.0), path, **ALWAYS)
    try:
        os.setxattr(path, "user.fastpersist-test", b"1")
    except OSError:
        pytest.skip("no user xattrs on this filesystem")
    fastpersist.save(_state(2.0), path, **ALWAYS)  # carries it over; the first file, which has it, is the spare
    assert "user.fastpersist-test" in os.listxattr(path)
    os.removexattr(path, "user.fastpersist-test")
    os.setxattr(path, "user.other", b"2")
    fastpersist.save(_state(3.0), path, **ALWAYS)  # written into the first file
    assert os.listxattr(path) == ["user.other"] and torch.load(path)["step"] == 3


def test_saves_from_several_threads_to_shared_and_own_paths(tmp_path, in_threads):
    def work(index: int) -> None:
        own, shared = str(tmp_path / f"own{index}.pt"), str(tmp_path / "shared.pt")
        for step in range(4):
            fastpersist.save(_state(float(index * 10 + step)), own, **ALWAYS)
            fastpersist.save(_state(float(index)), shared, **ALWAYS)
        assert torch.load(own)["step"] == index * 10 + 3

    assert in_threads(work, 4, timeout=120) == []
    assert torch.load(str(tmp_path / "shared.pt"))["step"] in range(4)
    assert len(_hidden(tmp_path)) <= 5 and set(spares.kept()) <= {str(tmp_path / n) for n in os.listdir(tmp_path)}


def test_a_forked_child_leaves_its_parents_spares_alone(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    fastpersist.save(_state(1.0), path, **ALWAYS)
    fastpersist.save(_state(2.0), path, **ALWAYS)
    spare = spares.kept()[path]
    pid = os.fork()
    if pid == 0:
        code = 0 if spares.kept() == {} and fastpersist.release_buffers() >= 0 else 1
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.path.exists(spare) and spares.kept() == {path: spare}


def test_spares_are_freed_at_exit_without_waiting_for_their_time(tmp_path):
    script = textwrap.dedent(
        f"""
        import torch, fastpersist
        from fastpersist.io import commit, spares
        commit.DEFER_REMOVAL_BYTES = 1
        spares.SPARE_SECONDS = 600.0
        for step in range(3):
            fastpersist.save({{"t": torch.zeros(1000), "step": step}}, {str(tmp_path / "ckpt.pt")!r},
                             reuse_replaced="always")
        assert len(spares.kept()) == 1
        """
    )
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert time.monotonic() - began < 60
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_a_spare_no_thread_could_free_later_is_freed_and_the_save_succeeds(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    fastpersist.save(_state(1.0), path, **ALWAYS)

    def no_thread(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(spares.workers, "detached", no_thread)
    fastpersist.save(_state(2.0), path, **ALWAYS)
    assert torch.load(path)["step"] == 2 and spares.kept() == {}
    _wait_until(lambda: _hidden(tmp_path) == [])  # freed by the commit's own removal


def test_a_save_pending_at_exit_commits_and_leaves_no_spare(tmp_path):
    script = textwrap.dedent(
        f"""
        import torch, fastpersist
        from fastpersist.io import commit, spares
        commit.DEFER_REMOVAL_BYTES = 1
        spares.SPARE_SECONDS = 600.0
        path = {str(tmp_path / "ckpt.pt")!r}
        for step in range(2):
            fastpersist.save({{"t": torch.zeros(1000), "step": step}}, path, reuse_replaced="always")
        fastpersist.async_save({{"t": torch.ones(1 << 20), "step": 2}}, path, reuse_replaced="always")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert os.listdir(tmp_path) == ["ckpt.pt"] and torch.load(str(tmp_path / "ckpt.pt"))["step"] == 2


def test_the_setting_refuses_other_values_and_leaves_the_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    fastpersist.save(_state(1.0), path)
    with pytest.raises(fastpersist.ConfigError, match="reuse_replaced must be one of"):
        fastpersist.save(_state(2.0), path, reuse_replaced="sometimes")
    assert torch.load(path)["step"] == 1 and _hidden(tmp_path) == []
