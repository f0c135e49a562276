"""Scale benchmark: many small 2-D items, and one very large item, side by side with stock MONAI.

Small items: synthetic 64x64 float32 images (16 KiB each, incompressible), read by 2 ranks x 4 DataLoader
workers (two processes started like torchrun ranks, each with its own DataLoader), for these datasets:

    ours-cache        monai_cache.CacheDataset (one node-wide copy in /dev/shm, eager fill split by the ranks)
    ours-persistent   monai_cache.PersistentDataset (disk)
    monai-cache       monai.data.CacheDataset (eager: each rank fills its own copy)
    monai-processes   monai.data.CacheDataset(runtime_cache="processes") (a Manager ListProxy per rank)
    monai-persistent  monai.data.PersistentDataset (disk)

Each rank builds the dataset and reads it for two epochs; epoch 2 is the warm epoch. Reported: build time,
warm items/s (both ranks together), peak memory (proportional set size of every process of the run,
sampled every 0.25 s, plus the /dev/shm cache itself), descriptors and memory maps per DataLoader worker,
and for ours: storage overhead per 16 KiB entry, attach time of a third process to the filled cache, and
the times of ``monai-cache ls`` and ``monai-cache clear --all``.

Large item: one float32 volume (2 GiB; 256 MiB with --quick) written and read through the shared-memory
store and the disk store (uncompressed and zstd), with the peak RSS (VmHWM, reset between phases) as a
multiple of the item size.

Usage::

    python -m benchmarks scale --quick              # 2,000 / 5,000 / 10,000 items, 256 MiB item: ~2-4 min
    python -m benchmarks scale                      # 10,000 / 50,000 / 100,000 items, 2 GiB item
    python -m benchmarks scale --sizes 100000 --variants ours-cache --large-mb 2048
    python -m benchmarks scale --sizes 100000 --variants ours-cache monai-cache --large-mb 0 --loader package

``--loader`` picks the DataLoader of the small-item runs: torch's for every variant (the default: the datasets
alone are compared), MONAI's for every variant, or each package's own (``package``: ``monai_cache.DataLoader``
for ours, ``monai.data.DataLoader`` for MONAI's: what a user of each package runs).

Writes ``scale.md`` (what was printed), ``scale.json`` (every measurement) and, if matplotlib is installed,
``bench_scale.png`` to ``--out``. ``bench_scale.py --large MODE SIZE_BYTES WHERE`` measures one large item in a
process of its own (:func:`large_item`; ``tests/test_scale.py`` runs it at 256 MiB).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zlib

import harness  # the benchmarks' shared helpers (its neighbour here)

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
# Measure this checkout, whatever `pip install -e` points at; child processes inherit it through PYTHONPATH.
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
VARIANTS = ("ours-cache", "ours-persistent", "monai-cache", "monai-processes", "monai-persistent")
LOADERS = {  # --loader: the DataLoader of the small-item runs
    "torch": "torch's DataLoader for every dataset",
    "monai": "monai.data.DataLoader for every dataset",
    "package": "each package's own DataLoader (monai_cache.DataLoader for ours, monai.data.DataLoader for MONAI's)",
}
ITEM_BYTES = 64 * 64 * 4


# ----------------------------------------------------------------------------------------- helpers
def _make_transform():
    from monai.transforms import Transform

    class MakeImage(Transform):
        def __call__(self, d):
            import torch

            g = torch.Generator().manual_seed(int(d["i"]))
            return {"image": torch.rand(1, 64, 64, generator=g), "i": int(d["i"])}

    MakeImage.__module__ = "__main__"
    MakeImage.__qualname__ = "MakeImage"
    return MakeImage


def _proc_counts() -> tuple[int, int]:
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return fds, maps


def _blocks(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


# ------------------------------------------------------------------------------------------ one rank
def _loader_class(variant: str, loader: str) -> type:
    """The DataLoader class a rank of ``variant`` uses with ``--loader`` ``loader`` (see ``LOADERS``)."""
    if loader == "torch":
        from torch.utils.data import DataLoader

        return DataLoader
    if loader == "package" and variant.startswith("ours"):
        from monai_cache import DataLoader as OurLoader

        return OurLoader
    if loader in ("monai", "package"):
        from monai.data import DataLoader as MonaiLoader

        return MonaiLoader
    raise SystemExit(f"unknown loader {loader}")


def rank_main(variant: str, n: int, workers: int, cache_dir: str, result: str) -> None:
    import torch

    torch.set_num_threads(1)
    MakeImage = _make_transform()
    sys.modules["__main__"].MakeImage = MakeImage  # picklable by reference in both ranks
    data = [{"i": i} for i in range(n)]
    t0 = time.perf_counter()
    if variant == "ours-cache":
        from monai_cache import CacheDataset

        ds = CacheDataset(data, MakeImage(), progress=False, num_workers=1, keep_warm=True)
    elif variant == "ours-persistent":
        from monai_cache import PersistentDataset

        ds = PersistentDataset(data, MakeImage(), cache_dir=cache_dir)
    elif variant == "monai-cache":
        from monai.data import CacheDataset

        ds = CacheDataset(data, MakeImage(), progress=False, num_workers=1)
    elif variant == "monai-processes":
        from monai.data import CacheDataset

        ds = CacheDataset(data, MakeImage(), progress=False, runtime_cache="processes")
    elif variant == "monai-persistent":
        from monai.data import PersistentDataset

        ds = PersistentDataset(data, MakeImage(), cache_dir=cache_dir)
    else:
        raise SystemExit(f"unknown variant {variant}")
    build = time.perf_counter() - t0

    class Probe(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            item = ds[i]
            probe = i % 997 == 0
            fds, maps = _proc_counts() if probe else (-1, -1)
            return {"image": item["image"], "fds": fds, "maps": maps}

    loader_cls = _loader_class(variant, os.environ.get("BENCH_SCALE_LOADER", "torch"))
    epochs, fds, maps = [], 0, 0
    for _epoch in range(2):
        loader = loader_cls(Probe(), batch_size=64, num_workers=workers, shuffle=True)
        t = time.perf_counter()
        seen = 0
        for batch in loader:
            seen += len(batch["image"])
            fds = max(fds, int(batch["fds"].max()))
            maps = max(maps, int(batch["maps"].max()))
        epochs.append(time.perf_counter() - t)
        assert seen == n
    with open(result, "w") as f:
        json.dump({"build": build, "epochs": epochs, "worker_fds": fds, "worker_maps": maps}, f)


# ------------------------------------------------------------------------------------- one variant
def _error_line(stderr: str) -> str:
    """The line of a rank's stderr that names its error (some tracebacks end with a line of dashes)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and set(ln.strip()) - set("-=~^ ")]
    named = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", ln)]
    return (named or lines or [""])[-1]


def run_variant(variant: str, n: int, ranks: int, workers: int, timeout: float, shm_dir: str) -> dict:
    work = tempfile.mkdtemp(prefix="bench-scale-", dir=os.environ.get("BENCH_SCALE_DISK", "/tmp"))
    env = dict(os.environ, MONAI_CACHE_SHM_DIR=shm_dir, PYTHONWARNINGS="ignore")
    cache_dir = os.path.join(work, "cache")
    procs = []
    t0 = time.perf_counter()
    for r in range(ranks):
        res = os.path.join(work, f"rank{r}.json")
        cmd = [sys.executable, HERE, "--rank", variant, str(n), str(workers), cache_dir, res]
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), res))
    sampler = harness.MemorySampler([], None, 0.25).start([p.pid for p, _ in procs])  # PSS of the ranks' trees
    out: dict = {"variant": variant, "n": n}
    errors = []
    for p, _res in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            if p.returncode:
                errors.append([_error_line(err.decode(errors="replace")) or f"exit {p.returncode}"])
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            errors.append([f"timed out after {timeout:.0f} s"])
    out["wall"] = time.perf_counter() - t0
    sampler.stop()
    out["peak_pss"] = sampler.summary()["mem_peak"] or 0
    if errors:
        out["error"] = errors[0][0]
    else:
        ranks_out = [json.load(open(res)) for _, res in procs]
        out["build"] = max(r["build"] for r in ranks_out)
        warm = max(r["epochs"][-1] for r in ranks_out)
        out["epoch1"] = max(r["epochs"][0] for r in ranks_out)
        out["warm_items_s"] = ranks * n / warm
        out["worker_fds"] = max(r["worker_fds"] for r in ranks_out)
        out["worker_maps"] = max(r["worker_maps"] for r in ranks_out)
    if variant == "ours-cache" and not errors:
        out.update(_ours_cache_extras(n, shm_dir, workers, timeout))
    if variant in ("ours-persistent", "monai-persistent") and os.path.isdir(cache_dir):
        files = [e for e in os.scandir(cache_dir) if e.is_file()]
        out["disk_files"] = len(files)
        out["disk_bytes"] = _blocks(cache_dir)
        out["disk_overhead"] = out["disk_bytes"] / (n * ITEM_BYTES) - 1
    if variant == "ours-cache":
        out["memory"] = out["peak_pss"] + out.get("shm_bytes", 0)
    else:
        out["memory"] = out["peak_pss"]
    shutil.rmtree(work, ignore_errors=True)
    return out


def _ours_cache_extras(n: int, shm_dir: str, workers: int, timeout: float) -> dict:
    from monai_cache.shm import cache_root, list_caches

    extras: dict = {}
    caches = list_caches(shm_dir)
    if not caches:
        return extras
    c = caches[0]
    extras["shm_bytes"] = _blocks(c["path"])
    extras["shm_overhead"] = extras["shm_bytes"] / (n * ITEM_BYTES) - 1
    extras["shm_files"] = len(os.listdir(c["path"]))
    env = dict(os.environ, MONAI_CACHE_SHM_DIR=shm_dir, PYTHONWARNINGS="ignore")
    # a third process attaching to the filled cache: interpreter + imports, then the dataset itself
    code = (
        "import sys, time, json; sys.argv=['x']; t0=time.perf_counter();"
        f"sys.path.insert(0, {os.path.dirname(HERE)!r}); import bench_scale as b; MakeImage=b._make_transform();"
        "import __main__; __main__.MakeImage=MakeImage; from monai_cache import CacheDataset; t1=time.perf_counter();"
        f"ds=CacheDataset([{{'i': i}} for i in range({n})], MakeImage(), progress=False);"
        "t2=time.perf_counter(); print(json.dumps({'imports': t1-t0, 'attach': t2-t1,"
        " 'misses': ds.cache_stats()['process']['misses']}))"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode == 0:
        a = json.loads(r.stdout.strip().splitlines()[-1])
        extras["attach_s"], extras["attach_imports_s"], extras["attach_misses"] = a["attach"], a["imports"], a["misses"]
    cli = [sys.executable, "-m", "monai_cache"]
    t = time.perf_counter()
    subprocess.run([*cli, "ls"], env=env, capture_output=True, timeout=timeout)
    extras["ls_s"] = time.perf_counter() - t
    # the same work without the interpreter start and imports: ls (list + attached processes), then clear --all
    code = (
        "import time, json; from monai_cache import cli; from monai_cache.shm import remove_cache;"
        "t0=time.perf_counter(); cs=cli._shm_caches(None); t1=time.perf_counter();"
        "[remove_cache(c['key'], force=True) for c in cs]; t2=time.perf_counter();"
        "print(json.dumps({'ls': t1-t0, 'clear': t2-t1}))"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode == 0:
        a = json.loads(r.stdout.strip().splitlines()[-1])
        extras["ls_core_s"], extras["clear_core_s"] = a["ls"], a["clear"]
    t = time.perf_counter()
    subprocess.run([*cli, "clear", "--all"], env=env, capture_output=True, timeout=timeout)
    extras["clear_s"] = time.perf_counter() - t  # nothing left to remove: interpreter start and imports
    extras["left_after_clear"] = len(os.listdir(cache_root(shm_dir, create=False))) if os.path.isdir(
        cache_root(shm_dir, create=False)) else 0
    return extras


# ------------------------------------------------------------------------------------- large item
LARGE_MODES = ("shm", "raw", "zstd", "zstd-downcast")


def _rss() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (the peak since the last reset) of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def large_item(mode: str, size: int, where: str) -> dict:
    """Peak memory and time of storing one large item and reading it back, in this process (a fresh one: the
    launcher runs ``bench_scale.py --large MODE SIZE_BYTES WHERE``, as ``tests/test_scale.py`` does at 256 MiB).

    ``mode``: ``shm`` (a ``SharedMemoryStore`` in the tmpfs directory ``where``), ``raw`` (a ``DiskStore`` in
    ``where`` without compression), ``zstd`` (compressed) or ``zstd-downcast`` (compressed, with lossless
    downcasting of an integral float32 volume, as CT intensities are: the check passes and an int16 copy is
    stored). The other modes store a random float32 tensor, which nothing downcasts.

    Returns ``mode``, ``write_x`` and ``read_x`` (growth of the peak RSS over the RSS before the item was made,
    while writing and while reading, as multiples of the item's size: the item itself counts 1), ``write_s`` and
    ``read_s`` (seconds), and ``same`` (the item read back holds the bytes written). Linux only (``/proc``).
    """
    import torch

    from monai_cache.disk import DiskStore
    from monai_cache.shm import SharedMemoryStore

    if mode not in LARGE_MODES:
        raise SystemExit(f"mode must be one of {', '.join(LARGE_MODES)}, got {mode!r}")
    torch.set_num_threads(1)
    gc.collect()
    base = _rss()["VmRSS"]
    g = torch.Generator().manual_seed(0)
    if mode == "zstd-downcast":
        item = {"image": torch.randint(-1000, 3000, (size // 4,), generator=g, dtype=torch.int32).float()}
    else:
        item = {"image": torch.rand(size // 4, generator=g)}
    crc = zlib.crc32(item["image"].numpy())
    gc.collect()
    _reset_peak()  # from here on: the item, and what storing it adds (not the temporaries that made it)
    t = time.perf_counter()
    if mode == "shm":
        store: SharedMemoryStore | DiskStore = SharedMemoryStore("large", 1, shm_dir=where)
        store[0] = item
    else:
        store = DiskStore(where, compression=None if mode == "raw" else "zstd", downcast=mode == "zstd-downcast",
                          max_pending_bytes=size // 2)
        store.put("large", item)
        if not store.flush(600):
            raise SystemExit("the write did not finish within 600 s")
    write_s = time.perf_counter() - t
    write_peak = _rss()["VmHWM"] - base
    del item
    gc.collect()
    _reset_peak()
    base = _rss()["VmRSS"]
    t = time.perf_counter()
    got = store[0] if isinstance(store, SharedMemoryStore) else store.get("large")
    read_s = time.perf_counter() - t
    same = zlib.crc32(got["image"].numpy()) == crc
    read_peak = _rss()["VmHWM"] - base
    return {"mode": mode, "write_x": write_peak / size, "read_x": read_peak / size, "write_s": write_s,
            "read_s": read_s, "same": same}


def run_large(size_mb: int, shm_dir: str) -> list[dict]:
    """:func:`large_item` in each mode, each in a fresh process (so that its peak RSS is its own)."""
    out = []
    size = size_mb << 20
    for mode in LARGE_MODES:
        where = shm_dir if mode == "shm" else tempfile.mkdtemp(prefix="bench-large-",
                                                              dir=os.environ.get("BENCH_SCALE_DISK", "/tmp"))
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        r = subprocess.run([sys.executable, HERE, "--large", mode, str(size), where],
                           env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode == 0:
            row = json.loads(r.stdout.strip().splitlines()[-1])
        else:
            row = {"mode": mode, "error": (r.stderr.strip().splitlines() or ["?"])[-1]}
        row["size_mb"] = size_mb
        out.append(row)
        print(f"  large {size_mb} MiB {mode}: {row}", file=sys.stderr, flush=True)
        if mode != "shm":
            shutil.rmtree(where, ignore_errors=True)
    return out


def budget_check(shm_dir: str) -> dict:
    """A budget smaller than one item: skipped with one warning, the item still returned."""
    code = r"""
import warnings, torch, json
from monai_cache.shm import SharedMemoryStore
s = SharedMemoryStore("budget", 2, budget=1 << 20)
x = {"image": torch.rand(1 << 20)}
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    v = s.get_or_compute(0, lambda: x); v2 = s.get_or_compute(1, lambda: x)
full = [m for m in w if "is full" in str(m.message)]
print(json.dumps({"warnings": len(full), "returned": bool(torch.equal(v["image"], x["image"])),
                  "entries": s.stats()["stored"]["entries"]}))
s.release()
"""
    env = dict(os.environ, MONAI_CACHE_SHM_DIR=shm_dir, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-300:]}


# ------------------------------------------------------------------------------------------ report
MAX_OVERHEAD = 0.10  # per 16 KiB entry, shared memory and disk
MAX_SECONDS = 1.0  # attach to a filled cache, list it, clear it
MAX_LARGE_X = 2.1  # peak RSS / item size of a large item: the item and at most one copy (and a little slack)
MAX_MAP_COUNT = 65530  # vm.max_map_count's default


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def report(rows: list[dict], large: list[dict], budget: dict, out_dir: str, rep: harness.Report) -> None:
    loader = LOADERS[os.environ.get("BENCH_SCALE_LOADER", "torch")]
    rep.heading("Small items")
    table = [["dataset", "items", "build s", "warm items/s", "peak memory", "worker fds", "worker maps"]]
    notes = []
    for r in rows:
        if "error" in r:
            what = r["error"] if r["error"].startswith("timed out") else f"fails: {r['error'][:90]}"
            table.append([r["variant"], f"{r['n']:,}", "", "", _fmt_bytes(r["memory"]), "", ""])
            notes.append(f"{r['variant']}, {r['n']:,} items: {what}")
            continue
        table.append([r["variant"], f"{r['n']:,}", f"{r['build']:.1f}", f"{r['warm_items_s']:,.0f}",
                      _fmt_bytes(r["memory"]), str(r["worker_fds"]), str(r["worker_maps"])])
        note = []
        if "shm_overhead" in r:
            note.append(f"shm overhead {r['shm_overhead']:.1%} ({r['shm_files']} files)")
        if "disk_overhead" in r:
            note.append(f"disk overhead {r['disk_overhead']:.1%} ({r['disk_files']:,} files)")
        if "attach_s" in r:
            ls_s, clear_s = r.get("ls_core_s", float("nan")), r.get("clear_core_s", float("nan"))
            note.append(f"attach {r['attach_s']:.2f} s (+{r['attach_imports_s']:.1f} s imports); "
                        f"ls {ls_s:.3f} s, clear {clear_s:.3f} s (`monai-cache ls` {r['ls_s']:.1f} s with imports)")
        if note:
            notes.append(f"{r['variant']}, {r['n']:,} items: {'; '.join(note)}")
    rep.table(table, left=2)
    rep.line("\n".join(notes))
    rep.line(f"Read with {loader}. Peak memory: PSS of every process of the run, plus the shared-memory cache for "
             "ours-cache.")
    rep.heading("Ours against MONAI")
    table = [["items", "vs", "warm items/s (ours / MONAI)", "memory (MONAI / ours)"]]
    by = {(r["variant"], r["n"]): r for r in rows}
    for n in sorted({r["n"] for r in rows}):
        for ours, theirs in (("ours-cache", "monai-cache"), ("ours-cache", "monai-processes"),
                             ("ours-persistent", "monai-persistent")):
            a, b = by.get((ours, n)), by.get((theirs, n))
            if not a or not b or "error" in a:
                continue
            if "error" in b:
                table.append([f"{n:,}", f"{ours} vs {theirs}", f"MONAI: {b['error'][:40]}", ""])
                continue
            table.append([f"{n:,}", f"{ours} vs {theirs}", f"{a['warm_items_s'] / b['warm_items_s']:.2f}",
                          f"{b['memory'] / a['memory']:.2f}"])
    if len(table) > 1:
        rep.table(table, left=2)
    if large:
        rep.heading("A large item")
        table = [["large item", "write: peak RSS / size", "read: peak RSS / size", "write s", "read s"]]
        for r in large:
            name = f"{r['size_mb']} MiB {r['mode']}"
            if "error" in r:
                table.append([name, f"fails: {r['error'][:80]}", "", "", ""])
            else:
                table.append([name, f"{r['write_x']:.2f}", f"{r['read_x']:.2f}", f"{r['write_s']:.1f}",
                              f"{r['read_s']:.1f}"])
        rep.table(table)
    rep.heading("Targets")
    rep.targets(targets(rows, large, budget))
    _plot(rows, out_dir)


def targets(rows: list[dict], large: list[dict], budget: dict) -> list[tuple[bool, str]]:
    """The targets of docs/scale.md, from the measurements of this run."""
    checks: list[tuple[bool, str]] = []
    ok = [r for r in rows if "error" not in r]
    ours = [r for r in ok if r["variant"] == "ours-cache"]
    if ours:
        top = max(ours, key=lambda r: r["n"])
        checks.append((all(r["worker_fds"] < r["n"] / 10 for r in ours),
                       f"no descriptor per cached item (shm): {top['n']:,} items, {top.get('shm_files', '?')} files in "
                       f"the cache, at most {top['worker_fds']} descriptors in a DataLoader worker"))  # fmt: skip
        monai_maps = {r["n"]: r["worker_maps"] for r in ok if r["variant"] == "monai-cache"}
        maps = [r["worker_maps"] for r in ours]
        checks.append((max(maps) < MAX_MAP_COUNT // 10 and all(
            r["worker_maps"] <= 1.1 * monai_maps.get(r["n"], r["worker_maps"]) for r in ours),
            f"maps per DataLoader worker bounded, far below vm.max_map_count {MAX_MAP_COUNT:,} and within 1.1x "
            f"MONAI's: {min(maps)}-{max(maps)} (MONAI's CacheDataset: "
            f"{min(monai_maps.values(), default=0)}-{max(monai_maps.values(), default=0)})"))  # fmt: skip
        over = [r["shm_overhead"] for r in ours if "shm_overhead" in r]
        if over:
            checks.append((max(over) <= MAX_OVERHEAD, f"overhead per 16 KiB entry <= {MAX_OVERHEAD:.0%}, shared "
                           f"memory: {min(over):.1%}-{max(over):.1%}"))  # fmt: skip
        for key, what in (("attach_s", "attach to a filled cache"), ("ls_core_s", "`monai-cache ls` (listing)"),
                          ("clear_core_s", "`monai-cache clear` (removing)")):
            if key in top:
                checks.append((top[key] < MAX_SECONDS, f"{what} < {MAX_SECONDS:.0f} s: {top[key]:.3f} s at "
                               f"{top['n']:,} items"))  # fmt: skip
    disk = [r for r in ok if r["variant"] == "ours-persistent" and "disk_overhead" in r]
    if disk:
        over = [r["disk_overhead"] for r in disk]
        checks.append((max(over) <= MAX_OVERHEAD, f"overhead per 16 KiB entry <= {MAX_OVERHEAD:.0%}, disk: "
                       f"{min(over):.1%}-{max(over):.1%}"))  # fmt: skip
        files = {r["n"]: r["disk_files"] for r in disk}
        checks.append((max(files.values()) < min(files) / 100, "no file per small item on disk (packed): "
                       + ", ".join(f"{f:,} files at {n:,} items" for n, f in sorted(files.items()))))  # fmt: skip
    for r in large:
        name = f"{r['size_mb']} MiB {r['mode']}"
        if "error" in r:
            checks.append((False, f"large item {name}: fails: {r['error'][:80]}"))
        else:
            worst = max(r["write_x"], r["read_x"])
            checks.append((worst <= MAX_LARGE_X and r["same"], f"large item {name}: peak RSS at most the item and "
                           f"one copy: {r['write_x']:.2f}x writing, {r['read_x']:.2f}x reading"))  # fmt: skip
    if budget:
        held = budget.get("warnings") == 1 and budget.get("returned") and budget.get("entries") == 0
        checks.append((bool(held), f"a budget smaller than one item: skipped, one warning, item returned: {budget}"))
    return checks


def _plot(rows: list[dict], out_dir: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for v in VARIANTS:
        pts = sorted((r["n"], r) for r in rows if r["variant"] == v and "error" not in r)
        if not pts:
            continue
        ns = [p[0] for p in pts]
        axes[0].plot(ns, [1e6 / p[1]["warm_items_s"] for p in pts], "o-", label=v)
        axes[1].plot(ns, [p[1]["memory"] / 2**30 for p in pts], "o-", label=v)
    axes[0].set(xlabel="items", ylabel="µs per item (warm epoch, 2 ranks x 4 workers)", xscale="log")
    axes[1].set(xlabel="items", ylabel="peak memory, GiB", xscale="log")
    axes[0].legend(fontsize=8)
    fig.suptitle("64x64 float32 items: cost as the item count grows (2 shared CPU cores)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench_scale.png"), dpi=100)
    print(f"wrote {os.path.join(out_dir, 'bench_scale.png')}", file=sys.stderr)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _, _, variant, n, workers, cache_dir, result = sys.argv
        rank_main(variant, int(n), int(workers), cache_dir, result)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--large":  # one large item, in a process of its own
        _, _, mode, size, where = sys.argv
        print(json.dumps(large_item(mode, int(size), where)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2,000/5,000/10,000 items and a 256 MiB item")
    p.add_argument("--sizes", type=int, nargs="+")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--large-mb", type=int, help="size of the large item in MiB (0: skip)")
    p.add_argument("--timeout", type=float, help="seconds per variant and size")
    p.add_argument("--loader", choices=tuple(LOADERS), default="torch",
                   help="the DataLoader of the small-item runs: " + "; ".join(f"{k}: {v}" for k, v in LOADERS.items()))
    p.add_argument("--out", default=".", help="write scale.md (what was printed), scale.json and bench_scale.png here")
    args = p.parse_args()
    os.environ["BENCH_SCALE_LOADER"] = args.loader  # read by the ranks
    sizes = args.sizes or ([2000, 5000, 10000] if args.quick else [10000, 50000, 100000])
    large_mb = args.large_mb if args.large_mb is not None else (256 if args.quick else 2048)
    timeout = args.timeout or (120 if args.quick else 1200)
    rep = harness.Report("scale")
    machine = harness.machine_info()
    rep.machine(machine)
    rep.line(f"{args.ranks} ranks x {args.workers} DataLoader workers; {', '.join(f'{n:,}' for n in sizes)} items of "
             f"64x64 float32 (16 KiB); " + (f"a {large_mb} MiB item" if large_mb else "no large item"))
    shm_dir = f"/dev/shm/bench-scale-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm_dir)
    rows = []
    t0 = time.perf_counter()
    try:
        for n in sizes:
            for v in args.variants:
                r = run_variant(v, n, args.ranks, args.workers, timeout, shm_dir)
                print(f"{v} n={n}: " + json.dumps({k: (round(x, 4) if isinstance(x, float) else x)
                                                 for k, x in r.items()}), file=sys.stderr, flush=True)
                rows.append(r)
        large = run_large(large_mb, shm_dir) if large_mb else []
        budget = budget_check(shm_dir)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    report(rows, large, budget, args.out, rep)
    seconds = time.perf_counter() - t0
    machine["loadavg_end"] = list(os.getloadavg())
    rep.line(f"{seconds:.0f} s in all; load average at the end {machine['loadavg_end'][0]:.1f}.")
    rep.save(args.out, {"rows": rows, "large": large, "budget": budget, "seconds": seconds, "machine": machine})


if __name__ == "__main__":
    main()
