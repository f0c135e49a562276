"""Small helpers shared by the stores: byte sizes, locks, warnings."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import struct
import time
import warnings

__all__ = ["OFDLock", "format_bytes", "ofd_lock", "ofd_unlock", "parse_bytes", "pid_alive", "warn"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str | None, name: str = "size") -> int | None:
    """Parse ``8589934592``, ``"8GiB"``, ``"8 GB"`` or ``"512MiB"`` into bytes; ``None`` stays ``None``.

    Raises:
        ValueError: for negative or unparsable sizes, naming the argument.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of bytes or a string like '8GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name} must be a finite number of bytes or a string like '8GiB', got {value!r}")
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a size: use bytes (int) or a string like '512MiB' or '8GB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def warn(message: str, stacklevel: int = 3) -> None:
    warnings.warn(f"monai_cache: {message}", RuntimeWarning, stacklevel=stacklevel)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (dead, not yet reaped by its parent) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # gone since kill(), unless there is no /proc to ask
    except OSError:
        return True
    # "pid (comm) state ...": comm may hold spaces and parentheses, so the state follows the last ")"
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


# struct flock on Linux (x86-64 and aarch64): short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid.
_FLOCK = struct.Struct("hhqqi4x")


def ofd_lock(fd: int, start: int = 0, blocking: bool = True) -> bool:
    """Take the OFD write lock on byte ``start`` of the file open as ``fd``; False if busy and not ``blocking``."""
    while True:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if blocking else fcntl.F_OFD_SETLK,
                        _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0))
            return True
        except OSError as e:
            if not blocking and e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            if e.errno in (errno.EINTR, errno.EDEADLK):
                time.sleep(0.001)
                continue
            raise


def ofd_unlock(fd: int, start: int = 0) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, 1, 0))


class OFDLock:
    """A byte-range lock owned by an open file description (Linux OFD lock).

    Unlike ``fcntl.lockf`` locks, these are not shared by the threads of a process (each acquisition opens
    its own descriptor), are not lost when another descriptor of the file is closed, and are released by
    the kernel when the holder dies: a dead holder never blocks anyone.
    """

    __slots__ = ("_fd", "_path", "_start")

    def __init__(self, path: str, start: int = 0) -> None:
        self._path = path
        self._start = start
        self._fd = -1

    def acquire(self, blocking: bool = True) -> bool:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if ofd_lock(self._fd, self._start, blocking):
                return True
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        os.close(self._fd)
        self._fd = -1
        return False

    def release(self) -> None:
        if self._fd >= 0:
            try:
                ofd_unlock(self._fd, self._start)
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> OFDLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
