"""Whether a cache fits, and the settings that give it room: shared by ``monai-cache plan``, the early warning of a
cache that will not fit, and the warning of one that is full.

Pure arithmetic on :class:`monai_cache.memory_limits.MachineMemory`; imports neither torch nor MONAI.
"""

from __future__ import annotations

import math
import os

from monai_cache.launcher import launch_view
from monai_cache.memory_limits import MachineMemory, memory_reserve
from monai_cache.utils import format_bytes

__all__ = ["Fit", "advice", "docker_size", "fit", "kubernetes_size", "local_ranks", "projected_bytes"]

_GIB = 1 << 30


def projected_bytes(entries: int, nbytes: int, length: int) -> int:
    """The bytes of ``length`` entries, projected from ``entries`` stored taking ``nbytes``."""
    return 0 if entries <= 0 else math.ceil(nbytes / entries * length)


def local_ranks() -> int:
    """How many ranks of this job run on this machine: all of them share one copy of the cache. torchrun's
    ``LOCAL_WORLD_SIZE``, else Slurm's tasks on this node (``SLURM_TASKS_PER_NODE`` and the like, in a Slurm task:
    :func:`monai_cache.launcher.launch_view`); 1 outside a launcher, or where the value cannot be read."""
    return max(1, launch_view(os.environ).local_world_size or 1)


def docker_size(n: int) -> str:
    """``n`` bytes rounded up to whole GiB, as Docker's ``--shm-size`` and ``--memory`` take it (``"12g"``)."""
    return f"{max(1, math.ceil(n / _GIB))}g"


def kubernetes_size(n: int) -> str:
    """``n`` bytes rounded up to whole GiB, as a Kubernetes quantity (``"12Gi"``)."""
    return f"{max(1, math.ceil(n / _GIB))}Gi"


class Fit:
    """What fits of a cache that needs ``needed`` bytes, given what the machine offers.

    Attributes:
        needed: bytes the whole cache needs.
        held: bytes it holds already (counted in the machine's usage).
        room: bytes it may still take, by the tightest limit.
        limit: the name of that limit.
        fits: whether the rest fits.
        cache_rate: the largest ``cache_rate`` (two decimals, rounded down) that fits; 1.0 when all fits.
    """

    __slots__ = ("cache_rate", "fits", "held", "limit", "needed", "room")

    def __init__(self, needed: int, held: int, room: int, limit: str) -> None:
        self.needed, self.held, self.room, self.limit = needed, held, room, limit
        available = held + max(room, 0)
        self.fits = needed <= available
        self.cache_rate = 1.0 if self.fits else math.floor(100 * available / needed) / 100 if needed else 1.0


def fit(needed: int, machine: MachineMemory, held: int = 0, tmpfs_reserve: int | None = None) -> Fit:
    """Whether ``needed`` bytes fit, of which ``held`` are stored already (see :class:`Fit`)."""
    room, limit = machine.room(tmpfs_reserve)
    return Fit(needed, held, room, limit)


def advice(needed: int, machine: MachineMemory, held: int = 0) -> list[str]:
    """The settings that give a cache of ``needed`` bytes room, one line each: Docker's ``--shm-size`` (and
    ``--memory`` where a cgroup limit is set), a Kubernetes ``emptyDir`` with the pod memory limit it implies, and
    ``MONAI_CACHE_SHM_DIR``. Sizes include the reserves :class:`MachineMemory` keeps."""
    shm_size = needed + min(512 << 20, max(machine.tmpfs_total // 4, 64 << 20))
    lines = [f"Docker: docker run --shm-size={docker_size(shm_size)} ..."]
    processes = 0
    if machine.cgroup is not None:
        processes = max(0, machine.cgroup.working_set - held)  # what the job uses besides the cache
        memory = processes + needed
        memory += memory_reserve(memory)
        lines[0] = f"Docker: docker run --shm-size={docker_size(shm_size)} --memory={docker_size(memory)} ..."
    pod = processes + needed
    pod += memory_reserve(pod)
    lines.append(
        f"Kubernetes: mount an emptyDir at /dev/shm with medium: Memory and sizeLimit: {kubernetes_size(shm_size)}, "
        f"and give the pod resources.limits.memory of at least {kubernetes_size(pod)} (the cache's pages count "
        "against the pod's memory)"
    )
    lines.append(
        f"or point shm_dir / MONAI_CACHE_SHM_DIR at a tmpfs with {format_bytes(shm_size)} free, or lower cache_rate, "
        "or keep the cache on disk (PersistentDataset, or CacheDataset(..., cache_dir=...) with shm_budget)"
    )
    return lines
