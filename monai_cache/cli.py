"""The ``monai-cache`` command line (also ``python -m monai_cache``).

Each subcommand lives in a ``_cmd_<name>`` pair of functions registered in :data:`COMMANDS`: one adds its
options to an ``argparse`` subparser, the other runs it and returns the exit status. To add a command
(``info``, ``verify`` ...), write the two functions and add one :class:`Command` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["COMMANDS", "Command", "build_parser", "epilog_main", "main"]


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


# -- ls / info ----------------------------------------------------------------------------------------------


def _shm_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shm-dir", default=None, help="tmpfs directory of the caches (default $MONAI_CACHE_SHM_DIR or /dev/shm)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _attached_pids(paths: Sequence[str]) -> dict[str, list[int]]:
    """For each cache directory, the processes of this machine that hold its lease file open (best effort).

    Only ``/proc/<pid>/fd`` entries we may read are seen, i.e. this user's processes (all with root).
    """
    leases = {os.path.join(p, "lease"): p for p in paths}
    found: dict[str, set[int]] = {p: set() for p in paths}
    if not leases:
        return {}
    try:
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return {p: [] for p in paths}
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in names:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            owner = leases.get(target)
            if owner is not None:
                found[owner].add(pid)
    return {p: sorted(s) for p, s in found.items()}


def _shm_caches(shm_dir: str | None) -> list[dict[str, Any]]:
    """:func:`monai_cache.shm_directory.list_caches` plus ``processes`` (the pids attached)."""
    from monai_cache.shm_directory import list_caches

    caches = list_caches(shm_dir)
    pids = _attached_pids([c["path"] for c in caches])
    for c in caches:
        c["processes"] = pids.get(c["path"], [])
        c["commands"] = {str(pid): _command_of(pid) for pid in c["processes"]}
    return caches


def _command_of(pid: int, width: int = 60) -> str:
    """Process ``pid``'s command line, shortened to ``width`` characters ("" if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return ""
    return text if len(text) <= width else text[: width - 3] + "..."


def _ls_run(args: argparse.Namespace) -> int:
    from monai_cache.utils import format_bytes, format_table

    try:
        caches = _shm_caches(args.shm_dir)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"monai-cache: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(caches, indent=1))
        return 0
    if not caches:
        print("no monai_cache shared-memory caches")
        return 0
    rows = [["KEY", "STATE", "ENTRIES", "SIZE", "PROCESSES", "HITS", "MISSES", "DISK TIER"]]
    rows += [
        [
            c["key"],
            _state(c),
            str(c["entries"]),
            format_bytes(c["bytes"]),
            str(len(c["processes"])),
            str(c["hits"]),
            str(c["misses"]),
            c["disk_tier"] or "-",
        ]
        for c in caches
    ]
    print(format_table(rows, left=2))
    for c in caches:  # who holds it: a server that keeps one after its training is named here
        if c["processes"]:
            holders = ", ".join(f"{pid} ({c['commands'][str(pid)] or '?'})" for pid in c["processes"])
            print(f"{c['key']} is held by {holders}")
    total = sum(c["bytes"] for c in caches)
    print(f"{len(caches)} cache(s), {format_bytes(total)} in {os.path.dirname(caches[0]['path'])}")
    return 0


def _state(cache: dict[str, Any]) -> str:
    """A cache's state as ``ls`` shows it: a half-removed one names the process that began removing it."""
    if cache["state"] != "half-removed":
        return cache["state"]
    return f"half-removed by pid {cache['remover']} ({'alive' if cache['remover_alive'] else 'dead'})"


def _info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "cache_dir", nargs="?", default=None, help="a PersistentDataset cache_dir; without it: the shared-memory caches"
    )
    _shm_dir_argument(parser)


def _info_run(args: argparse.Namespace) -> int:
    from monai_cache import disk_format
    from monai_cache.utils import format_bytes

    if args.cache_dir is None:
        return _ls_run(args)
    try:
        info = disk_format.summarize(args.cache_dir)
    except (NotADirectoryError, OSError) as e:
        print(f"monai-cache info: {e}", file=sys.stderr)
        return 2
    info["shared_memory_tiers"] = _tiers_in_front_of(args.cache_dir, args.shm_dir)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    versions = ", ".join(f"v{v}: {n}" for v, n in sorted(info["format_versions"].items())) or "-"
    print(f"disk cache      {info['path']}")
    print(
        f"entries         {info['entries']} ({info['compressed']} zstd-compressed; {info['packed']} packed in "
        f"{info['packs']} pack(s))"
    )
    print(f"size            {format_bytes(info['bytes'])} ({format_bytes(info['bytes_on_disk'])} allocated)")
    print(f"encoded items   {format_bytes(info['blob_bytes'])}")
    print(f"compression     {info['compression_ratio']:.2f}x (encoded / file bytes)")
    print(f"format version  {versions} (this version reads v{info['reader_format_version']})")
    print(f"bad headers     {info['bad_headers']}" + ("  (run: monai-cache verify DIR)" if info["bad_headers"] else ""))
    print(f"temp files      {info['temp_files']}")
    print(f"other files     {info['other_files']} (not ours; never opened)")
    print("hits            unknown (counted by the training processes: PersistentDataset.cache_stats())")
    tiers = info["shared_memory_tiers"]
    in_front = ", ".join(f"{c['key']} ({c['state']}, {c['entries']} entries, {format_bytes(c['bytes'])})"
                         for c in tiers)
    print(f"in memory       {in_front or 'no shared-memory cache in front of it'}")
    return 0


def _tiers_in_front_of(cache_dir: str, shm_dir: str | None) -> list[dict[str, Any]]:
    """The shared-memory caches whose disk tier is ``cache_dir``, with the processes attached."""
    from monai_cache.shm_directory import caches_in_front_of

    caches = caches_in_front_of(cache_dir, shm_dir)
    pids = _attached_pids([c["path"] for c in caches])
    for c in caches:
        c["processes"] = pids.get(c["path"], [])
    return caches


# -- clear --------------------------------------------------------------------------------------------------


def _clear_arguments(parser: argparse.ArgumentParser) -> None:
    _shm_dir_argument(parser)
    parser.add_argument(
        "--all",
        action="store_true",
        help="also remove kept (keep_warm) caches and caches in use; processes using them recompute missing entries",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="remove the entries of this disk cache (only monai_cache files, recognised by name and magic number) "
        "and the shared-memory caches in front of it (live ones with --all), instead of the shared-memory caches",
    )


def _clear_run(args: argparse.Namespace) -> int:
    from monai_cache import disk_format
    from monai_cache.shm_directory import remove_cache, remove_half_removed
    from monai_cache.utils import format_bytes

    if args.cache_dir is not None:
        try:
            result = disk_format.clear(args.cache_dir)
        except (NotADirectoryError, OSError) as e:
            print(f"monai-cache clear: {e}", file=sys.stderr)
            return 2
        tiers = _tiers_in_front_of(args.cache_dir, args.shm_dir)
        result["shared_memory_tiers_removed"] = [
            c["key"]
            for c in tiers
            if (args.all or c["state"] != "live") and remove_cache(c["key"], args.shm_dir, args.all)
        ]
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            gone = "; removed the empty directory" if result["removed_dir"] else ""
            in_memory = len(result["shared_memory_tiers_removed"])
            print(
                f"removed {result['removed']} cache file(s), {format_bytes(result['bytes'])} from {result['path']}; "
                f"kept {result['kept']} other file(s){gone}; removed {in_memory} shared-memory cache(s) in front of it"
            )
        return 0
    try:
        caches = _shm_caches(args.shm_dir)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"monai-cache clear: {e}", file=sys.stderr)
        return 2
    removed: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    for c in caches:
        if c["state"] == "half-removed":  # its remover was killed (one at work holds the root lock: waited for)
            done = remove_half_removed(c["key"], args.shm_dir)
        else:  # only directories of this user's monai_cache root that hold our counters file are candidates
            done = c["ours"] and (args.all or c["state"] == "stale") and remove_cache(c["key"], args.shm_dir, args.all)
        (removed if done else kept).append(c)
    if args.json:
        print(json.dumps({"removed": removed, "kept": kept}, indent=1))
        return 0
    freed = sum(c["bytes"] for c in removed)
    halves = sum(c["state"] == "half-removed" for c in removed)
    half_note = f" ({halves} half-removed)" if halves else ""
    hint = "" if args.all else " (live or kept; --all removes them too)"
    print(f"removed {len(removed)} cache(s){half_note}, {format_bytes(freed)}; kept {len(kept)}{hint}")
    return 0


# -- verify -------------------------------------------------------------------------------------------------


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("cache_dir", help="a PersistentDataset cache_dir (and the shared-memory caches in front of it)")
    parser.add_argument(
        "--shm-dir", default=None, help="tmpfs directory of the caches (default $MONAI_CACHE_SHM_DIR or /dev/shm)"
    )
    parser.add_argument("--remove", action="store_true", help="delete the bad entries (they are recomputed on use)")
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="also decode values stored with pickle (only for caches from a trusted source)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _verify_run(args: argparse.Namespace) -> int:
    from monai_cache import disk_format
    from monai_cache.shm_directory import caches_in_front_of, verify

    try:
        result = disk_format.verify(args.cache_dir, remove=args.remove, allow_pickle=args.allow_pickle)
    except (NotADirectoryError, OSError) as e:
        print(f"monai-cache verify: {e}", file=sys.stderr)
        return 2
    tiers = [verify(c["path"], args.allow_pickle) for c in caches_in_front_of(args.cache_dir, args.shm_dir)]
    result["shared_memory_tiers"] = tiers
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for b in result["bad"]:
            print(f"BAD  {b['file']}: {b['error']}" + ("  (removed)" if b["removed"] else ""))
        extra = f" ({result['not_decoded']} with pickled values not decoded)" if result["not_decoded"] else ""
        n_bad = len(result["bad"])
        print(f"{result['checked']} entries checked in {result['path']}: {result['ok']} ok, {n_bad} bad{extra}")
        if result["bad"] and not args.remove:
            print("pass --remove to delete the bad entries (they are recomputed when next used)")
        for tier in tiers:
            for b in tier["bad"]:
                print(f"BAD  {tier['path']} entry {b['entry']}: {b['error']}")
            print(f"{tier['checked']} entries checked in shared memory in front of it, {tier['path']}: "
                  f"{tier['ok']} ok, {len(tier['bad'])} bad (recomputed when next read)")
    return 1 if result["bad"] or any(tier["bad"] for tier in tiers) else 0


# -- plan ---------------------------------------------------------------------------------------------------


PLAN_SECTIONS = ("train#dataset", "validate#dataset")


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config_file", "--config-file", dest="config_file", action="append", required=True,
                        help="the bundle config (repeat for several files, as monai.bundle takes them)")  # fmt: skip
    parser.add_argument("--section", action="append", default=None,
                        help="a dataset's id in the config (repeatable; default: train#dataset and validate#dataset)")
    parser.add_argument("--samples", type=int, default=8, help="items to compute at most (default 8)")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="stop sampling after this long (default 60)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks of the job on one machine (default $LOCAL_WORLD_SIZE, else Slurm's tasks on "
                        "this node, else 1)")
    parser.add_argument("--shm-dir", default=None, help="tmpfs of the cache (default $MONAI_CACHE_SHM_DIR or /dev/shm)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--no-progress", action="store_true", help="do not show which item is being computed")
    parser.epilog = (
        "Other --<id> <value> pairs override the config, as python -m monai.bundle run takes them (e.g. "
        "--train#dataset#cache_rate 0.5). Exit status: 0 if every cache fits, 1 if one does not, 2 on error."
    )


def _overrides(extra: Sequence[str]) -> dict[str, Any]:
    """``--id value`` pairs: values as JSON where they parse (numbers, true, lists), else strings."""
    out: dict[str, Any] = {}
    it = iter(extra)
    for key in it:
        if not key.startswith("--"):
            raise ValueError(f"unexpected argument {key!r}: overrides are --<id> <value>")
        value = next(it, None)
        if value is None:
            raise ValueError(f"{key} has no value")
        try:
            out[key[2:]] = json.loads(value)
        except json.JSONDecodeError:
            out[key[2:]] = value
    return out


def _plan_run(args: argparse.Namespace) -> int:
    from monai_cache.plan import plan_bundle

    try:
        overrides = _overrides(getattr(args, "_extra", []))
        plans = plan_bundle(
            args.config_file,
            sections=args.section or PLAN_SECTIONS,
            overrides=overrides,
            samples=args.samples,
            max_seconds=args.max_seconds,
            shm_dir=args.shm_dir,
            ranks=args.ranks,
            progress=not args.no_progress and not args.json,
        )
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"monai-cache plan: {e}", file=sys.stderr)
        return 2
    if not plans:
        sections = ", ".join(args.section or PLAN_SECTIONS)
        print(f"monai-cache plan: no dataset section found ({sections})", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=1))
    else:
        print("\n\n".join(p.format() for p in plans))
    return 0 if all(p.fit is None or p.fit.fits for p in plans) else 1


# -- top ----------------------------------------------------------------------------------------------------


def _top_arguments(parser: argparse.ArgumentParser) -> None:
    _shm_dir_argument(parser)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (default: until ^C)")


def _top_rows(caches: list[dict[str, Any]], before: dict[str, tuple[float, int]], now: float) -> list[list[str]]:
    """One row per cache; the fill rate from the entries seen at the previous refresh (``before``, updated)."""
    from monai_cache.utils import format_bytes

    rows = [["KEY", "STATE", "FILLED", "SIZE", "HIT RATE", "HITS", "MISSES", "PROCS", "FILL RATE", "TIME LEFT"]]
    for c in caches:
        length = c.get("length")
        filled = f"{c['entries']}/{length}" if length else str(c["entries"])
        reads = c["hits"] + c["misses"]
        rate_text = left = "-"
        seen = before.get(c["key"])
        if seen is not None and now > seen[0]:
            rate = (c["entries"] - seen[1]) / (now - seen[0])
            rate_text = f"{rate:.1f}/s"
            if rate > 0 and length and c["entries"] < length:
                left = f"{(length - c['entries']) / rate:.0f} s"
            elif length and c["entries"] >= length:
                left = "full"
        before[c["key"]] = (now, c["entries"])
        rows.append([
            c["key"], _state(c), filled, format_bytes(c.get("stored", c["bytes"])),
            f"{c['hits'] / reads:.0%}" if reads else "-", str(c["hits"]), str(c["misses"]), str(len(c["processes"])),
            rate_text, left,
        ])  # fmt: skip
    return rows


def _top_run(args: argparse.Namespace) -> int:
    import time

    from monai_cache.utils import format_table

    before: dict[str, tuple[float, int]] = {}
    shown = 0
    try:
        while True:
            try:
                caches = _shm_caches(args.shm_dir)
            except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
                print(f"monai-cache: {e}", file=sys.stderr)
                return 2
            now = time.monotonic()
            rows = _top_rows(caches, before, now)
            if args.json:
                print(json.dumps({"time": time.time(), "caches": caches}), flush=True)
            else:
                screen = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
                title = f"monai-cache top: {len(caches)} cache(s), every {args.interval:g} s (^C to quit)"
                body = format_table(rows) if caches else "no monai_cache shared-memory caches"
                print(f"{screen}{title}\n{body}", flush=True)
            shown += 1
            if args.iterations and shown >= args.iterations:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


# -- epilog -------------------------------------------------------------------------------------------------


def _epilog_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", default=None, help="the Slurm job id (default $SLURM_JOB_ID)")
    parser.add_argument(
        "--shm-dir", default=None, help="tmpfs directory of the caches (default $MONAI_CACHE_SHM_DIR or /dev/shm)"
    )


def _epilog_run(args: argparse.Namespace) -> int:
    """Remove the ended job's shared-memory caches. Always exits 0: a failing Slurm Epilog drains the node."""
    job = args.job or os.environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        print("monai-cache epilog: no Slurm job id (give --job, or run it as Slurm's Epilog)", file=sys.stderr)
        return 0
    try:
        import pwd

        from monai_cache import keeper
        from monai_cache.shm_directory import SLURM_JOB_MARK, cache_root
        from monai_cache.shm_lifetime import reclaim_job

        uid = os.environ.get("SLURM_JOB_UID", "")
        if os.getuid() == 0 and uid.isdigit() and int(uid) != 0:  # Slurm's Epilog runs as root: act as the job's user
            os.setgroups([])
            os.setgid(pwd.getpwuid(int(uid)).pw_gid)
            os.setuid(int(uid))
        root = cache_root(args.shm_dir, create=False)
        lingering: list[str] = []
        removed = reclaim_job(root, job, SLURM_JOB_MARK, lingering) if os.path.isdir(root) else []
        for path in lingering:  # keep_alive: a watcher, outside the job's cgroup, removes it when its window ends
            keeper.watch(path, root)
    except Exception as e:  # never fail the epilog; say why
        print(f"monai-cache epilog: job {job}: {type(e).__name__}: {e}", file=sys.stderr)
        return 0
    if removed:
        print(f"monai-cache epilog: job {job}: removed {len(removed)} cache(s) from {root}: {', '.join(removed)}")
    for path in lingering:
        print(f"monai-cache epilog: job {job}: {os.path.basename(path)} kept for its keep_alive window")
    return 0


def epilog_main() -> int:
    """``monai-cache-epilog``: ``monai-cache epilog`` with no arguments, for ``Epilog=`` and ``TaskEpilog=`` lines of
    slurm.conf and ``srun --task-epilog=``, which take a program's path and no arguments."""
    return main(["epilog"])


# -- run ----------------------------------------------------------------------------------------------------


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run", action="store_true", help="list the classes swapped and the MONAI version; run nothing"
    )
    loader = parser.add_mutually_exclusive_group()
    loader.add_argument(
        "--no-dataloader",
        dest="dataloader",
        action="store_false",
        help="swap the datasets only: monai.data.DataLoader stays MONAI's (by default it becomes monai_cache's "
        "where it gives the same batches)",
    )
    loader.add_argument("--dataloader", action="store_true", help="the default (kept for earlier scripts)")
    parser.set_defaults(dataloader=True)
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")


def _run_run(args: argparse.Namespace) -> int:
    from monai_cache import switch

    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    env = dict(os.environ)
    env[switch.ENV_VAR] = "1" if args.dataloader else switch.DATASETS_ONLY
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != switch.site_dir()]
    env["PYTHONPATH"] = os.pathsep.join([switch.site_dir(), *paths])
    if args.dry_run:
        # turn it on here, as CMD's processes will, and show what it replaced
        was_on = switch.installed()
        switch.install(dataloader=args.dataloader, children=False, announce=False)
        import monai.apps  # patches
        import monai.data  # noqa: F401

        print(switch.describe(args.dataloader))
        for name, (modules, _ours) in switch.swapped_names(args.dataloader).items():
            found = [f"{m}.{name} -> {_qualified(getattr(sys.modules[m], name, None))}" for m in modules]
            print("  " + ", ".join(found))
        if not was_on:
            switch.uninstall()
        print(f"would run: {' '.join(cmd) if cmd else '(no command given)'}")
        print(f"with {switch.ENV_VAR}={env[switch.ENV_VAR]} PYTHONPATH={env['PYTHONPATH']}")
        pth = switch.pth_file()
        if pth is not None:
            print(f"turned on at start-up by {pth}, before any sitecustomize, whatever PYTHONPATH holds")
        else:
            print(
                f"turned on at start-up by the sitecustomize.py on PYTHONPATH only ({switch.PTH} is not in this "
                "interpreter's site-packages: pip install monai_cache puts it there): a sitecustomize that a "
                "launcher puts in front of it, and that does not run the next one, leaves the switch to "
                "usercustomize.py, and off without the user site"
            )
        return 0
    if not cmd:
        print("monai-cache run: give the command after --, e.g. monai-cache run -- python train.py", file=sys.stderr)
        return 2
    try:
        os.execvpe(cmd[0], cmd, env)  # CMD's exit status and signals are its own: nothing stands between
    except OSError as e:
        print(f"monai-cache run: cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
    return 0  # not reached


def _qualified(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


COMMANDS: list[Command] = [
    Command(
        "demo",
        "MONAI vs monai_cache on a small distributed job with synthetic CT (no downloads)",
        _demo_arguments,
        _demo_run,
    ),
    Command("ls", "list this user's shared-memory caches", _shm_dir_argument, _ls_run),
    Command(
        "info",
        "describe a disk cache directory (entries, bytes, compression, format); without one: like ls",
        _info_arguments,
        _info_run,
    ),
    Command(
        "clear",
        "remove stale shared-memory caches (--all: every cache of ours; --cache-dir: a disk cache)",
        _clear_arguments,
        _clear_run,
    ),
    Command(
        "epilog",
        "remove the shared-memory caches of a Slurm job that ended (for Epilog / TaskEpilog / srun --task-epilog)",
        _epilog_arguments,
        _epilog_run,
    ),
    Command(
        "plan",
        "project a bundle's caches (shared memory, disk, time) from a few items, and say what fits on this machine",
        _plan_arguments,
        _plan_run,
    ),
    Command(
        "run",
        "run a command with MONAI's caching datasets swapped for monai_cache's in all its Python processes",
        _run_arguments,
        _run_run,
    ),
    Command(
        "top",
        "watch this user's shared-memory caches fill: entries, bytes, hit rate, processes, fill rate, time left",
        _top_arguments,
        _top_run,
    ),
    Command(
        "verify",
        "check every entry of a disk cache (checksums, decoding); exit status 1 if any is bad",
        _verify_arguments,
        _verify_run,
    ),
]


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of :data:`COMMANDS`.

    Args:
        argv: the arguments about to be parsed. When given, only the command they name gets its options
            set up (``demo``'s options import MONAI, which takes seconds; ``ls`` should not wait for that).
    """
    parser = argparse.ArgumentParser(prog="monai-cache", description="monai_cache: shared-memory caching for MONAI.")
    from monai_cache import __version__

    parser.add_argument("--version", action="version", version=f"monai_cache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = {cmd.name for cmd in COMMANDS}
    selected = None if argv is None else next((a for a in argv if a in names), "")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if selected is None or selected == cmd.name:
            cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``monai-cache`` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    command = next((a for a in argv if a in {cmd.name for cmd in COMMANDS}), "")
    if command == "plan":  # plan passes --<id> <value> pairs on to the bundle config, as monai.bundle run does
        args, extra = parser.parse_known_args(argv)
        args._extra = extra
    else:
        args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
