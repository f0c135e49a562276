"""Handlers for MONAI's ignite workflows (``monai.engines``, bundles): the cache in the training logs.

``{"_target_": "monai_cache.handlers.CacheStatsHandler", "dataset": "@train#dataset", "log_dir": "@output_dir"}``
in a bundle's ``train#handlers`` logs the cache's counters at the end of every epoch, and writes them to
TensorBoard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CacheStatsHandler", "cache_summary"]


def cache_summary(stats: Mapping[str, Any]) -> dict[str, float]:
    """The numbers worth plotting from a dataset's ``cache_stats()``: ``entries`` and ``bytes`` stored; ``hits``,
    ``misses`` and ``hit_rate`` of every process using the cache (``total``); ``skipped`` entries (no room, or items
    the codec cannot store); and, for two tiers, ``disk_hits`` and ``disk_misses``; for items kept in this process
    (``process_cache``), ``process_hits``."""
    total, stored = stats["total"], stats["stored"]
    reads = total["hits"] + total["misses"]
    out = {
        "entries": float(stored["entries"]),
        "bytes": float(stored["bytes"]),
        "hits": float(total["hits"]),
        "misses": float(total["misses"]),
        "hit_rate": total["hits"] / reads if reads else 0.0,
        "skipped": float(total["skipped"]),
    }
    disk = stats.get("disk")
    if disk is not None:
        out["disk_hits"] = float(disk["total"]["hits"])
        out["disk_misses"] = float(disk["total"]["misses"])
    kept = stats.get("process_cache")
    if kept is not None:
        out["process_hits"] = float(kept["hits"])
    return out


class CacheStatsHandler:
    """Records a monai_cache dataset's ``cache_stats()`` at the end of every epoch (or every ``interval``
    iterations): in the log, in ``engine.state.cache_stats``, and in TensorBoard.

    Use it as MONAI's ``StatsHandler`` and ``TensorBoardStatsHandler``: ``CacheStatsHandler(dataset).attach(engine)``,
    or in a bundle's handlers list. The numbers are :func:`cache_summary`'s: entries and bytes stored, hits, misses
    and hit rate of all the processes using the cache (its DataLoader workers, the other ranks of the machine), the
    entries skipped for want of room, and the disk tier's hits and misses.

    Args:
        dataset: a dataset of monai_cache (``CacheDataset``, ``SmartCacheDataset``, ``PersistentDataset``, ...), or
            anything with a ``cache_stats()`` method.
        summary_writer: a TensorBoard ``SummaryWriter`` (or any object with ``add_scalar``) to write to.
        log_dir: where to make a ``torch.utils.tensorboard.SummaryWriter`` when ``summary_writer`` is None (needs the
            ``tensorboard`` package); None: no TensorBoard.
        tag_name: prefix of the logged names and TensorBoard tags (``cache/hit_rate``, ...).
        interval: also record every ``interval`` iterations (0: at the end of each epoch only).
        name: the logger's name; it is set up as MONAI's ``StatsHandler`` sets up its own (``monai.apps.get_logger``:
            INFO to standard output, unless that logger exists already). None: the root logger.
        global_step_transform: the TensorBoard step of an engine (default: the epoch, or the iteration for
            ``interval`` records).
    """

    def __init__(
        self,
        dataset: Any,
        summary_writer: Any | None = None,
        log_dir: str | None = None,
        tag_name: str = "cache",
        interval: int = 0,
        name: str | None = "monai_cache.CacheStatsHandler",
        global_step_transform: Callable[[Any], int] | None = None,
    ) -> None:
        if not callable(getattr(dataset, "cache_stats", None)):
            raise TypeError(f"CacheStatsHandler needs a dataset of monai_cache (with cache_stats()), got {dataset!r}")
        self.dataset = dataset
        if summary_writer is None and log_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "CacheStatsHandler(log_dir=...) writes to TensorBoard, which needs the 'tensorboard' package: "
                    "pip install tensorboard (or pass summary_writer=)"
                ) from e
            summary_writer = SummaryWriter(log_dir=log_dir)
        self.summary_writer = summary_writer
        self.tag_name = tag_name
        self.interval = int(interval)
        # MONAI's StatsHandler's logger: INFO to standard output unless it was set up already
        from monai.apps import get_logger

        self.logger = get_logger(name) if name is not None else logging.getLogger()
        self.global_step_transform = global_step_transform

    def attach(self, engine: Any) -> None:
        """Register this handler on an ignite ``Engine`` (MONAI's trainers and evaluators are ones)."""
        from ignite.engine import Events

        if not engine.has_event_handler(self, Events.EPOCH_COMPLETED):
            engine.add_event_handler(Events.EPOCH_COMPLETED, self)
        if self.interval > 0:
            engine.add_event_handler(Events.ITERATION_COMPLETED(every=self.interval), self.record, "iteration")

    def __call__(self, engine: Any) -> None:
        self.record(engine, "epoch")

    def record(self, engine: Any, level: str = "epoch") -> dict[str, float]:
        """Read the counters now, log them, keep them in ``engine.state.cache_stats`` and write them to TensorBoard.

        Args:
            engine: the ignite engine.
            level: ``"epoch"`` or ``"iteration"``: what the log line and the default TensorBoard step count.

        Returns:
            the numbers recorded (:func:`cache_summary`).
        """
        summary = cache_summary(self.dataset.cache_stats())
        state = engine.state
        state.cache_stats = summary
        if self.global_step_transform is not None:
            step = int(self.global_step_transform(engine))
        else:
            step = int(state.epoch if level == "epoch" else state.iteration)
        self.logger.info(
            f"{level} {step} {self.tag_name}: " + ", ".join(
                f"{k} {v:.3f}" if k == "hit_rate" else f"{k} {v:.0f}" for k, v in summary.items()
            )
        )
        if self.summary_writer is not None:
            for key, value in summary.items():
                self.summary_writer.add_scalar(f"{self.tag_name}/{key}", value, step)
            flush = getattr(self.summary_writer, "flush", None)
            if callable(flush):
                flush()
        return summary
