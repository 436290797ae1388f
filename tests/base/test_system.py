"""fastpersist.system: the one place that reads /proc and drops the page cache."""

from __future__ import annotations

import os
import subprocess
import sys

from fastpersist import system
from fastpersist.bench import measure


def test_rss_grows_with_touched_memory_and_peak_sees_it():
    system.release_memory()
    before = measure.current_rss()
    measure.reset_peak_rss()
    block = bytearray(64 << 20)  # zero-filled: every page touched
    during = measure.current_rss()
    assert during - before >= 48 << 20
    assert measure.peak_rss() >= during - (4 << 20)
    del block


def test_available_memory_and_cpu_model_come_from_proc():
    available = system.available_memory()
    assert 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open("/proc/cpuinfo") as f:
        has_model = any(line.startswith("model name") for line in f)
    assert (system.cpu_model() is not None) == has_model


def test_capability_of_root_and_of_others():
    with open("/proc/self/status") as f:
        mask = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)
    assert system.effective_capability(14) is bool(mask & (1 << 14))
    assert system.effective_capability(63) is bool(mask & (1 << 63))


def test_process_alive_tells_running_zombie_and_gone_apart():
    assert system.process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pid = child.pid
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert not system.process_alive(pid)
    child.wait()
    assert not system.process_alive(pid)


def test_process_alive_with_a_start_time_tells_a_later_holder_of_the_pid_apart():
    started = system.process_start_time(os.getpid())
    assert started is not None and started == system.process_start_time(os.getpid())
    assert system.process_alive(os.getpid(), started)
    assert not system.process_alive(os.getpid(), started + 1)  # what a reused PID looks like
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert system.process_start_time(child.pid) is None


def test_filesystem_of_finds_the_mount(tmp_path):
    info = system.filesystem_of(str(tmp_path))
    assert info["path"] == os.path.realpath(tmp_path)
    assert info["free_bytes"] > 0
    assert info["type"]
    assert os.path.realpath(tmp_path).startswith(info["mount_point"].rstrip("/") + "/")


def test_cache_dropper_drops_the_files_pages(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(os.urandom(8 << 20))
    dropper = system.CacheDropper()
    assert dropper.mode in ("drop_caches", "fadvise")
    assert dropper.drop([str(path)]) in ("drop_caches", "fadvise")
    disabled = system.CacheDropper(enabled=False)
    assert (disabled.mode, disabled.drop([str(path)])) == ("disabled", "disabled")


def test_fio_is_found_or_the_hint_says_how_to_install(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert system.find_fio() is None
    assert "apt-get install fio" in system.FIO_INSTALL_HINT


def _balloon(root, name, features):
    device = root / name
    device.mkdir()
    (device / "features").write_text(features + "\n")


def test_free_page_reporting_is_read_from_the_balloons_negotiated_feature_bits(tmp_path):
    assert system.free_page_reporting(str(tmp_path / "missing")) is False  # no virtio balloon driver
    (tmp_path / "bind").write_text("")  # the driver directory's other entries are not devices
    (tmp_path / "module").mkdir()
    assert system.free_page_reporting(str(tmp_path)) is False
    _balloon(tmp_path, "virtio0", "0110001" + "0" * 57)  # stats, deflate on OOM: no reporting (bit 5)
    assert system.free_page_reporting(str(tmp_path)) is False
    _balloon(tmp_path, "virtio7", "0110010100" + "0" * 54)  # bit 5: VIRTIO_BALLOON_F_REPORTING
    assert system.free_page_reporting(str(tmp_path)) is True


def test_free_page_reporting_of_this_machine_is_a_bool():
    assert isinstance(system.free_page_reporting(), bool)
