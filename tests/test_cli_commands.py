"""Every command is one module of fastpersist/cli/, registered by one line."""

from __future__ import annotations

import os

from fastpersist import cli


def test_every_command_is_a_cli_module():
    commands = {name: entry for name, entry in cli.COMMANDS.items() if isinstance(entry, str)}
    assert {"info", "verify", "tune", "bench"} <= set(commands)
    for name, module in commands.items():
        assert module == f"fastpersist.cli.{name}"
        assert os.path.exists(os.path.join(os.path.dirname(cli.__file__), f"{name}.py"))


def test_bench_runs_a_benchmark_with_its_own_options(capsys):
    assert cli.main(["bench", "checkpoint", "--list-models"]) == 0
    assert "llama-3-8b" in capsys.readouterr().out
    assert cli.main(["bench", "report", "--check-docs", "--root", os.path.dirname(os.path.dirname(__file__))]) == 0


def test_tune_has_its_options(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["tune", "--quick", "--dir", "/tmp", "--optimize", "save"])
    assert (args.quick, args.optimize) == (True, "save")
