"""One size syntax everywhere: config.parse_size, settings, environment and every command agree."""

from __future__ import annotations

import argparse

import pytest

from fastpersist import config
from fastpersist.bench import io as bench_io
from fastpersist.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("0", 0),
        ("8K", 8 << 10),
        ("8k", 8 << 10),
        ("8KB", 8 << 10),
        ("8KiB", 8 << 10),
        ("64M", 64 << 20),
        ("512MiB", 512 << 20),
        ("2G", 2 << 30),
        ("2GB", 2 << 30),
        ("2gib", 2 << 30),
        (" 1T ", 1 << 40),
        ("1.5G", 3 << 29),
        (".5M", 1 << 19),
        ("100B", 100),
    ],
)
def test_units_are_binary(text, expected):
    assert config.parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "", "1.5", "2X", "-1", "1e9", "G", True, None, -4096, 1.5])
def test_refuses_what_is_not_a_whole_size(text):
    with pytest.raises(ValueError):
        config.parse_size(text)


def test_settings_and_environment_use_the_same_parser(monkeypatch):
    with config.override(buffer_size="2M"):
        assert config.get("buffer_size") == config.parse_size("2M") == 2 << 20
    monkeypatch.setenv("FASTPERSIST_BLOCK_SIZE", "1MiB")
    config.reset()
    try:
        assert config.get("block_size") == 1 << 20
    finally:
        monkeypatch.delenv("FASTPERSIST_BLOCK_SIZE")
        config.reset()
    with pytest.raises(ConfigError, match="size like"):
        config.set(block_size="big")


def test_bench_io_sizes_mean_the_same():
    args = bench_io.build_parser().parse_args(["--size", "2G", "--block-size", "16M"])
    assert (args.size, args.block_size) == (2 << 30, 16 << 20)
    with pytest.raises(SystemExit):
        bench_io.build_parser().parse_args(["--size", "2X"])


def test_every_size_option_of_the_benchmarks_uses_the_one_parser():
    import importlib

    from fastpersist.bench import SUBCOMMANDS, harness

    assert harness.size("1.5G") == config.size_argument("1.5G") == 3 << 29
    with pytest.raises(argparse.ArgumentTypeError, match="units are binary"):
        harness.size("lots")
    typed = []
    for name, (module, _) in SUBCOMMANDS.items():
        benchmark = getattr(importlib.import_module(module), "BENCHMARK", None)
        for action in benchmark.parser()._actions if benchmark else ():
            if action.dest.endswith("size") and action.type not in (None, str):  # str: parse_size later
                assert action.type is harness.size, (name, action.dest)
                typed.append(name)
    assert {"io", "aio_handle", "dcp", "gds", "stages", "offload", "pace"} <= set(typed)


@pytest.mark.parametrize("name", ["buffer_size", "read_buffer_size"])
def test_ring_buffer_sizes_are_page_multiples(name):
    assert config.resolve({name: "4M", "block_size": "8M"}).as_dict()[name] == 4 << 20
    assert config.resolve({name: "24M", "block_size": "8M"}).as_dict()[name] == 24 << 20
    with pytest.raises(ConfigError, match=f"{name} must be a positive multiple of 4096"):
        config.resolve({name: 5000})


def test_the_save_ring_fits_the_block_size_and_the_load_ring_need_not():
    """A save's windows are written in whole blocks; a load's windows are any length (the engine cuts them),
    so a block size that does not fit the load ring's default (S3's 5 MiB parts) is accepted."""
    with pytest.raises(ConfigError, match="buffer_size \\(12582912\\) must be a multiple of block_size"):
        config.resolve({"buffer_size": "12M", "block_size": "8M"})
    settings = config.resolve({"buffer_size": "5M", "block_size": "5M"})
    assert (settings.read_buffer_size, settings.block_size) == (16 << 20, 5 << 20)
