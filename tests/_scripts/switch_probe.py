"""Called by a MONAI bundle run under ``monai-cache run`` (tests/test_switch.py): reports, as one JSON line, what the
switch did in the bundle's process, in a spawned DataLoader worker, in a plain child process and a worker forked from
it, and to ``monai-cache top``; then exits with status 3 (``run`` must pass it through)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys


def in_worker(item: object) -> dict:
    """A transform: what a spawned DataLoader worker sees."""
    import monai.apps
    import monai.data

    return {
        "worker_dataset": monai.data.CacheDataset.__module__,
        "worker_apps": monai.apps.MedNISTDataset.__module__,
        "worker_switch": os.environ.get("MONAI_CACHE_SWITCH", ""),
        "worker_chained": os.environ.get("SWITCH_PROBE_CHAINED", ""),
        "worker_pid": os.getpid(),
    }


def forked_worker(queue) -> None:
    """A worker forked from a process that had not imported MONAI: it imports MONAI itself, with the switch on."""
    import monai.data

    queue.put({"forked_dataset": monai.data.CacheDataset.__module__, "forked_pid": os.getpid()})


def plain_child() -> None:
    """A child that never imports MONAI (the switch waits for it, importing neither torch nor MONAI); then a worker
    it forks imports MONAI. Prints its facts as JSON; its stderr, and the worker's, are the bundle's."""
    facts: dict = {"child_modules": sorted(m for m in ("torch", "monai", "monai_cache.switch") if m in sys.modules)}
    context = multiprocessing.get_context("fork")
    queue = context.SimpleQueue()
    worker = context.Process(target=forked_worker, args=(queue,))
    worker.start()
    facts.update(queue.get())
    worker.join()
    facts["forked_exitcode"] = worker.exitcode
    print(json.dumps(facts), flush=True)


def report(dataset, persistent, loader=None) -> None:
    import monai.data
    from batch_digest import batch_digest, takes_block_path

    # started first: its worker's import of MONAI runs beside the spawned worker's
    child = subprocess.Popen(
        [sys.executable, "-c", "import switch_probe; switch_probe.plain_child()"], stdout=subprocess.PIPE, text=True
    )
    facts: dict = {
        "dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
        "persistent": f"{type(persistent).__module__}.{type(persistent).__qualname__}",
        "entries": dataset.cache_stats()["stored"]["entries"],
        "persistent_items": [sorted(persistent[i]) for i in range(len(persistent))],
        "chained": os.environ.get("SWITCH_PROBE_CHAINED", ""),
        "pid": os.getpid(),
    }
    if loader is not None:  # the bundle's own DataLoader, by its short name
        batches = list(loader)
        facts["loader"] = f"{type(loader).__module__}.{type(loader).__qualname__}"
        facts["digests"] = [batch_digest(b) for b in batches]
        facts["blocks"] = [takes_block_path(b) for b in batches]
    loader = monai.data.DataLoader(
        monai.data.Dataset([0], transform=in_worker), batch_size=1, num_workers=1, multiprocessing_context="spawn"
    )
    for batch in loader:
        facts.update({k: v[0] if isinstance(v, list) else int(v) for k, v in batch.items()})
    top = subprocess.run(
        [sys.executable, "-m", "monai_cache", "top", "--iterations", "1", "--json"], capture_output=True, text=True
    )
    facts["top"] = [c["entries"] for c in json.loads(top.stdout)["caches"]]
    facts.update(json.loads(child.communicate()[0]))
    print("SWITCH_PROBE " + json.dumps(facts), flush=True)
    dataset.release()
    sys.exit(3)
