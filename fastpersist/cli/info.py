"""``fastpersist info``: what fastpersist would use on this machine.

Versions, I/O engines (compiled, usable, and why not), direct-I/O support of a
directory, the memory-lock limit, CUDA devices and the data path a
``GdsHandle`` would take (cuFile or the bounce ring, and why); ``--json``
prints the same as one JSON document. cuFile is loaded (and its driver opened)
only where torch sees a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from typing import Any

__all__ = ["HELP", "add_arguments", "run", "collect_info", "gds_info"]

HELP = "versions, I/O engines, O_DIRECT support, memory lock limit, CUDA, GDS path"


def _fastpersist_version() -> str:
    try:
        from fastpersist._version import __version__

        return __version__
    except ImportError:
        try:
            from importlib.metadata import version

            return version("fastpersist")
        except Exception:  # noqa: BLE001 - any failure means "unknown"
            return "unknown"


def _cuda_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"available": False, "torch_cuda_version": torch.version.cuda, "devices": []}
    try:
        if torch.cuda.is_available():
            info["available"] = True
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                info["devices"].append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory)})
    except Exception as e:  # noqa: BLE001 - a broken driver must not break `info`
        info["error"] = str(e)
    return info


def gds_info(
    cuda_available: bool, open_cufile: Callable[[], Any] | None = None, directory: str | None = None
) -> dict[str, Any]:
    """What a ``GdsHandle`` made now would use: the ``gds_path`` setting, libcufile, nvidia-fs, the path and why.

    Args:
        cuda_available: whether torch sees a CUDA device; without one cuFile is
            neither loaded nor opened (its driver open can hang there).
        open_cufile: opens the cuFile driver (default: ``cufile.open_driver`` of
            the ``cufile_library`` setting); tests pass fakes.
        directory: where the cufile path is tried on a real file
            (``registers_files``: ``True``, or why not); not tried if ``None``.
    """
    from fastpersist import config
    from fastpersist.deepnvme import cufile, gds
    from fastpersist.errors import GdsUnavailableError

    settings = config.settings()
    info: dict[str, Any] = {
        "gds_path_setting": settings.gds_path,
        "cufile_library_setting": settings.cufile_library or None,
        "library_file": cufile.find_library_file(settings.cufile_library),
        "nvidia_fs_loaded": cufile.nvidia_fs_loaded(),
        "path": None,
        "reason": "",
        "cufile_version": None,
        "compat_mode": None,
    }
    if not cuda_available:
        info["reason"] = "no CUDA device: GdsHandle cannot be made here (AioHandle serves host memory)"
        return info
    opener = open_cufile or (lambda: cufile.open_driver(settings.cufile_library))
    try:
        path, driver, reason = gds.choose_path(settings.gds_path, opener)
    except GdsUnavailableError as e:
        info["reason"] = str(e)
        return info
    info.update(path=path, reason=reason)
    if driver is not None:
        info.update(cufile_version=driver.version, compat_mode=bool(driver.compat_mode), library_file=driver.path)
        if directory is not None:
            try:
                problem = gds.probe_registration(driver, directory)
            except OSError as error:
                problem = f"could not create a probe file: {error}"
            info["registers_files"] = True if problem is None else problem
    return info


def collect_info(directory: str = ".") -> dict[str, Any]:
    """Everything ``fastpersist info`` reports, as a JSON-serialisable dict."""
    import torch

    from fastpersist import config, system
    from fastpersist.io import checksum, engine

    status = engine.engine_status()
    try:
        auto = engine.resolve_engine("auto")
    except Exception as e:  # noqa: BLE001
        auto = f"error: {e}"
    directory = os.path.abspath(directory)
    try:
        probe: dict[str, Any] = dict(engine.probe_directory(directory))
    except OSError as e:
        probe = {"error": f"{type(e).__name__}: {e}"}
    probe["path"] = directory
    soft, hard = engine.memlock_limit()
    cuda = _cuda_info()
    return {
        "versions": {
            "fastpersist": _fastpersist_version(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "engines": {
            "compiled": engine.engines_compiled(),
            "status": status,
            "auto_selects": auto,
        },
        "directory": probe,
        "memory": {
            "memlock_soft_bytes": soft,
            "memlock_hard_bytes": hard,
            "cap_ipc_lock": system.effective_capability(14),
            "transparent_huge_pages": system.transparent_huge_pages(),
            "free_page_reporting": system.free_page_reporting(),
        },
        "checksums": {"crc32_method": engine.crc32_method(), "crc32_threads": checksum.threads()},
        "cuda": cuda,
        "gds": gds_info(cuda["available"], directory=directory),
        "tools": {"fio": system.find_fio(), "fio_note": None if system.find_fio() else system.FIO_INSTALL_HINT},
        "settings": config.settings().as_dict(),
    }


_CRC32_METHODS = {
    "vpclmul": "256-bit carry-less multiplication (VPCLMULQDQ)",
    "pclmul": "128-bit carry-less multiplication (PCLMULQDQ)",
    "table": "slice-by-8 table (no carry-less multiplication on this CPU)",
}


def _limit_text(value: int | None) -> str:
    if value is None:
        return "unlimited"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift:
            return f"{value / (1 << shift):g} {unit}"
    return f"{value} bytes"


def _print_info(info: dict[str, Any]) -> None:
    v = info["versions"]
    print(f"fastpersist {v['fastpersist']}   torch {v['torch']}   python {v['python']}   kernel {v['kernel']}")
    print(f"\nI/O engines (auto selects: {info['engines']['auto_selects']})")
    for name, s in info["engines"]["status"].items():
        state = "usable" if s["usable"] else ("not usable: " + s["reason"] if s["compiled"] else "not compiled")
        print(f"  {name:<9} {state}")
    d = info["directory"]
    print(f"\nDirectory {d['path']}")
    if "error" in d:
        print(f"  cannot probe: {d['error']}")
    else:
        print(f"  filesystem        {d['fs_type']}")
        print(f"  O_DIRECT          {'yes' if d['direct'] else 'no (' + d['reason'] + ')'}")
        print(f"  alignment         {d['alignment']} bytes (file offsets), {d['memory_alignment']} bytes (memory)")
    m = info["memory"]
    cap = {True: "yes", False: "no", None: "unknown"}[m["cap_ipc_lock"]]
    print("\nMemory")
    print(f"  memlock limit     {_limit_text(m['memlock_soft_bytes'])} (hard {_limit_text(m['memlock_hard_bytes'])})")
    print(f"  CAP_IPC_LOCK      {cap}" + ("   (locking is not limited by the memlock limit)" if cap == "yes" else ""))
    print(f"  transparent huge pages  {m['transparent_huge_pages']}")
    if m["free_page_reporting"]:
        print("  free page reporting     yes: freed memory goes back to the host; load destinations use 4 KiB pages")
    else:
        print("  free page reporting     no")
    k = info["checksums"]
    print("\nChecksums")
    print(
        f"  CRC-32            {_CRC32_METHODS.get(k['crc32_method'], k['crc32_method'])}, {k['crc32_threads']} threads"
    )
    fio = info["tools"]["fio"]
    print("\nBenchmark tools")
    print(f"  fio               {fio or 'not installed: ' + info['tools']['fio_note'].split('; ', 1)[1]}")
    c = info["cuda"]
    print("\nCUDA")
    if not c["available"]:
        print("  not available" + (f" ({c['error']})" if c.get("error") else ""))
    else:
        print(f"  torch CUDA {c['torch_cuda_version']}, {len(c['devices'])} device(s)")
        for dev in c["devices"]:
            print(f"  [{dev['index']}] {dev['name']}, {_limit_text(dev['memory_bytes'])}")
    _print_gds(info["gds"])


def _print_gds(g: dict[str, Any]) -> None:
    print("\nGPUDirect Storage (GdsHandle)")
    print(f"  gds_path setting  {g['gds_path_setting']}")
    library = g["library_file"] or "not found (pip install nvidia-cufile, or set FASTPERSIST_CUFILE_LIBRARY)"
    print(f"  libcufile         {library}")
    nvfs = "loaded" if g["nvidia_fs_loaded"] else "not loaded (cuFile can run in compatibility mode only)"
    print(f"  nvidia-fs         {nvfs}")
    if g["path"] is None:
        print(f"  path              unavailable: {g['reason']}")
    else:
        print(f"  path              {g['path']}: {g['reason']}")
    registers = g.get("registers_files")
    if registers is True:
        print("  files here        cuFile registers them")
    elif registers is not None:
        print(f"  files here        cuFile cannot register them ({registers}); path=auto moves their I/O to bounce")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=".", help="directory to probe for O_DIRECT support (default: current)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
    info = collect_info(args.dir)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=False))
    else:
        _print_info(info)
    return 0
