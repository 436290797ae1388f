"""Swaps torch.save / torch.load (and torch.serialization.save / load) for fastpersist's.

Imported by run_torch_serialization.py before PyTorch's test module, so every
call that test makes goes through fastpersist. fastpersist keeps references to
torch's own functions for the cases it hands to torch (legacy format,
skip_data, file objects), so the swap does not recurse.
"""

from __future__ import annotations

import torch
import torch.serialization

import fastpersist


def install() -> None:
    torch.save = fastpersist.save
    torch.load = fastpersist.load
    torch.serialization.save = fastpersist.save
    torch.serialization.load = fastpersist.load
