"""The ``monai-cache`` command line (also ``python -m monai_cache``).

Each subcommand lives in a ``_cmd_<name>`` pair of functions registered in :data:`COMMANDS`: one adds its
options to an ``argparse`` subparser, the other runs it and returns the exit status. To add a command
(``bench``, ``info``, ``verify`` ...), write the two functions and add one :class:`Command` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["COMMANDS", "Command", "build_parser", "main"]


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: its name, one-line help, and how to set it up and run it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- demo ---------------------------------------------------------------------------------------------------


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from monai_cache import demo

    demo.add_arguments(parser)


def _demo_run(args: argparse.Namespace) -> int:
    from monai_cache import demo

    return demo.run(args)


# -- ls -----------------------------------------------------------------------------------------------------


def _shm_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shm-dir", default=None, help="tmpfs directory of the caches (default $MONAI_CACHE_SHM_DIR or /dev/shm)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _ls_run(args: argparse.Namespace) -> int:
    from monai_cache.shm import list_caches
    from monai_cache.utils import format_bytes

    caches = list_caches(args.shm_dir)
    if args.json:
        print(json.dumps(caches, indent=1))
        return 0
    if not caches:
        print("no monai_cache shared-memory caches")
        return 0
    rows = [["KEY", "STATE", "ENTRIES", "SIZE", "HITS", "MISSES"]]
    rows += [
        [c["key"], c["state"], str(c["entries"]), format_bytes(c["bytes"]), str(c["hits"]), str(c["misses"])]
        for c in caches
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    total = sum(c["bytes"] for c in caches)
    print(f"{len(caches)} cache(s), {format_bytes(total)} in {caches[0]['path'].rsplit('/', 1)[0]}")
    return 0


# -- clear --------------------------------------------------------------------------------------------------


def _clear_arguments(parser: argparse.ArgumentParser) -> None:
    _shm_dir_argument(parser)
    parser.add_argument(
        "--all",
        action="store_true",
        help="also remove kept (keep_warm) caches and caches in use; processes using them recompute missing entries",
    )


def _clear_run(args: argparse.Namespace) -> int:
    from monai_cache.shm import list_caches, remove_cache

    removed: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    for c in list_caches(args.shm_dir):
        # Only entries of this user's monai_cache root are listed; nothing else in shm_dir is touched.
        if args.all or c["state"] == "stale":
            if remove_cache(c["key"], args.shm_dir, force=args.all):
                removed.append(c)
                continue
        kept.append(c)
    if args.json:
        print(json.dumps({"removed": removed, "kept": kept}, indent=1))
        return 0
    freed = sum(c["bytes"] for c in removed)
    print(f"removed {len(removed)} cache(s), {freed / (1 << 20):.1f} MiB; kept {len(kept)} (live or kept; use --all)")
    return 0


COMMANDS: list[Command] = [
    Command(
        "demo",
        "MONAI vs monai_cache on a small distributed job with synthetic CT (no downloads)",
        _demo_arguments,
        _demo_run,
    ),
    Command("ls", "list this user's shared-memory caches", _shm_dir_argument, _ls_run),
    Command("clear", "remove stale shared-memory caches (--all: every cache of ours)", _clear_arguments, _clear_run),
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="monai-cache", description="monai_cache: shared-memory caching for MONAI.")
    from monai_cache import __version__

    parser.add_argument("--version", action="version", version=f"monai_cache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``monai-cache`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
