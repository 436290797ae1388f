"""Builds the native core, fastpersist._native (C++17, pybind11, no torch needed)."""

import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _have_io_uring_header() -> bool:
    return os.path.exists("/usr/include/linux/io_uring.h")


sources = sorted(glob.glob("native/src/*.cpp")) + ["native/bindings/module.cpp"]

native = Pybind11Extension(
    "fastpersist._native",
    sources=sources,
    include_dirs=["native/include", "native/src"],
    cxx_std=17,
    extra_compile_args=["-O2", "-Wall"],
    libraries=["pthread"],
    define_macros=[("FASTPERSIST_HAVE_IO_URING", "1" if _have_io_uring_header() else "0")],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
