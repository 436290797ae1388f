"""``fastpersist.patch``: torch.save/torch.load and safetensors' functions routed through fastpersist (issue 45).

What a library calling those functions must see: torch's signatures, return
values and exception types; the originals for what fastpersist does not take;
the original objects back after restoring, also in modules that imported them
by name; safety from several threads, after fork, at exit and under Ctrl-C;
and, in snapshot mode, loads that wait for pending saves and commits that
follow the directory they were asked into.
"""

from __future__ import annotations

import inspect
import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import types
import warnings

import pytest
import torch

import fastpersist
from fastpersist.api import patching

pytest.importorskip("safetensors")
import safetensors
import safetensors.torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORIGINALS = {
    "torch.save": torch.save,
    "torch.load": torch.load,
    "save_file": safetensors.torch.save_file,
    "load_file": safetensors.torch.load_file,
    "safe_open": safetensors.safe_open,
}


def current() -> dict:
    return {
        "torch.save": torch.save,
        "torch.load": torch.load,
        "save_file": safetensors.torch.save_file,
        "load_file": safetensors.torch.load_file,
        "safe_open": safetensors.safe_open,
    }


def big_state(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=generator), "b": torch.arange(7)}  # w: 256 KiB, b: packed


def page_aligned(path) -> bool:
    """Whether the storages of at least 64 KiB sit at 4 KiB-aligned offsets: fastpersist's layout (torch's is 64 B)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        large = [i for i in archive.infolist() if "/data/" in i.filename and i.file_size >= 64 << 10]
    reader = torch._C.PyTorchFileReader(str(path))
    offsets = [reader.get_record_offset(i.filename.split("/", 1)[1]) for i in large]
    return bool(offsets) and all(offset % 4096 == 0 for offset in offsets)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(autouse=True)
def no_patch_left():
    yield
    with patching._lock:
        leaked = list(patching._stack)
        patching._stack.clear()
        patching._reconcile()
    fastpersist.wait_all()
    assert not leaked, "a test left a patch in place"
    assert all(current()[k] is v for k, v in ORIGINALS.items())


# ----------------------------------------------------------------------------- installing and restoring


def test_patch_installs_wrappers_with_the_originals_signatures_and_restores_the_same_objects():
    restore = fastpersist.patch()
    try:
        assert all(current()[k] is not v for k, v in ORIGINALS.items())
        assert torch.save is torch.serialization.save and torch.load is torch.serialization.load
        assert safetensors.torch.safe_open is safetensors.safe_open
        for name in ("torch.save", "torch.load", "save_file", "load_file"):
            assert inspect.signature(current()[name]) == inspect.signature(ORIGINALS[name]), name
            assert current()[name].__name__ == ORIGINALS[name].__name__
        assert restore.active
    finally:
        restore()
    assert not restore.active
    assert all(current()[k] is v for k, v in ORIGINALS.items())
    assert torch.serialization.save is ORIGINALS["torch.save"] and safetensors.torch.safe_open is ORIGINALS["safe_open"]
    restore()  # a second call does nothing


def test_patches_nest_and_the_innermost_options_apply(tmp_path):
    outer = fastpersist.patch()
    inner = fastpersist.patch(safetensors=False)
    safetensors.torch.save_file(big_state(), tmp_path / "a.safetensors")  # the inner patch leaves it to the library
    before = fastpersist.patch_stats()["original"].get("save_file", 0)
    inner()
    safetensors.torch.save_file(big_state(), tmp_path / "b.safetensors")
    assert fastpersist.patch_stats()["original"].get("save_file", 0) == before
    assert torch.save is not ORIGINALS["torch.save"], "the outer patch is still in place"
    with fastpersist.patch(mode="snapshot"):
        torch.save(big_state(1), tmp_path / "c.pt")
    assert same(torch.load(tmp_path / "c.pt"), big_state(1))
    outer()


def test_modules_that_imported_the_functions_by_name_are_patched_and_restored(tmp_path):
    before = types.ModuleType("library_before")
    before.safe_save_file = safetensors.torch.save_file  # what transformers.modeling_utils does
    before.torch_load = torch.load
    sys.modules["library_before"] = before
    try:
        with fastpersist.patch():
            assert before.safe_save_file is safetensors.torch.save_file is not ORIGINALS["save_file"]
            assert before.torch_load is torch.load is not ORIGINALS["torch.load"]
            during = types.ModuleType("library_during")
            during.save = torch.save  # imported while patched
            sys.modules["library_during"] = during
            before.safe_save_file(big_state(), tmp_path / "m.safetensors")
            assert fastpersist.patch_stats()["fastpersist"]["save_file"] >= 1
        assert before.safe_save_file is ORIGINALS["save_file"] and before.torch_load is ORIGINALS["torch.load"]
        assert during.save is ORIGINALS["torch.save"]
    finally:
        sys.modules.pop("library_before", None)
        sys.modules.pop("library_during", None)


def test_invalid_arguments_raise_and_patch_nothing():
    with pytest.raises(ValueError, match="pipelined"):
        fastpersist.patch(mode="pipelined")
    with pytest.raises(ValueError, match="multiple of 8"):
        fastpersist.patch(alignment=12)
    with pytest.raises(TypeError, match="fsynk"):
        fastpersist.patch(fsynk=False)
    with pytest.raises(fastpersist.ConfigError):
        fastpersist.patch(buffer_count=0)
    assert all(current()[k] is v for k, v in ORIGINALS.items())


# ----------------------------------------------------------------------------- torch.save / torch.load


def test_torch_save_writes_fastpersist_files_that_unpatched_torch_loads(tmp_path):
    counted = fastpersist.patch_stats()["fastpersist"].get("torch.save", 0)
    with fastpersist.patch():
        assert torch.save(big_state(), tmp_path / "a.pt") is None
        buffer = io.BytesIO()
        torch.save(big_state(), buffer)  # file objects are streamed by fastpersist
        loaded = torch.load(tmp_path / "a.pt")
        assert same(loaded, big_state())
    assert fastpersist.patch_stats()["fastpersist"]["torch.save"] == counted + 2
    assert page_aligned(tmp_path / "a.pt")
    (tmp_path / "b.pt").write_bytes(buffer.getvalue())
    assert page_aligned(tmp_path / "b.pt")
    assert same(torch.load(tmp_path / "a.pt"), big_state()) and same(torch.load(tmp_path / "b.pt"), big_state())
    torch.save(big_state(), tmp_path / "torch.pt")
    assert not page_aligned(tmp_path / "torch.pt"), "the check tells torch's files from fastpersist's"


def test_what_fastpersist_does_not_take_goes_to_torch(tmp_path):
    torch.save(big_state(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.save(big_state(), tmp_path / "plain.pt")
    with fastpersist.patch():
        before = dict(fastpersist.patch_stats()["original"])
        torch.save(big_state(2), tmp_path / "legacy2.pt", _use_new_zipfile_serialization=False)
        assert (tmp_path / "legacy2.pt").read_bytes()[:2] != b"PK"
        with torch.serialization.skip_data():
            torch.save(big_state(), tmp_path / "skipped.pt")
        assert same(torch.load(tmp_path / "legacy.pt"), big_state())
        assert same(torch.load(tmp_path / "plain.pt", mmap=True), big_state())
        with open(tmp_path / "plain.pt", "rb") as f:
            assert same(torch.load(f), big_state())
        with pytest.raises(TypeError, match="verify"):  # torch hands it to the unpickler; not a fastpersist setting
            torch.load(tmp_path / "plain.pt", weights_only=False, verify=False)
        after = fastpersist.patch_stats()["original"]
    assert after["torch.save"] - before.get("torch.save", 0) == 2
    assert after["torch.load"] - before.get("torch.load", 0) == 4


def test_exceptions_are_torchs(tmp_path):
    class Local:
        pass

    def outcomes():
        results = []
        for call in (
            lambda: torch.save({}, tmp_path / "missing" / "x.pt"),
            lambda: torch.save({}, tmp_path),
            lambda: torch.save({}, 42),
            lambda: torch.save(Local(), tmp_path / "local.pt"),
            lambda: torch.load(tmp_path / "nothing.pt"),
            lambda: torch.load(tmp_path),
        ):
            with pytest.raises(Exception) as caught:  # the type is compared below
                call()
            results.append(caught.value)
        return results

    plain = outcomes()
    with fastpersist.patch():
        patched = outcomes()
    for ours, theirs in zip(patched, plain):
        assert isinstance(ours, type(theirs)), (ours, theirs)


def test_loads_of_other_files_give_torchs_answer(tmp_path):
    safetensors.torch.save_file(big_state(), tmp_path / "m.safetensors")  # torch >= 2.12 loads these
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "garbage.pt").write_bytes(b"garbage" * 100)

    def outcomes():
        results = []
        for name in ("m.safetensors", "empty.pt", "garbage.pt"):
            try:
                results.append(torch.load(tmp_path / name))
            except Exception as error:  # noqa: BLE001 - compared below
                results.append(type(error))
        return results

    plain = outcomes()
    with fastpersist.patch():
        patched = outcomes()
    assert [r if isinstance(r, type) else sorted(r) for r in patched] == [
        r if isinstance(r, type) else sorted(r) for r in plain
    ]
    assert isinstance(patched[1], type) and issubclass(patched[1], EOFError)


# ----------------------------------------------------------------------------- safetensors


def test_save_file_keeps_the_librarys_bytes_by_default_and_aligns_on_request(tmp_path):
    tensors = {"w": torch.randn(100, 33), "i": torch.arange(10, dtype=torch.int32), "h": torch.ones(3).half()}
    ORIGINALS["save_file"](tensors, tmp_path / "library.safetensors", {"format": "pt"})
    with fastpersist.patch():
        safetensors.torch.save_file(tensors, tmp_path / "ours.safetensors", {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "library.safetensors").read_bytes()
    with fastpersist.patch(alignment=4096):
        safetensors.torch.save_file(tensors, tmp_path / "aligned.safetensors", {"format": "pt"})
        assert same(safetensors.torch.load_file(tmp_path / "aligned.safetensors"), tensors)
    header = int.from_bytes((tmp_path / "aligned.safetensors").read_bytes()[:8], "little")
    assert (8 + header) % 4096 == 0
    assert same(ORIGINALS["load_file"](tmp_path / "aligned.safetensors"), tensors)


def test_safetensors_errors_and_refusals_are_the_librarys(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
    with fastpersist.patch():
        with pytest.raises(ValueError, match="non contiguous"):
            safetensors.torch.save_file({"t": torch.ones(4, 4).t()}, tmp_path / "t.safetensors")
        with pytest.raises(safetensors.SafetensorError) as caught:
            safetensors.torch.save_file({"t": torch.ones(2)}, tmp_path / "missing" / "t.safetensors")
        assert isinstance(caught.value, FileNotFoundError), "fastpersist's own type, for `except OSError` too"
        with pytest.raises(safetensors.SafetensorError):
            safetensors.torch.load_file(tmp_path / "bad.safetensors")
        with pytest.raises(safetensors.SafetensorError):
            safetensors.safe_open(tmp_path / "bad.safetensors", framework="pt")
        with pytest.raises(FileNotFoundError):
            safetensors.torch.load_file(tmp_path / "nothing.safetensors")


def test_safe_open_gives_fastpersists_reader_or_the_librarys(tmp_path):
    tensors = {"w": torch.arange(600, dtype=torch.float32).reshape(20, 30)}
    ORIGINALS["save_file"](tensors, tmp_path / "m.safetensors", {"format": "pt"})
    with fastpersist.patch():
        with safetensors.safe_open(tmp_path / "m.safetensors", framework="pt", device="cpu") as f:
            assert isinstance(f, fastpersist.api.safetensors.safe_open) and isinstance(f, safetensors.safe_open)
            assert f.keys() == ["w"] and f.metadata() == {"format": "pt"}
            assert torch.equal(f.get_slice("w")[...], tensors["w"]) and f.get_slice("w").get_dtype() == "F32"
            assert torch.equal(f.get_slice("w")[2:5, 1:3], tensors["w"][2:5, 1:3])
        with safetensors.safe_open(tmp_path / "m.safetensors", framework="np") as f:  # not torch: the library's
            assert isinstance(f, safetensors.safe_open) and not isinstance(f, fastpersist.api.safetensors.safe_open)
            assert (f.get_tensor("w") == tensors["w"].numpy()).all()


def test_load_model_and_save_model_of_the_library_go_through_the_patch(tmp_path):
    model = torch.nn.Linear(300, 300)
    with fastpersist.patch():
        before = fastpersist.patch_stats()["fastpersist"].get("load_file", 0)
        safetensors.torch.save_model(model, tmp_path / "m.safetensors")
        other = torch.nn.Linear(300, 300)
        safetensors.torch.load_model(other, tmp_path / "m.safetensors")
        assert fastpersist.patch_stats()["fastpersist"]["load_file"] == before + 1
    assert torch.equal(other.weight, model.weight)


# ----------------------------------------------------------------------------- threads, fork, exit, Ctrl-C


def test_patch_and_restore_from_several_threads(tmp_path, in_threads):
    def work(index: int) -> None:
        for round_ in range(10):
            with fastpersist.patch(mode="snapshot" if index % 2 else "sync"):
                path = tmp_path / f"{index}-{round_}.pt"
                torch.save(big_state(index), path)
                assert same(torch.load(path), big_state(index))

    errors = in_threads(work, 4, timeout=120)
    assert errors == []
    assert all(current()[k] is v for k, v in ORIGINALS.items())
    assert all(page_aligned(tmp_path / f"{i}-9.pt") for i in range(4))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_keeps_the_patch_and_the_parent_is_unaffected(tmp_path):
    with fastpersist.patch(mode="snapshot"):
        torch.save(big_state(1), tmp_path / "parent.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                # torch's CPU ops hang in a child forked after the parent used libgomp's thread pool; children
                # run single-threaded (as DataLoader workers do), and the snapshot's copy is a torch copy.
                torch.set_num_threads(1)
                signal.alarm(60)  # a hang fails the test instead of stopping the suite
                torch.save(big_state(2), tmp_path / "child.pt")
                code = 0 if same(torch.load(tmp_path / "child.pt"), big_state(2)) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert same(torch.load(tmp_path / "parent.pt"), big_state(1))
    assert page_aligned(tmp_path / "child.pt") and page_aligned(tmp_path / "parent.pt")


def run_child(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_saves_in_atexit_handlers_and_late_threads_and_pending_ones_at_exit(tmp_path):
    result = run_child(
        """
        import atexit, sys, threading, time, torch, fastpersist
        directory = sys.argv[1]
        fastpersist.patch(mode="snapshot")
        atexit.register(lambda: torch.save({"w": torch.ones(1 << 16)}, directory + "/atexit.pt"))
        def late():
            time.sleep(0.3)  # the main thread has finished by now
            torch.save({"w": torch.full((1 << 16,), 2.0)}, directory + "/thread.pt")
        threading.Thread(target=late).start()
        torch.save({"w": torch.full((1 << 22,), 3.0)}, directory + "/pending.pt")  # 16 MiB, still pending at exit
        """,
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    for name, value in (("atexit", 1.0), ("thread", 2.0), ("pending", 3.0)):
        loaded = torch.load(tmp_path / f"{name}.pt")["w"]
        assert bool((loaded == value).all()), name
        assert page_aligned(tmp_path / f"{name}.pt"), name


INTERRUPTED = """
import os, signal, sys, threading, time, torch, fastpersist
path, mode = sys.argv[1], sys.argv[2]
fastpersist.patch(mode=mode)
big = {"w": torch.ones(64 << 20, dtype=torch.uint8)}
def shoot():
    directory = os.path.dirname(path)
    while not [n for n in os.listdir(directory) if ".fastpersist-" in n]:
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=shoot, daemon=True).start()
try:
    for _ in range(50):
        torch.save(big, path)
        if mode == "snapshot":
            time.sleep(0.05)  # the interrupt lands in the caller while a background save runs
    print("never interrupted")
except KeyboardInterrupt:
    print("interrupted")
print("left", [n for n in os.listdir(os.path.dirname(path)) if ".fastpersist-" in n and n.endswith(".tmp")])
torch.save({"after": torch.arange(3)}, path + ".next")
print("next", torch.load(path + ".next")["after"].tolist())
"""


@pytest.mark.parametrize("mode", ["sync", "snapshot"])
def test_ctrl_c_keeps_the_old_file_and_the_patch_usable(tmp_path, mode):
    path = tmp_path / "ckpt.pt"
    ORIGINALS["torch.save"](big_state(5), path)
    result = run_child(INTERRUPTED, str(path), mode)
    assert result.returncode == 0, result.stderr
    assert "interrupted" in result.stdout and "next [0, 1, 2]" in result.stdout, result.stdout
    loaded = torch.load(path)
    assert same(loaded, big_state(5)) or bool((loaded["w"] == 1).all()), "the old file or a complete new one"
    assert [n for n in os.listdir(tmp_path) if ".fastpersist-" in n] == []
    if mode == "sync":
        assert "left []" in result.stdout, result.stdout


# ----------------------------------------------------------------------------- snapshot mode


def test_snapshot_save_returns_before_the_write_and_loads_wait_for_it(tmp_path, monkeypatch, commit_gate):
    gate = commit_gate
    state = big_state(3)
    with fastpersist.patch(mode="snapshot"):
        torch.save(state, tmp_path / "a.pt")
        state["w"].add_(1)  # the library goes on training: the snapshot was taken at the call
        assert gate.reached.wait(60) and not (tmp_path / "a.pt").exists()
        loaded = []
        reader = threading.Thread(target=lambda: loaded.append(torch.load(tmp_path / "a.pt")))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive(), "the load waits for the pending save"
        gate.go.set()
        reader.join(60)
    assert same(loaded[0], big_state(3)) and page_aligned(tmp_path / "a.pt")


def test_snapshot_save_follows_a_renamed_directory_and_never_writes_the_old_path(tmp_path, monkeypatch, commit_gate):
    gate = commit_gate
    (tmp_path / "tmp-checkpoint").mkdir()
    with fastpersist.patch(mode="snapshot"):
        torch.save(big_state(4), tmp_path / "tmp-checkpoint" / "optimizer.pt")
        safetensors.torch.save_file(big_state(5), tmp_path / "tmp-checkpoint" / "model.safetensors")
        assert gate.reached.wait(60)
        os.rename(tmp_path / "tmp-checkpoint", tmp_path / "checkpoint-1")
        (tmp_path / "tmp-checkpoint").mkdir()  # a new directory under the old name
        gate.go.set()
        fastpersist.wait_all()
    assert sorted(os.listdir(tmp_path / "checkpoint-1")) == ["model.safetensors", "optimizer.pt"]
    assert os.listdir(tmp_path / "tmp-checkpoint") == []
    assert same(torch.load(tmp_path / "checkpoint-1" / "optimizer.pt"), big_state(4))
    assert same(ORIGINALS["load_file"](tmp_path / "checkpoint-1" / "model.safetensors"), big_state(5))


def test_snapshot_save_into_a_deleted_directory_fails_loudly_and_recreates_nothing(tmp_path, monkeypatch, commit_gate):
    gate = commit_gate
    (tmp_path / "checkpoint-1").mkdir()
    restore = fastpersist.patch(mode="snapshot")
    try:
        torch.save(big_state(), tmp_path / "checkpoint-1" / "optimizer.pt")
        assert gate.reached.wait(60)
        shutil.rmtree(tmp_path / "checkpoint-1")
        gate.go.set()
        (pending,) = fastpersist.pending_saves() or [None]
        if pending is not None:
            pending.exception(60)
        with pytest.raises(FileNotFoundError, match="deleted while this save was pending") as caught:
            torch.save(big_state(), tmp_path / "next.pt")  # the next patched call raises it
        assert isinstance(caught.value, RuntimeError)
        assert not (tmp_path / "next.pt").exists()
    finally:
        restore()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_save_into_another_directory_waits_for_the_pending_ones(tmp_path, monkeypatch, commit_gate):
    gate = commit_gate
    for name in ("checkpoint-1", "checkpoint-2"):
        (tmp_path / name).mkdir()
    with fastpersist.patch(mode="snapshot"):
        torch.save(big_state(1), tmp_path / "checkpoint-1" / "a.pt")
        torch.save(big_state(1), tmp_path / "checkpoint-1" / "b.pt")  # same directory: does not wait
        saver = threading.Thread(target=torch.save, args=(big_state(2), tmp_path / "checkpoint-2" / "a.pt"))
        saver.start()
        saver.join(0.5)
        assert saver.is_alive(), "a save into another directory waits for checkpoint-1's"
        gate.go.set()
        saver.join(60)
    assert sorted(os.listdir(tmp_path / "checkpoint-1")) == ["a.pt", "b.pt"]
    assert same(torch.load(tmp_path / "checkpoint-2" / "a.pt"), big_state(2))


def test_restoring_waits_for_pending_saves_and_raises_their_failure(tmp_path, monkeypatch, commit_gate):
    gate = commit_gate
    (tmp_path / "gone").mkdir()
    restore = fastpersist.patch(mode="snapshot")
    torch.save(big_state(), tmp_path / "gone" / "a.pt")
    assert gate.reached.wait(60)
    shutil.rmtree(tmp_path / "gone")
    gate.go.set()
    with pytest.raises(FileNotFoundError):
        restore()
    assert not restore.active
