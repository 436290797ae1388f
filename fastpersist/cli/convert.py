"""``fastpersist convert IN OUT``: torch checkpoints to safetensors files and back.

The input's format is recognised from its bytes; the output's from ``--to``,
else its extension (``.safetensors`` -> safetensors, anything else -> a torch
checkpoint). Both are written by fastpersist (atomic and durable).

torch -> safetensors (``--key state_dict`` picks a sub-object, e.g. of a
Lightning checkpoint):

* nested dicts and lists are flattened to dotted names
  (``optimizer.state.0.exp_avg``);
* leaves that are not tensors (epoch numbers, hyper-parameters, ...) are
  refused, with their names, unless ``--drop-non-tensors`` leaves them out (it
  does so for torch outputs too, keeping the nesting) or
  ``--keep-structure`` stores the whole object as fastpersist does for
  ``save(obj, "x.safetensors")`` (the structure goes into ``__metadata__``;
  ``fastpersist.load`` rebuilds it, other readers see the tensors);
* tensors that are the same memory (tied weights) are stored once, and the
  other names recorded in ``__metadata__`` as ``{"dropped": "kept"}`` (what
  ``safetensors.torch.save_model`` does); overlapping views and
  non-contiguous tensors are stored as contiguous copies.

safetensors -> torch: the tensors (or the object stored with
``--keep-structure``) are saved with ``torch.save``'s format; the header's
``__metadata__`` is printed, not stored.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import sys
import time
from typing import Any

__all__ = ["HELP", "add_arguments", "drop_non_tensors", "flatten_tensors", "run"]

HELP = "convert between torch checkpoints and safetensors files"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="a torch checkpoint or a safetensors file")
    parser.add_argument("output", help="the file to write (replaced atomically)")
    parser.add_argument(
        "--to",
        choices=("safetensors", "torch"),
        default=None,
        help="output format (default: safetensors for a .safetensors output, else torch)",
    )
    parser.add_argument(
        "--key", default=None, help="convert only this entry of the input (dotted for nested ones, e.g. state_dict)"
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--drop-non-tensors", action="store_true", help="leave out values that are not tensors")
    group.add_argument(
        "--keep-structure",
        action="store_true",
        help="store the whole object (non-tensor values too) as fastpersist.save(..., format='safetensors')",
    )
    parser.add_argument(
        "--metadata",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="add to the safetensors header's __metadata__ (repeatable)",
    )
    parser.add_argument(
        "--unsafe-pickle",
        action="store_true",
        help="load the torch checkpoint with weights_only=False (only for files you trust)",
    )


def _select(obj: Any, key: str | None) -> Any:
    if key is None:
        return obj
    for part in key.split("."):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, (list, tuple)) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            available = list(obj)[:20] if isinstance(obj, dict) else type(obj).__name__
            raise SystemExit(f"convert: --key {key!r}: no entry {part!r} (the level holds {available})")
    return obj


def flatten_tensors(obj: Any, drop_non_tensors: bool = False) -> tuple[dict[str, Any], list[str]]:
    """``({dotted name: tensor}, [dotted names of non-tensor leaves])`` of nested dicts/lists/tuples."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    others: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            name, suffix = path or "tensor", 1
            while name in tensors:
                name, suffix = f"{path}#{suffix}", suffix + 1
            tensors[name] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}.{index}" if path else str(index))
        else:
            others.append(path or "<root>")

    walk(obj, "")
    return tensors, others


def _storable(tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Tensors safetensors accepts: aliases of one tensor kept once (recorded), overlaps and strided views copied."""
    import torch

    from fastpersist.api.dispatch import _tensor_identity
    from fastpersist.api.safetensors import find_shared_tensors

    result = {name: tensor for name, tensor in tensors.items()}
    aliases: dict[str, str] = {}
    for group in find_shared_tensors(result):
        if len(group) < 2:
            continue
        kept: dict[tuple, str] = {}
        for name in sorted(group):
            identity = _tensor_identity(result[name])
            if identity in kept:
                aliases[name] = kept[identity]
                del result[name]
            else:
                kept[identity] = name
        if len(kept) > 1:  # different views of one storage: each gets its own copy
            for name in kept.values():
                result[name] = result[name].clone(memory_format=torch.contiguous_format)
    for name, tensor in result.items():
        if not tensor.is_contiguous():
            result[name] = tensor.contiguous()
    return result, aliases


def drop_non_tensors(obj: Any) -> tuple[Any, list[str]]:
    """``obj`` with only its tensors (in nested dicts, lists and tuples), and the dotted names of what was left out."""
    import torch

    dropped: list[str] = []

    def keep(value: Any, path: str) -> tuple[bool, Any]:
        if isinstance(value, torch.Tensor):
            return True, value
        if isinstance(value, dict):
            kept = {}
            for key, item in value.items():
                ok, item = keep(item, f"{path}.{key}" if path else str(key))
                if ok:
                    kept[key] = item
            return True, collections.OrderedDict(kept) if isinstance(value, collections.OrderedDict) else kept
        if isinstance(value, (list, tuple)):
            items = [
                item for ok, item in (keep(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)) if ok
            ]
            return True, items if isinstance(value, list) else tuple(items)
        dropped.append(path or "<root>")
        return False, None

    ok, result = keep(obj, "")
    return (result if ok else {}), dropped


def _unreadable(error: BaseException, path: str, unsafe: bool) -> str:
    from fastpersist.api import dispatch

    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    try:
        zipped = dispatch.is_torch_zip_file(path)
    except OSError:
        zipped = False
    if not zipped and not isinstance(error, OSError):
        return (
            "not a checkpoint: neither a zip archive (what torch.save writes) nor a safetensors file "
            f"({type(error).__name__}: {first[:200]})"
        )
    hint = ""
    if isinstance(error, pickle.UnpicklingError) and not unsafe:
        hint = (
            "; it holds objects that weights_only loading refuses: if you trust the file, add --unsafe-pickle "
            "(weights_only=False)"
        )
    return f"cannot be read ({type(error).__name__}: {first[:300]}){hint}"


def _save(write) -> None:
    """Runs the write; an I/O error becomes a one-line message and exit status 1 (the previous file is intact)."""
    try:
        write()
    except OSError as e:
        raise SystemExit(f"convert: could not write the output: {e}") from None


def run(args: argparse.Namespace) -> int:
    import fastpersist
    from fastpersist.api import dispatch
    from fastpersist.api import safetensors as st

    target = args.to or ("safetensors" if args.output.lower().endswith(".safetensors") else "torch")
    if not os.path.isfile(args.input):
        print(f"convert: {args.input}: no such file", file=sys.stderr)
        return 2
    directory = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(directory):
        print(f"convert: the output's directory {directory} does not exist; create it first", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        source_is_safetensors = dispatch.is_safetensors_file(args.input)
        if source_is_safetensors:
            with st.safe_open(args.input) as f:
                header_metadata = f.metadata()
            obj = fastpersist.load(args.input)
        else:
            obj = fastpersist.load(args.input, map_location="cpu", weights_only=not args.unsafe_pickle)
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError) as e:
        print(f"convert: {args.input}: {_unreadable(e, args.input, args.unsafe_pickle)}", file=sys.stderr)
        return 1
    obj = _select(obj, args.key)
    extra = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"convert: --metadata {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        extra[key] = value
    if target == "torch":
        if extra:
            print("convert: --metadata applies to safetensors outputs only", file=sys.stderr)
            return 2
        if args.drop_non_tensors:
            obj, dropped = drop_non_tensors(obj)
            if dropped:
                print(f"dropped {len(dropped)} non-tensor values: {', '.join(dropped[:10])}")
        _save(lambda: fastpersist.save(obj, args.output, format="torch"))
        count = len(flatten_tensors(obj)[0])
        if source_is_safetensors and header_metadata:
            print(f"note: the input's __metadata__ is not stored in the torch checkpoint: {header_metadata}")
    else:
        if args.keep_structure:
            tensors, metadata = dispatch.flatten(obj)  # aliases already stored once
            tensors, _ = _storable(tensors)
            metadata = {**(metadata or {}), **extra}
        else:
            tensors, others = flatten_tensors(obj)
            if others and not args.drop_non_tensors:
                shown = ", ".join(others[:10]) + (f" and {len(others) - 10} more" if len(others) > 10 else "")
                print(
                    f"convert: {len(others)} values are not tensors ({shown}); a safetensors file holds only "
                    "tensors. Use --key to pick the state dict (e.g. --key state_dict), --drop-non-tensors to "
                    "leave them out, or --keep-structure to store them as fastpersist does",
                    file=sys.stderr,
                )
                return 2
            if others:
                print(f"dropped {len(others)} non-tensor values: {', '.join(others[:10])}")
            tensors, aliases = _storable(tensors)
            metadata = {**aliases, **extra} or None
        _save(lambda: st.save_file(tensors, args.output, metadata=metadata))
        count = len(tensors)
    elapsed = time.perf_counter() - started
    size = os.path.getsize(args.output)
    print(f"{args.input} -> {args.output} ({target}): {count} tensors, {size / 1e6:.1f} MB in {elapsed:.2f} s")
    return 0
