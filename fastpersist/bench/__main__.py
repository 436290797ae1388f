"""``python -m fastpersist.bench <subcommand> ...`` dispatcher."""

from __future__ import annotations

import importlib
import sys

from fastpersist.bench import SUBCOMMANDS, listing


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        f"usage: python -m fastpersist.bench <subcommand> [options]\n\nsubcommands:\n{listing()}\n\n"
        "'python -m fastpersist.bench <subcommand> --help' for its options"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    if argv[0] not in SUBCOMMANDS:
        print(f"unknown benchmark {argv[0]!r}\n\n{usage}", file=sys.stderr)
        return 2
    return int(importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
