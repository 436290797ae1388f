"""DeepSpeed ``ds_nvme_tune``'s options for ``fastpersist tune``, and its ``"aio"`` JSON.

``fastpersist tune --nvme_dir /local_nvme --gpu`` runs like ``ds_nvme_tune``
with the program name replaced: :func:`add_arguments` declares
ds_nvme_tune's options, :func:`apply` maps them onto the tuner's
(``--nvme_dir`` -> ``--dir``, ``--io_size`` -> ``--size``, ``--loops`` ->
``--repeats``, ``--gpu`` -> ``--device cuda``, ``--gds`` -> ``--device cuda`` measuring
:class:`fastpersist.GdsHandle` transfers (DeepNVMe's ``gds_handle``) instead of
``save``/``load``, ``--no_read`` / ``--no_write`` ->
``--optimize save`` / ``load``, ``--sweep_config`` -> the knobs swept), and
:func:`aio_config` turns the recommendation into DeepSpeed's ``"aio"``
section. The table is in docs/deepnvme-parity.md.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from fastpersist import config
from fastpersist.errors import UsageError

__all__ = [
    "DEFAULT_SWEEP_CONFIG",
    "UsageError",
    "add_arguments",
    "is_ds_nvme_tune",
    "apply",
    "sweep_knobs",
    "aio_config",
    "format_aio",
]

DEFAULT_SWEEP_CONFIG: dict[str, list[Any]] = {
    "block_size": ["1M", "8M"],
    "queue_depth": [32, 128],
    "sequential_requests": [True, False],
    "single_submit": [False, True],
    "io_parallel": [1, 2, 4, 8],
}
"""ds_nvme_tune's search space when no ``--sweep_config`` is given."""

DEFAULT_IO_SIZE = "400M"
_AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ds_nvme_tune's options (as a group) to ``parser``."""
    g = parser.add_argument_group("DeepSpeed ds_nvme_tune", "ds_nvme_tune's options with ds_nvme_tune's meaning")
    g.add_argument("--nvme_dir", nargs="+", default=None, metavar="NVME_DIR", help="directory to tune (= --dir)")
    g.add_argument(
        "--sweep_config",
        default=None,
        help="ds_nvme_tune sweep JSON: block_size, queue_depth, sequential_requests, single_submit, io_parallel",
    )
    g.add_argument("--no_read", action="store_true", help="do not optimize reads (= --optimize save)")
    g.add_argument("--no_write", action="store_true", help="do not optimize writes (= --optimize load)")
    g.add_argument(
        "--io_size", default=None, help=f"bytes per measurement, e.g. 400M (= --size; default {DEFAULT_IO_SIZE})"
    )
    g.add_argument("--gpu", action="store_true", help="tune GPU tensors <-> storage (= --device cuda)")
    g.add_argument(
        "--gds",
        action="store_true",
        help="tune GdsHandle (DeepNVMe's gds_handle) moving CUDA tensors, on its cufile or bounce path "
        "(the gds_path setting); implies --gpu",
    )
    g.add_argument(
        "--flush_page_cache",
        action="store_true",
        help="accepted: the page cache of each loaded file is always dropped (no sudo needed)",
    )
    g.add_argument("--log_dir", default=None, help="also write every measurement and the aio JSON here")
    g.add_argument("--loops", type=int, default=None, help="rounds per value (= --repeats; default 1)")
    g.add_argument("--verbose", action="store_true", help="print the options and how they were mapped")


def is_ds_nvme_tune(args: argparse.Namespace) -> bool:
    """Whether ``args`` is a ds_nvme_tune command line (it names ``--nvme_dir``, required there)."""
    return bool(getattr(args, "nvme_dir", None))


def _as_list(key: str, value: Any) -> list[Any]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise UsageError(f"--sweep_config: {key} has no values")
    return values


def sweep_knobs(sweep: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """The tuner's settings and values for a ds_nvme_tune sweep configuration.

    ``sequential_requests`` becomes ``overlap_events`` (negated),
    ``io_parallel`` ``intra_op_parallelism``; sizes take ds_io's syntax.

    Raises:
        UsageError: an unknown key or a value of the wrong type.
    """
    knobs: dict[str, tuple[Any, ...]] = {}
    for key, value in sweep.items():
        values = _as_list(key, value)
        try:
            if key == "block_size":
                knobs["block_size"] = tuple(config.parse_size(v) for v in values)
            elif key == "queue_depth":
                knobs["queue_depth"] = tuple(int(v) for v in values)
            elif key == "io_parallel":
                knobs["intra_op_parallelism"] = tuple(int(v) for v in values)
            elif key in ("single_submit", "sequential_requests"):
                if not all(isinstance(v, bool) for v in values):
                    raise UsageError(f"--sweep_config: {key} takes true/false values, got {values!r}")
                if key == "single_submit":
                    knobs["single_submit"] = tuple(values)
                else:
                    knobs["overlap_events"] = tuple(not v for v in values)
            else:
                raise UsageError(
                    f"--sweep_config: unknown key {key!r}; ds_nvme_tune's keys are {', '.join(DEFAULT_SWEEP_CONFIG)}"
                )
        except (TypeError, ValueError) as e:
            if isinstance(e, UsageError):
                raise
            raise UsageError(f"--sweep_config: bad {key} values {values!r} ({e})") from None
    return knobs


def apply(args: argparse.Namespace) -> argparse.Namespace:
    """Maps ds_nvme_tune's options onto the tuner's, in place.

    Sets ``dir``, ``size``, ``repeats``, ``optimize``, ``device``, ``json``
    and ``knob_values`` (``{setting: values}`` from the sweep configuration,
    or None). Without ds_nvme_tune options nothing changes but
    ``knob_values = None``. ``--gds`` sets ``--gpu`` and, like a
    ds_nvme_tune command line, sweeps ds_nvme_tune's space by default (the
    handle's own settings are the only ones a ``GdsHandle`` has).

    Raises:
        UsageError: several ``--nvme_dir``, ``--no_read`` with ``--no_write``,
            ``--gpu`` or ``--gds`` without CUDA, ``--gds`` with ``--settings``
            other than the handle's, a bad sweep file.
    """
    args.knob_values = None
    gds = bool(getattr(args, "gds", False))
    if gds:
        if not torch.cuda.is_available():
            raise UsageError(
                "--gds tunes GdsHandle, which moves CUDA tensors: it needs a CUDA device and torch with CUDA; "
                "none is available here (drop --gds to tune host memory <-> storage)"
            )
        args.gpu = True
    ds = is_ds_nvme_tune(args)
    used = [
        name
        for name in ("sweep_config", "no_read", "no_write", "io_size", "gpu", "log_dir", "loops")
        if getattr(args, name, None) not in (None, False)
    ]
    if not ds and not used:
        return args
    if ds:
        if len(args.nvme_dir) > 1:
            raise UsageError(
                "--nvme_dir with several directories (one per device) is not supported; run once per directory"
            )
        if args.dir not in (".", None) and os.path.abspath(args.dir) != os.path.abspath(args.nvme_dir[0]):
            raise UsageError("--dir and --nvme_dir name the same thing; give one")
        args.dir = args.nvme_dir[0]
    if args.io_size is not None:
        if args.size is not None and config.parse_size(args.size) != config.parse_size(args.io_size):
            raise UsageError("--size and --io_size name the same thing; give one")
        args.size = args.io_size
    elif ds and args.size is None:
        args.size = DEFAULT_IO_SIZE
    if args.size is not None:
        try:
            config.parse_size(args.size)
        except ValueError as e:
            raise UsageError(f"--io_size: {e}") from None
    if args.loops is not None:
        if args.repeats is not None and args.repeats != args.loops:
            raise UsageError("--repeats and --loops name the same thing; give one")
        args.repeats = args.loops
    elif ds and args.repeats is None:
        args.repeats = 1  # ds_nvme_tune's default
    if args.no_read and args.no_write:
        raise UsageError("--no_read and --no_write together leave nothing to measure")
    if args.no_read or args.no_write:
        wanted = "save" if args.no_read else "load"
        if args.optimize not in ("both", wanted):
            raise UsageError(f"--no_read/--no_write contradict --optimize {args.optimize}")
        args.optimize = wanted
    if args.gpu:
        if not torch.cuda.is_available():
            raise UsageError(
                "--gpu needs a CUDA device and torch with CUDA; none is available here "
                "(drop --gpu to tune host memory <-> storage)"
            )
        if args.device not in ("cpu", "cuda") and not str(args.device).startswith("cuda"):
            raise UsageError(f"--gpu contradicts --device {args.device}")
        if args.device == "cpu":
            args.device = "cuda"
    if args.sweep_config is not None:
        try:
            with open(args.sweep_config) as f:
                sweep = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(f"--sweep_config {args.sweep_config}: {e}") from None
        if not isinstance(sweep, dict):
            raise UsageError(f"--sweep_config {args.sweep_config}: expected a JSON object")
        args.knob_values = sweep_knobs(sweep)
    elif (ds or gds) and not getattr(args, "settings", None):
        args.knob_values = sweep_knobs(DEFAULT_SWEEP_CONFIG)
    if gds:
        knobs = args.knob_values or {}
        wanted = [w.strip() for w in (getattr(args, "settings", None) or "").split(",") if w.strip()]
        other = sorted({*knobs, *wanted} - set(_AIO_KEYS))
        if other:
            raise UsageError(f"--gds tunes the handle's settings ({', '.join(_AIO_KEYS)}) only, not {', '.join(other)}")
        if not knobs:
            args.knob_values = {
                name: values for name, values in sweep_knobs(DEFAULT_SWEEP_CONFIG).items() if name in wanted
            }
    if args.log_dir is not None:
        os.makedirs(args.log_dir, exist_ok=True)
        if args.json is None:
            args.json = os.path.join(args.log_dir, "fastpersist-tune.json")
    return args


def aio_config(recommended: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's ``{"aio": {...}}`` for a recommendation (settings not swept keep their current value).

    Booleans are the strings ``"true"`` / ``"false"``, as ds_nvme_tune prints them.
    """
    current = config.settings().as_dict()
    values = {key: recommended.get(key, current[key]) for key in _AIO_KEYS}
    return {
        "aio": {
            "single_submit": "true" if values["single_submit"] else "false",
            "overlap_events": "true" if values["overlap_events"] else "false",
            "intra_op_parallelism": int(values["intra_op_parallelism"]),
            "queue_depth": int(values["queue_depth"]),
            "block_size": int(values["block_size"]),
        }
    }


def format_aio(recommended: dict[str, Any], read_gbps: float | None, write_gbps: float | None) -> str:
    """ds_nvme_tune's closing lines: best read/write GB/sec, then the ``"aio"`` JSON."""

    def show(x: float | None) -> str:
        return f"{x:5.2f}" if x is not None else "    -"

    return f"Best performance (GB/sec): read = {show(read_gbps)}, write = {show(write_gbps)}\n" + json.dumps(
        aio_config(recommended), indent=3
    )
