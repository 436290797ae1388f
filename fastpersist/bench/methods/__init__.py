"""Benchmark methods, one module per family; importing this package registers all of them.

* :mod:`~fastpersist.bench.methods.base` -- the interfaces and the registries;
* :mod:`~fastpersist.bench.methods.torch_baselines` -- torch.save / torch.load / DCP;
* :mod:`~fastpersist.bench.methods.safetensors_baseline` -- safetensors;
* :mod:`~fastpersist.bench.methods.fastpersist_methods` -- fastpersist;
* :mod:`~fastpersist.bench.methods.ceilings` -- storage upper bounds.

A new family is a new module here plus one import line below.
"""

from __future__ import annotations

from fastpersist.bench.methods import (
    ceilings,  # noqa: F401
    fastpersist_methods,  # noqa: F401
    safetensors_baseline,  # noqa: F401
    torch_baselines,  # noqa: F401 - registers its methods
)
from fastpersist.bench.methods.base import (
    LOAD_METHODS,
    SAVE_METHODS,
    BenchContext,
    LoadMethod,
    SaveMethod,
    register,
)

__all__ = ["BenchContext", "SaveMethod", "LoadMethod", "SAVE_METHODS", "LOAD_METHODS", "register"]
