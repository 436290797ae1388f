"""``python -m fastpersist.bench <subcommand> ...`` dispatcher."""

from __future__ import annotations

import importlib
import sys

from fastpersist.bench import SUBCOMMANDS, listing


def _usage() -> str:
    return (
        "usage: python -m fastpersist.bench <subcommand> [options]\n\n"
        f"subcommands:\n{listing()}\n\n"
        "'python -m fastpersist.bench <subcommand> --help' for its options"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
