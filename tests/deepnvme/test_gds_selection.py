"""GdsHandle's path choice and the cuFile binding, on any machine: fakes of the real interfaces, no CUDA needed.

The cuFile binding is driven through ``fake_cufile.c``, a library with
cufile.h's ABI whose reads and writes are pread/pwrite into host memory, so the
ctypes layer (struct layouts, status codes, errno, short transfers, offsets)
is tested for real here; the GPU tests in test_gds_handle.py run the same code
against NVIDIA's libcufile.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

import fastpersist
from fastpersist import config
from fastpersist.cli import info as info_cli
from fastpersist.deepnvme import GDSBuilder, GdsHandle, cufile, gds
from fastpersist.errors import (
    ConfigError,
    CudaUnavailableError,
    CufileError,
    EngineUnavailableError,
    GdsUnavailableError,
)

HERE = os.path.dirname(os.path.abspath(__file__))


def _compile(tmp_dir: str, name: str, *defines: str) -> str:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler for the fake libcufile")
    out = os.path.join(tmp_dir, name)
    command = [compiler, "-shared", "-fPIC", "-O1", "-o", out, os.path.join(HERE, "fake_cufile.c"), *defines]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"cannot build the fake libcufile: {result.stderr}")
    return out


@pytest.fixture(scope="module")
def fake_library(tmp_path_factory) -> str:
    """A working fake libcufile (its driver opens)."""
    return _compile(str(tmp_path_factory.mktemp("fakecufile")), "libcufile_fake_ok.so")


@pytest.fixture(scope="module")
def refusing_library(tmp_path_factory) -> str:
    """A fake libcufile whose cuFileDriverOpen fails with CU_FILE_DRIVER_NOT_INITIALIZED."""
    return _compile(str(tmp_path_factory.mktemp("fakecufile")), "libcufile_fake_refuses.so", "-DOPEN_STATUS=5001")


class _FakeDriver:
    path = "/fake/libcufile.so.0"
    version = 1170
    compat_mode = True


def _fails(reason: str):
    def open_cufile():
        raise cufile.CufileUnavailable(reason)

    return open_cufile


# ----------------------------------------------------------------------------- loading stays lazy


def test_importing_fastpersist_loads_no_cufile():
    baseline = "import torch; torch.cuda.is_available(); print('libcufile' in open('/proc/self/maps').read())\n"
    result = subprocess.run([sys.executable, "-c", baseline], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() == "True":  # CUDA builds of torch may link libcufile themselves (torch.cuda.gds)
        pytest.skip("torch itself maps libcufile here: whether fastpersist loads it cannot be seen")
    code = (
        "import fastpersist, fastpersist.deepnvme as d\n"
        "d.GDSBuilder().load(); d.GDSBuilder().is_compatible()\n"
        "from fastpersist.cli import info; info.gds_info(False)\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('libcufile' in maps)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# ----------------------------------------------------------------------------- path choice


def test_choose_path_bounce_never_touches_cufile():
    def must_not_be_called():
        raise AssertionError("cuFile was opened for the bounce path")

    path, driver, reason = gds.choose_path("bounce", must_not_be_called)
    assert (path, driver) == ("bounce", None) and "gds_path=bounce" in reason


def test_choose_path_auto_falls_back_to_bounce_and_says_why():
    path, driver, reason = gds.choose_path("auto", _fails("libcufile could not be loaded (libcufile.so.0: nope)"))
    assert (path, driver) == ("bounce", None)
    assert "libcufile could not be loaded" in reason and "bounce path" in reason


def test_choose_path_auto_takes_cufile_when_it_opens():
    path, driver, reason = gds.choose_path("auto", lambda: _FakeDriver())
    assert path == "cufile" and isinstance(driver, _FakeDriver)
    assert "/fake/libcufile.so.0" in reason and "compatibility mode" in reason


def test_choose_path_cufile_named_explicitly_raises_when_it_cannot_start():
    with pytest.raises(GdsUnavailableError) as e:
        gds.choose_path("cufile", _fails("cuFileDriverOpen failed: CU_FILE_DRIVER_NOT_INITIALIZED"))
    assert isinstance(e.value, EngineUnavailableError)  # STYLE 6: naming one that cannot start raises
    assert "CU_FILE_DRIVER_NOT_INITIALIZED" in str(e.value) and "path='auto'" in str(e.value)


def test_choose_path_rejects_unknown_names():
    with pytest.raises(ConfigError, match="auto"):
        gds.choose_path("direct", lambda: _FakeDriver())


# ----------------------------------------------------------------------------- the gds_path setting


def test_gds_path_setting_default_override_and_validation():
    assert config.get("gds_path") == "auto" and config.get("cufile_library") == ""
    assert config.environment_variable("gds_path") == "FASTPERSIST_GDS_PATH"
    with config.override(gds_path="bounce"):
        assert config.get("gds_path") == "bounce"
    assert config.get("gds_path") == "auto"
    with pytest.raises(ConfigError, match="gds_path must be one of"):
        with config.override(gds_path="gds"):
            pass


def test_gds_path_environment_variable():
    code = "import fastpersist; print(fastpersist.config.get('gds_path'), fastpersist.config.get('cufile_library'))"
    env = dict(os.environ, FASTPERSIST_GDS_PATH="bounce", FASTPERSIST_CUFILE_LIBRARY="/opt/libcufile.so.0")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["bounce", "/opt/libcufile.so.0"]


# ----------------------------------------------------------------------------- no CUDA, CPU tensors


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_gds_handle_without_cuda_says_a_cuda_device_is_required():
    for make in (lambda: GdsHandle(), lambda: GDSBuilder().load().gds_handle(1 << 20, 2, True, True, 2)):
        with pytest.raises(CudaUnavailableError) as e:
            make()
        assert isinstance(e.value, RuntimeError)
        assert "needs a CUDA device" in str(e.value) and "AioHandle" in str(e.value)
    assert fastpersist.GdsHandle is GdsHandle and fastpersist.CudaUnavailableError is CudaUnavailableError


def test_gds_only_calls_reject_cpu_tensors():
    with pytest.raises(TypeError, match=r"pin_device_tensor\(\) needs a CUDA tensor.*got a tensor on cpu"):
        gds.require_cuda_tensor(torch.zeros(8), "pin_device_tensor")
    with pytest.raises(TypeError, match="new_cpu_locked_tensor"):
        gds.require_cuda_tensor(torch.zeros(8), "unpin_device_tensor")
    with pytest.raises(TypeError, match="got list"):
        gds.require_cuda_tensor([1, 2], "pin_device_tensor")


def test_gds_builder_looks_like_deepspeeds():
    builder = GDSBuilder()
    assert builder.NAME == "gds" and builder.BUILD_VAR == "DS_BUILD_GDS" and builder.name == "gds"
    assert builder.absolute_name() == "fastpersist.deepnvme.gds_op"
    assert builder.is_compatible() == torch.cuda.is_available()
    assert builder.load().gds_handle is GdsHandle and builder.jit_load().gds_handle is GdsHandle


# ----------------------------------------------------------------------------- the ctypes binding (fake library)


def test_open_driver_without_a_library_says_where_it_looked(tmp_path):
    missing = str(tmp_path / "libcufile.so.0")
    with pytest.raises(cufile.CufileUnavailable) as e:
        cufile.open_driver(missing)
    assert missing in str(e.value) and "FASTPERSIST_CUFILE_LIBRARY" in str(e.value)
    assert cufile.library_candidates(missing) == [missing]
    assert cufile.find_library_file(missing) is None


def test_open_driver_reports_a_refusing_driver(refusing_library):
    with pytest.raises(cufile.CufileUnavailable, match="cuFileDriverOpen failed: CU_FILE_DRIVER_NOT_INITIALIZED"):
        cufile.open_driver(refusing_library)
    with pytest.raises(cufile.CufileUnavailable):  # the outcome is cached, raised again
        cufile.open_driver(refusing_library)


def test_open_driver_opens_once_per_library(fake_library):
    driver = cufile.open_driver(fake_library)
    assert cufile.open_driver(fake_library) is driver
    assert driver.version == 1234 and driver.path == fake_library
    assert driver.compat_mode == (not cufile.nvidia_fs_loaded())
    assert ctypes.CDLL(fake_library).fake_driver_opened() == 1


def test_binding_round_trip_with_offsets_and_short_transfers(fake_library, tmp_path):
    driver = cufile.open_driver(fake_library)
    fake = ctypes.CDLL(fake_library)
    path = str(tmp_path / "data.bin")
    payload = os.urandom(3 * 4096 + 17)
    source = ctypes.create_string_buffer(payload, len(payload))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        handle = driver.register_handle(fd, path)
        assert fake.fake_open_handles() == 1
        fake.fake_set_max_chunk(1000)  # every call moves at most 1000 bytes: the binding must continue
        try:
            assert driver.write(handle, ctypes.addressof(source), len(payload) - 5, 100, 5, path) == len(payload) - 5
            target = ctypes.create_string_buffer(len(payload) + 64)
            assert driver.read(handle, ctypes.addressof(target), len(payload) - 5, 100, 64, path) == len(payload) - 5
        finally:
            fake.fake_set_max_chunk(0)
        assert target.raw[64 : 64 + len(payload) - 5] == payload[5:]
        with open(path, "rb") as f:
            assert f.read()[100:] == payload[5:]
        # At end of file a read returns what there was.
        size = os.path.getsize(path)
        assert driver.read(handle, ctypes.addressof(target), 4096, size - 10, 0, path) == 10
        driver.deregister_handle(handle)
        assert fake.fake_open_handles() == 0
    finally:
        os.close(fd)


def test_binding_errors_are_cufile_errors_or_oserrors(fake_library, tmp_path):
    driver = cufile.open_driver(fake_library)
    fake = ctypes.CDLL(fake_library)
    path = str(tmp_path / "data.bin")
    buffer = ctypes.create_string_buffer(4096)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    handle = driver.register_handle(fd, path)
    try:
        fake.fake_set_io_status(5008, 0)  # -CU_FILE_IO_NOT_SUPPORTED
        with pytest.raises(CufileError) as e:
            driver.write(handle, ctypes.addressof(buffer), 4096, 0, 0, path)
        assert e.value.code == 5008 and e.value.call == "cuFileWrite" and e.value.filename == path
        assert e.value.errno == errno.EIO and "CU_FILE_IO_NOT_SUPPORTED" in str(e.value)
        fake.fake_set_io_status(errno.ENOSPC, 1)  # -1 with errno: an operating-system error
        with pytest.raises(OSError) as e:
            driver.write(handle, ctypes.addressof(buffer), 4096, 0, 0, path)
        assert not isinstance(e.value, CufileError)
        assert e.value.errno == errno.ENOSPC and e.value.filename == path and "cuFileWrite" in str(e.value)
    finally:
        fake.fake_set_io_status(0, 0)
        driver.deregister_handle(handle)
        os.close(fd)
    with pytest.raises(CufileError, match="CU_FILE_INVALID_VALUE"):
        driver.register_handle(-1, "<fd -1>")


def test_binding_buffer_registration(fake_library):
    driver = cufile.open_driver(fake_library)
    fake = ctypes.CDLL(fake_library)
    fake.fake_registered_length.restype = ctypes.c_long
    memory = ctypes.create_string_buffer(8192)
    address = ctypes.addressof(memory)
    driver.register_buffer(address, 8192)
    driver.register_buffer(address, 8192)  # already registered: not an error
    assert fake.fake_registered_length(ctypes.c_void_p(address)) == 8192
    driver.deregister_buffer(address)
    with pytest.raises(CufileError, match="CU_FILE_MEMORY_NOT_REGISTERED") as e:
        driver.deregister_buffer(address)
    assert e.value.code == 5024 and e.value.call == "cuFileBufDeregister"


def test_cufile_calls_release_the_gil(fake_library, tmp_path):
    driver = cufile.open_driver(fake_library)
    fake = ctypes.CDLL(fake_library)
    path = str(tmp_path / "slow.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(4096))
    buffer = ctypes.create_string_buffer(4096)
    fd = os.open(path, os.O_RDONLY)
    handle = driver.register_handle(fd, path)
    done = threading.Event()

    def slow_read() -> None:
        try:
            driver.read(handle, ctypes.addressof(buffer), 4096, 0, 0, path)  # sleeps 0.5 s inside the library
        finally:
            done.set()

    fake.fake_set_delay_us(500_000)
    try:
        thread = threading.Thread(target=slow_read)
        thread.start()
        spins = 0
        while not done.is_set():  # Python keeps running while the read waits in C
            spins += 1
        thread.join()
    finally:
        fake.fake_set_delay_us(0)
        driver.deregister_handle(handle)
        os.close(fd)
    assert spins > 10_000, f"only {spins} loop iterations while a cuFile call was waiting: the GIL was held"


def test_status_names_follow_cufile_h():
    assert cufile.status_name(5001).startswith("CU_FILE_DRIVER_NOT_INITIALIZED")
    assert cufile.status_name(-5020).startswith("CU_FILE_DIO_NOT_SET")
    assert cufile.status_name(5999) == "cuFile status 5999"


# ----------------------------------------------------------------------------- fastpersist info


def test_info_without_cuda_opens_nothing_and_says_why():
    g = info_cli.gds_info(False, open_cufile=_fails("must not be called"))
    assert g["path"] is None and "no CUDA device" in g["reason"] and g["gds_path_setting"] == "auto"
    assert g["nvidia_fs_loaded"] == cufile.nvidia_fs_loaded()


def test_info_with_cuda_reports_the_path_and_the_reason():
    g = info_cli.gds_info(True, open_cufile=lambda: _FakeDriver())
    assert g["path"] == "cufile" and g["compat_mode"] is True and g["cufile_version"] == 1170
    assert g["library_file"] == "/fake/libcufile.so.0"
    g = info_cli.gds_info(True, open_cufile=_fails("libcufile could not be loaded"))
    assert g["path"] == "bounce" and "libcufile could not be loaded" in g["reason"]
    with config.override(gds_path="cufile"):
        g = info_cli.gds_info(True, open_cufile=_fails("libcufile could not be loaded"))
    assert g["path"] is None and "cannot start" in g["reason"]
    with config.override(gds_path="bounce"):
        assert info_cli.gds_info(True, open_cufile=_fails("unused"))["path"] == "bounce"


class _RegisteringDriver(_FakeDriver):
    def __init__(self, refuse: str | None = None):
        self.refuse, self.registered, self.deregistered, self.names = refuse, [], [], []

    def register_handle(self, fd: int, filename: str | None = None) -> int:
        self.names.append(filename)
        if self.refuse:
            raise OSError(5, self.refuse)
        self.registered.append(fd)
        return 77

    def deregister_handle(self, handle: int) -> None:
        self.deregistered.append(handle)


def test_registration_probe_says_whether_cufile_takes_files_of_a_directory(tmp_path):
    from fastpersist.deepnvme import gds

    taking = _RegisteringDriver()
    assert gds.probe_registration(taking, str(tmp_path)) is None
    assert taking.deregistered == [77] and os.listdir(tmp_path) == []  # handle released, probe file removed
    refusing = _RegisteringDriver(refuse="cuFileHandleRegister failed: CU_FILE_HANDLE_NOT_REGISTERED")
    assert "CU_FILE_HANDLE_NOT_REGISTERED" in gds.probe_registration(refusing, str(tmp_path))
    assert os.listdir(tmp_path) == [] and refusing.names[0].startswith(str(tmp_path))
    g = info_cli.gds_info(True, open_cufile=lambda: refusing, directory=str(tmp_path))
    assert g["path"] == "cufile" and "CU_FILE_HANDLE_NOT_REGISTERED" in g["registers_files"]
    assert info_cli.gds_info(True, open_cufile=lambda: taking, directory=str(tmp_path))["registers_files"] is True
    assert "registers_files" not in info_cli.gds_info(True, open_cufile=lambda: taking)


def test_info_opens_the_library_of_the_cufile_library_setting(fake_library):
    with config.override(cufile_library=fake_library):
        g = info_cli.gds_info(True)
    assert g["path"] == "cufile" and g["library_file"] == fake_library and g["cufile_version"] == 1234
    assert g["cufile_library_setting"] == fake_library


def test_info_command_prints_the_gds_section(capsys):
    from fastpersist import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "GPUDirect Storage (GdsHandle)" in out and "gds_path setting  auto" in out
    assert "nvidia-fs" in out and "libcufile" in out
    if not torch.cuda.is_available():
        assert "path              unavailable: no CUDA device" in out
    assert cli.main(["info", "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert set(doc["gds"]) >= {"gds_path_setting", "library_file", "nvidia_fs_loaded", "path", "reason"}
