"""The safetensors baseline: ``safetensors.torch.save_file`` / ``load_file`` of the flattened tensors."""

from __future__ import annotations

import json

from fastpersist.bench.methods.base import LoadMethod, SaveMethod, register
from fastpersist.tuning import workloads

__all__ = ["SafetensorsSave", "SafetensorsLoad"]


class SafetensorsSave(SaveMethod):
    """safetensors.torch.save_file of the flattened tensors (other leaves go to the metadata as JSON)."""

    name = "safetensors"
    label = "safetensors save_file + fsync"
    extension = ".safetensors"

    def unavailable(self, ctx):
        try:
            import numpy  # noqa: F401  (safetensors.torch converts through numpy)
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            return f"safetensors (with numpy) is not installed ({e})"
        return None

    def save(self, state, path, ctx):
        from safetensors.torch import save_file

        tensors, objects = workloads.flatten_state(state)
        metadata = {"objects": json.dumps(objects, default=repr)} if objects else None
        save_file(tensors, path, metadata=metadata)
        return {}

    def read_back(self, path, state, ctx):
        from safetensors.torch import load_file

        return load_file(path, device=str(ctx.device))

    def flat(self, loaded):
        return dict(loaded), None


class SafetensorsLoad(LoadMethod):
    name = "safetensors.load"
    label = "safetensors load_file"
    source = "safetensors"

    def unavailable(self, ctx):
        return SafetensorsSave().unavailable(ctx)

    def load(self, path, state, ctx):
        from safetensors.torch import load_file

        return load_file(path, device=str(ctx.device))

    def flat(self, loaded):
        return dict(loaded), None


register(SafetensorsSave())
register(SafetensorsLoad())
