"""What the machine offers the shared-memory cache now: the tmpfs, the memory available, and the memory cgroup limit.

Pages of a tmpfs file are memory. Each is charged to the memory cgroup of the process that first wrote it, and stays
charged until the file is deleted; without swap nothing reclaims it. So in a container (Docker ``--memory``, a
Kubernetes pod limit with ``/dev/shm`` an ``emptyDir`` of medium ``Memory``) the room that runs out first is often
the cgroup's, not the tmpfs's: past it, the kernel's OOM killer ends a process of the job. This module reads the
three limits: the tmpfs's free space (``statvfs``), ``MemAvailable`` (``/proc/meminfo``), and the limit and usage of
the process's memory cgroup and its ancestors (cgroup v1 and v2). It imports neither torch nor MONAI, and each read
costs a few file reads (tens of microseconds).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = [
    "CgroupMemory",
    "MachineMemory",
    "cgroup_memory",
    "mem_info",
    "memory_reserve",
    "read_machine",
]

_NO_LIMIT = 1 << 60  # v1 reads "no limit" as about 2**63 rounded down to the page size; v2 as "max"
_MIB = 1 << 20


@dataclass(frozen=True)
class CgroupMemory:
    """A memory cgroup's limit and what is charged to it.

    Attributes:
        version: 1 or 2.
        path: the cgroup's directory (the tightest of the process's cgroup and its ancestors).
        limit: bytes the cgroup may use.
        usage: bytes charged now (``memory.usage_in_bytes`` / ``memory.current``): the processes' memory, the page
            cache they read, and tmpfs pages they wrote.
        inactive_file: the part of ``usage`` that is page cache the kernel reclaims before it kills (``memory.stat``).
    """

    version: int
    path: str
    limit: int
    usage: int
    inactive_file: int

    @property
    def working_set(self) -> int:
        """What the kernel cannot take back: ``usage`` less inactive page cache (as ``docker stats`` counts it)."""
        return max(0, self.usage - self.inactive_file)

    @property
    def room(self) -> int:
        """Bytes that may still be charged before the limit."""
        return self.limit - self.working_set


@dataclass(frozen=True)
class MachineMemory:
    """What the machine offers a shared-memory cache in ``shm_dir`` now.

    Attributes:
        tmpfs_total: size of the tmpfs holding ``shm_dir``.
        tmpfs_free: free bytes on it.
        mem_total: ``MemTotal`` of ``/proc/meminfo`` (None where there is none).
        mem_available: ``MemAvailable`` (None where there is none).
        cgroup: the tightest memory cgroup limit over this process, if any.
    """

    tmpfs_total: int
    tmpfs_free: int
    mem_total: int | None
    mem_available: int | None
    cgroup: CgroupMemory | None

    def limits(self, tmpfs_reserve: int | None = None) -> list[tuple[str, int]]:
        """``(name, bytes the cache may still take)`` for each limit known, each less its reserve: the tmpfs's
        (``tmpfs_reserve``, default the smaller of 512 MiB and a quarter of its size: DataLoader workers pass
        batches through it), the cgroup's and ``MemAvailable``'s (:func:`memory_reserve` of the limit, for the
        training processes themselves)."""
        reserve = tmpfs_reserve if tmpfs_reserve is not None else min(512 * _MIB, self.tmpfs_total // 4)
        found = [("the free space of the tmpfs", self.tmpfs_free - reserve)]
        if self.cgroup is not None:
            found.append(("the memory cgroup limit", self.cgroup.room - memory_reserve(self.cgroup.limit)))
        if self.mem_available is not None:
            total = self.mem_total or self.mem_available
            found.append(("the memory available (MemAvailable)", self.mem_available - memory_reserve(total)))
        return found

    def room(self, tmpfs_reserve: int | None = None) -> tuple[int, str]:
        """``(bytes, name)`` of the tightest of :meth:`limits`."""
        name_room = min(self.limits(tmpfs_reserve), key=lambda pair: pair[1])
        return name_room[1], name_room[0]


def memory_reserve(limit: int) -> int:
    """Memory left to the training processes under a memory limit: a tenth of it, at least 512 MiB, at most a
    quarter (a 600 MB container keeps 150 MB, a 16 GiB one 1.6 GiB, a 256 GiB machine 25.6 GiB)."""
    return min(limit // 4, max(512 * _MIB, limit // 10))


def mem_info() -> tuple[int | None, int | None]:
    """``(MemTotal, MemAvailable)`` in bytes, from ``/proc/meminfo`` (None where it cannot be read)."""
    total = available = None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemTotal:"):
                    total = int(line.split()[1]) * 1024
                elif line.startswith(b"MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                if total is not None and available is not None:
                    break
    except (OSError, ValueError, IndexError):
        pass
    return total, available


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == b"max":
        return _NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: bytes) -> int:
    try:
        with open(path, "rb") as f:
            for line in f:
                name, _, value = line.partition(b" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _mounts() -> dict[int, tuple[str, str]]:
    """``{version: (mount point, root within the hierarchy)}`` of the cgroup mounts holding the memory controller."""
    found: dict[int, tuple[str, str]] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                fstype, options = fields[sep + 1], fields[sep + 3].split(",") if len(fields) > sep + 3 else []
                if fstype == "cgroup" and "memory" in options:
                    found[1] = (fields[4], fields[3])
                elif fstype == "cgroup2":
                    try:
                        with open(os.path.join(fields[4], "cgroup.controllers")) as c:
                            if "memory" in c.read().split():
                                found[2] = (fields[4], fields[3])
                    except OSError:
                        pass
    except (OSError, ValueError, IndexError):
        pass
    return found


def _cgroup_paths(pid: int | str) -> dict[int, str]:
    """``{version: path}`` of the process's memory cgroup, from ``/proc/<pid>/cgroup``."""
    paths: dict[int, str] = {}
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    paths[2] = path
                elif "memory" in controllers.split(","):
                    paths[1] = path
    except (OSError, ValueError):
        pass
    return paths


def _limiting_directories(pid: int | str) -> tuple[int, list[str]] | None:
    """``(version, [the process's memory cgroup directory and its ancestors up to the mount])``, or None."""
    mounts, paths = _mounts(), _cgroup_paths(pid)
    for version in (1, 2):
        if version not in mounts or version not in paths:
            continue
        mount, root = mounts[version]
        relative = paths[version]
        if root != "/" and relative.startswith(root):  # the mount shows a subtree (a container's view)
            relative = relative[len(root) :]
        directory = os.path.join(mount, relative.lstrip("/"))
        if not os.path.isdir(directory):  # a cgroup namespace: the mount is the process's own cgroup
            directory = mount
        chain = [directory]
        while os.path.normpath(chain[-1]) != os.path.normpath(mount):
            chain.append(os.path.dirname(chain[-1]))
        return version, chain
    return None


_FILES = {  # the limit, the usage, and the reclaimable page cache in memory.stat, by cgroup version
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", b"total_inactive_file"),
    2: ("memory.max", "memory.current", b"inactive_file"),
}
_LIMITS_TTL = 5.0  # seconds between two reads of the limits themselves (they seldom change); usage: every call


class _Limited:
    """Where this process's memory cgroups are and which of them set a limit (read once, the limits again every
    ``_LIMITS_TTL`` seconds): most machines have none, and a read then costs nothing."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        found = _limiting_directories("self")
        self.version, self.chain = found if found is not None else (0, [])
        self.limits: list[tuple[str, int]] = []
        self.read_at = -_LIMITS_TTL

    def current(self) -> list[tuple[str, int]]:
        now = time.monotonic()
        if now - self.read_at >= _LIMITS_TTL and self.chain:
            limit_file = _FILES[self.version][0]
            read = [(d, _read_int(os.path.join(d, limit_file))) for d in self.chain]
            self.limits = [(d, limit) for d, limit in read if limit is not None and limit < _NO_LIMIT]
            self.read_at = now
        return self.limits


_SELF: _Limited | None = None


def cgroup_memory(pid: int | str = "self") -> CgroupMemory | None:
    """The memory cgroup that limits process ``pid`` most: the one with the least room among its cgroup and its
    ancestors (each one's limit applies to all below it); None where no limit is set or none can be read.

    For this process, where its cgroups are is read once (``/proc/self/mountinfo`` and ``cgroup``; again in a forked
    child), their limits every few seconds, and the usage of the limited ones at every call."""
    global _SELF
    if pid == "self":
        if _SELF is None or _SELF.pid != os.getpid():
            _SELF = _Limited()
        version, limited = _SELF.version, _SELF.current()
    else:
        found = _limiting_directories(pid)
        if found is None:
            return None
        version, chain = found
        read = [(d, _read_int(os.path.join(d, _FILES[version][0]))) for d in chain]
        limited = [(d, limit) for d, limit in read if limit is not None and limit < _NO_LIMIT]
    tightest: CgroupMemory | None = None
    for directory, limit in limited:
        _, usage_file, inactive_key = _FILES[version]
        usage = _read_int(os.path.join(directory, usage_file))
        if usage is None:
            continue
        inactive = _stat_value(os.path.join(directory, "memory.stat"), inactive_key)
        group = CgroupMemory(version, directory, limit, usage, inactive)
        if tightest is None or group.room < tightest.room:
            tightest = group
    return tightest


def read_machine(shm_dir: str, memory: bool = True) -> MachineMemory:
    """What the machine offers a cache in ``shm_dir`` now (see :class:`MachineMemory`); with ``memory=False``, the
    tmpfs only (the memory fields None)."""
    st = os.statvfs(shm_dir)
    if not memory:
        return MachineMemory(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, None, None, None)
    total, available = mem_info()
    return MachineMemory(
        tmpfs_total=st.f_blocks * st.f_frsize,
        tmpfs_free=st.f_bavail * st.f_frsize,
        mem_total=total,
        mem_available=available,
        cgroup=cgroup_memory(),
    )
