"""Which weights stay on the device and which are streamed, in which units, laid out how.

Pure planning (no I/O): the model's parameters and buffers are matched with
the checkpoint's keys (every mismatch is collected and raised at once,
naming keys), the module tree is cut into **units** (modules whose forward
loads and releases their weights together), and the budget decides which
units are resident and how many streaming slots there are.

Units: a module whose weights total at most ``unit_bytes`` (default: 1/32 of
the model, and at least its largest leaf module) is one unit; a larger one is
split into its children (containers such as ``ModuleList`` always are), and
its own direct tensors become resident. Tensors shared by several modules
(tied weights) are resident, and so is the unit holding the model's first
parameter (frameworks read ``next(model.parameters()).device``).

Layout of a unit in a slot: each tensor gets a page-aligned region in which
its bytes sit at the same offset modulo the page as in its file, so the
aligned superset of its file range is read with O_DIRECT straight into the
region (the read's head and tail land in the region's padding). On a CUDA
device each tensor starts at its region's start instead: the host-to-device
copy shifts it (:meth:`Unit.device_copies`), so every weight is page-aligned
on the device as a freshly allocated one is. Operands at the file's alignment
(8 bytes in a safetensors file) make cuBLAS pick other kernels, whose
results differ in the last bits from a fully loaded model's: enough to change
greedy tokens of a deep model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from fastpersist.errors import OffloadPlanError
from fastpersist.offload.index import TensorSource

__all__ = ["PAGE", "Binding", "OffloadPlanError", "Unit", "bind_tensors", "declared_ties", "place", "split_units"]

PAGE = 4096


@dataclasses.dataclass(frozen=True)
class Binding:
    """One tensor slot of a module (``module._parameters[name]`` or ``_buffers[name]``) and its source."""

    module: torch.nn.Module
    name: str
    is_parameter: bool
    source: TensorSource
    region: int = 0
    """Page-aligned offset of its region in the unit's layout."""

    @property
    def data_offset(self) -> int:
        """Where its bytes start in the unit's layout."""
        return self.region + self.source.offset % PAGE

    @property
    def shift(self) -> int:
        """How far its bytes sit past its region's start in host memory (0 on a CUDA device)."""
        return self.source.offset % PAGE

    @property
    def read_span(self) -> tuple[int, int]:
        """The page-aligned file range ``(offset, length)`` read into its region."""
        start = self.source.offset - self.source.offset % PAGE
        end = -(-(self.source.offset + self.source.nbytes) // PAGE) * PAGE
        return start, end - start


@dataclasses.dataclass(eq=False)
class Unit:
    """Modules' weights loaded and released together (one module's subtree)."""

    name: str
    module: torch.nn.Module
    bindings: list[Binding]
    nbytes: int = 0
    """Bytes of its layout (regions included)."""

    def lay_out(self) -> None:
        """Gives each tensor its region; tied tensors (the same bytes in the file) share one."""
        position, laid, regions = 0, [], {}
        for binding in self.bindings:
            where = (binding.source.path, binding.source.offset, binding.source.nbytes)
            if where not in regions:
                regions[where] = position
                position += binding.read_span[1]
            laid.append(dataclasses.replace(binding, region=regions[where]))
        self.bindings, self.nbytes = laid, position

    @property
    def reads(self) -> list[Binding]:
        """One binding per region: what to read."""
        return list({b.region: b for b in self.bindings}.values())

    @property
    def tensor_bytes(self) -> int:
        return sum(b.source.nbytes for b in self.reads)

    def device_copies(self) -> list[tuple[int, int, int]]:
        """``(host_offset, device_offset, length)`` copies that put every tensor at its region's start.

        Consecutive regions whose tensors sit at the same offset within their
        page are one copy (all of them, for tensors whose sizes are multiples
        of the page): the padding between them travels along.
        """
        runs: list[list[int]] = []
        for b in sorted(self.reads, key=lambda b: b.region):
            end = b.region + b.source.nbytes
            last = runs[-1] if runs else None
            if last is not None and last[3] == b.shift and last[1] + last[2] <= b.region:
                last[2] = end - last[1]
            else:
                runs.append([b.region + b.shift, b.region, b.source.nbytes, b.shift])
        return [(host, device, length) for host, device, length, _ in runs]


def declared_ties(model: torch.nn.Module) -> dict[str, str]:
    """The ties ``model`` declares, ``{target name: source name}``: names of one tensor, saved under one of them.

    transformers' own expanded mapping where the model has it
    (``get_expanded_tied_weights_keys``, transformers 5: it honours the
    current configuration, ``tie_word_embeddings`` and the like), else a
    ``_tied_weights_keys`` mapping of plain names (transformers' convention,
    on any module) unless ``config.tie_word_embeddings`` is false. The list
    form of older transformers releases names no sources: there the model's
    ``tie_weights()`` alone ties. No declaration: ``{}``.
    """
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(expand):
        declared = expand(all_submodels=True)
    else:
        declared = getattr(model, "_tied_weights_keys", None)
        if not getattr(getattr(model, "config", None), "tie_word_embeddings", True):
            declared = None
    if not isinstance(declared, Mapping):
        return {}
    return {str(k): str(v) for k, v in declared.items()}


def bind_tensors(model: torch.nn.Module, index: Mapping[str, TensorSource], tied: Mapping[str, str] | None = None):
    """Matches every parameter and buffer of ``model`` with a checkpoint key.

    A key absent from the checkpoint is found through a tied name that is
    there: another name of the same tensor object, or a name ``tied``
    declares tied with it (``{target: source}``, either way round; see
    :func:`declared_ties`). A declared partner that is a separate tensor in
    the model is bound to the same bytes and becomes the same tensor, as if
    tied.

    Returns:
        ``(groups, kept)``: ``groups`` maps each distinct tensor object's
        ``id`` to its bindings (several for tied tensors), ``kept`` lists the
        non-persistent buffers that hold values and are not in the checkpoint.

    Raises:
        OffloadPlanError: missing keys, unexpected keys, shape or dtype
            mismatches, non-persistent buffers left on the meta device, all
            of them in one message.
    """
    groups: dict[int, list[Binding]] = {}
    kept: list[tuple[torch.nn.Module, str, bool]] = []
    missing, wrong, unset, used = [], [], [], set()
    bound: dict[str, tuple[int, TensorSource]] = {}  # key -> its tensor's id (its group) and its bytes
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        tensors = [(n, t, True) for n, t in module._parameters.items() if t is not None]
        tensors += [(n, t, False) for n, t in module._buffers.items() if t is not None]
        for name, tensor, is_parameter in tensors:
            key = prefix + name
            source = index.get(key)
            if source is None:
                if not is_parameter and name in module._non_persistent_buffers_set:
                    if tensor.is_meta:
                        unset.append(key)  # in no checkpoint: its value had to come from the model
                    else:
                        kept.append((module, name, False))
                    continue
                if id(tensor) in groups:  # a tied tensor saved under another of its names
                    source = groups[id(tensor)][0].source
                else:
                    missing.append(key)
                    continue
            used.add(key)
            if not _matches(key, tensor, source, wrong):
                continue
            groups.setdefault(id(tensor), []).append(Binding(module, name, is_parameter, source))
            bound[key] = (id(tensor), source)
    # Tied tensors saved under one name only are found through the group above; a later name may
    # come first in module order: resolve the missing ones that belong to a group after all.
    missing = [k for k in missing if not _tied_elsewhere(model, k, groups)]
    families = _families(tied or {})
    missing = [k for k in missing if not _tied_by_declaration(model, k, families, groups, bound, wrong)]
    extra = sorted(set(index) - used)
    mismatches = []
    if missing:
        mismatches.append(f"missing from the checkpoint: {_few(missing)}")
    if extra:
        mismatches.append(f"in the checkpoint but not in the model: {_few(extra)}")
    if wrong:
        mismatches.append(
            "mismatched: " + "; ".join(wrong[:5]) + (f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else "")
        )
    problems = []
    if mismatches:
        problems.append(
            "the checkpoint does not match the model: " + ". ".join(mismatches) + ". Build the model with the same "
            "configuration and dtype as the checkpoint (on the meta device: model.to(dtype) there is free)"
        )
    if unset:
        problems.append(
            f"non-persistent buffers are on the meta device: {_few(unset)}. No checkpoint holds them (the model "
            "computes them when it is built), so they must hold values: build the model with "
            "accelerate.init_empty_weights() (parameters on meta, buffers real) or on the CPU instead of under "
            'torch.device("meta"), or assign those buffers before dispatch'
        )
    if problems:
        raise OffloadPlanError("; ".join(problems))
    return groups, kept


def _matches(key: str, tensor: torch.Tensor, source: TensorSource, wrong: list[str]) -> bool:
    """Whether ``tensor`` can be bound to ``source``; if not, says why in ``wrong``."""
    if tuple(tensor.shape) != source.shape or tensor.dtype != source.dtype:
        wrong.append(
            f"{key}: the model has {tuple(tensor.shape)} {tensor.dtype}, the checkpoint {source.shape} {source.dtype}"
        )
        return False
    if source.offset % tensor.element_size():
        wrong.append(f"{key}: stored at an offset that is not a multiple of its element size")
        return False
    return True


def _tied_elsewhere(model: torch.nn.Module, key: str, groups: dict[int, list[Binding]]) -> bool:
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    tensor = module._parameters.get(name)
    if tensor is None:
        tensor = module._buffers.get(name)
    if tensor is None or id(tensor) not in groups:
        return False
    source = groups[id(tensor)][0].source
    groups[id(tensor)].append(Binding(module, name, name in module._parameters, source))
    return True


def _families(tied: Mapping[str, str]) -> dict[str, set[str]]:
    """Each declared-tied name -> every name tied with it (a target, its source and the source's other targets)."""
    families: dict[str, set[str]] = {}
    for target, source in tied.items():
        family = families.get(source, {source}) | families.get(target, {target})
        for name in family:
            families[name] = family
    return families


def _tied_by_declaration(
    model: torch.nn.Module,
    key: str,
    families: dict[str, set[str]],
    groups: dict[int, list[Binding]],
    bound: dict[str, tuple[int, TensorSource]],
    wrong: list[str],
) -> bool:
    """Binds ``key`` with a declared partner that was bound (into its group: the same bytes, one tensor)."""
    partner = next((name for name in sorted(families.get(key, ())) if name in bound), None)
    if partner is None:
        return False
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    is_parameter = name in module._parameters
    tensor = module._parameters[name] if is_parameter else module._buffers[name]
    group, source = bound[partner]
    if _matches(key, tensor, source, wrong):
        groups[group].append(Binding(module, name, is_parameter, source))
        bound[key] = bound[partner]
    return True


def _few(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def split_units(model: torch.nn.Module, groups: dict[int, list[Binding]], unit_bytes: int | None):
    """Cuts the module tree into units; returns ``(units, the always-resident unit)``.

    The always-resident unit holds tied tensors and containers' own tensors
    (its module is the model; its forward is not wrapped).
    """
    owner: dict[tuple[int, str], list[Binding]] = {}
    shared: list[Binding] = []
    for bindings in groups.values():
        if len({id(b.module) for b in bindings}) > 1:
            shared += bindings  # tied across modules: resident
        else:
            # One module: reached by several paths (one binding per name kept), or one tensor under several
            # of its names (all kept: the unit binds them as one tensor).
            for b in _unique(bindings):
                owner.setdefault((id(b.module), b.name), []).append(b)

    def own(module: torch.nn.Module) -> list[Binding]:
        return [b for (mid, _), bs in owner.items() if mid == id(module) for b in bs]

    sizes: dict[int, int] = {}

    def size(module: torch.nn.Module) -> int:
        if id(module) not in sizes:
            sizes[id(module)] = sum(b.source.nbytes for b in own(module)) + sum(size(c) for c in module.children())
        return sizes[id(module)]

    total = size(model)
    leaves = [m for m in model.modules() if not list(m.children())]
    largest_leaf = max((size(m) for m in leaves), default=0)
    limit = unit_bytes if unit_bytes is not None else max(total // 32, largest_leaf, 1)

    units: list[Unit] = []
    resident: list[Binding] = list(shared)

    def visit(name: str, module: torch.nn.Module) -> None:
        children = list(module.named_children())
        if size(module) == 0:
            return
        if (size(module) <= limit or not children) and not isinstance(module, _CONTAINERS):
            bindings = [b for m in module.modules() for b in own(m)]
            units.append(Unit(name or "(model)", module, bindings))
            return
        resident.extend(own(module))
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    for unit in units:
        unit.lay_out()
    pinned = Unit("(shared)", model, _unique(resident))
    pinned.lay_out()
    return units, pinned


def _unique(bindings: list[Binding]) -> list[Binding]:
    seen, result = set(), []
    for b in bindings:
        if (id(b.module), b.name) not in seen:
            seen.add((id(b.module), b.name))
            result.append(b)
    return result


def place(
    units: list[Unit],
    pinned: Unit,
    first_parameter: torch.Tensor | None,
    budget: int | None,
    slots: int,
) -> tuple[list[Unit], list[Unit], int, int]:
    """Splits ``units`` into resident and streamed under ``budget`` bytes.

    Streamed units share ``slots`` slots of the largest streamed unit's size.
    ``budget=None``: everything resident. Returns ``(resident units, streamed
    units, slots, slot bytes)``.

    Raises:
        OffloadPlanError: the budget cannot hold what must be resident plus
            one slot (the message gives the minimum).
    """
    forced = [u for u in units if first_parameter is not None and any(_holds(b, first_parameter) for b in u.bindings)]
    fixed = pinned.nbytes + sum(u.nbytes for u in forced)
    others = [u for u in units if u not in forced]
    if budget is None or fixed + sum(u.nbytes for u in others) <= budget:
        return forced + others, [], 0, 0
    largest = max(u.nbytes for u in others)
    minimum = fixed + largest
    if budget < minimum:
        raise OffloadPlanError(
            f"the memory budget ({_gib(budget)}) is smaller than the weights that must stay resident "
            f"({_gib(fixed)}: tied weights, the first module's, containers' own) plus one slot for the largest "
            f"streamed module ({_gib(largest)}): give at least {_gib(minimum)} ({minimum} bytes)"
        )
    count = max(1, min(slots, (budget - fixed) // largest))
    room = budget - fixed - count * largest
    kept, streamed = list(forced), []
    for unit in others:  # in model order: the first modules run first
        if unit.nbytes <= room:
            kept.append(unit)
            room -= unit.nbytes
        else:
            streamed.append(unit)
    if not streamed:
        return kept, [], 0, 0
    slot_bytes = max(u.nbytes for u in streamed)
    return kept, streamed, min(count, len(streamed)), slot_bytes


def _holds(binding: Binding, tensor: torch.Tensor) -> bool:
    current = binding.module._parameters.get(binding.name) if binding.is_parameter else None
    return current is tensor


def _gib(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"
