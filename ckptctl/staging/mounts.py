"""Mount points inside a checkpoint directory: found before anything is written, and never crossed
by a removal.

A directory rename carries the mounts below it (a mount is attached to the directory entry, not
to a path): publishing over ``DST`` by ``RENAME_EXCHANGE`` or by the two renames moves a volume
mounted at ``DST/datasets`` into the staging directory, and removing that directory would unlink
every file of the mounted filesystem. So:

- :func:`mounts_below` lists the mount points strictly below a directory, from
  ``/proc/self/mountinfo`` (every mount of this process's namespace, bind mounts of the same
  filesystem included), or, where that cannot be read, by walking the tree; the destination
  check refuses such a destination before any work;
- :class:`MountProbe` tells, relative to a directory file descriptor and without following a
  link, whether a directory just opened (or an entry) is on another mount than the directory
  holding it: ``statx`` with
  ``STATX_MNT_ID`` (Linux 5.8; the mount ID differs across a bind mount of the same filesystem,
  where ``st_dev`` is equal), else the ``mnt_id`` of ``/proc/self/fdinfo`` for an ``O_PATH``
  descriptor (Linux 3.15), else the device number alone. The removal in :mod:`.fs` compares the
  device of every entry, asks the probe for every directory it opens (a file bind-mounted over a
  file is refused by the kernel's unlink with EBUSY, and then named), and raises
  :class:`MountInside` instead of descending.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any

_STATX_MNT_ID = 0x1000
_AT_EMPTY_PATH = 0x1000
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_STATX_DONT_SYNC = 0x4000  # what the VFS knows (the mount is local knowledge): no NFS round trip
_STATX_SIZE = 256
_MNT_ID_AT = 0x90  # offsetof(struct statx, stx_mnt_id)
_ESCAPE = re.compile(rb"\\([0-7]{3})")
MOUNTINFO = "/proc/self/mountinfo"


class MountInside(OSError):
    """Another filesystem (or a bind mount) is mounted at this path: a removal never descends into
    it nor unlinks it. ``filename`` is the mount point."""

    def __init__(self, where: str) -> None:
        super().__init__(errno.EBUSY, "a filesystem is mounted there; ckptctl never removes anything across "
                                      "a mount point", where)


class MountProbe:
    """Which mount an entry is on, asked relative to a directory descriptor, never following a
    link. One per removal: it holds the C library's ``statx`` (looked up once)."""

    def __init__(self) -> None:
        self._statx: Any = None
        self._buf: Any = None
        try:
            import ctypes

            fn = getattr(ctypes.CDLL(None, use_errno=True), "statx", None)
        except OSError:
            fn = None
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._statx, self._buf = fn, ctypes.create_string_buffer(_STATX_SIZE)

    def mount_id(self, dir_fd: int, name: str | None = None) -> int | None:
        """The mount ID of ``name`` under ``dir_fd`` (of ``dir_fd`` itself when ``name`` is None),
        or None where the system cannot tell."""
        got = self._by_statx(dir_fd, name)
        if got is not None:
            return got
        if name is None:
            return _fdinfo_mount_id(dir_fd)
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return None
        try:
            return _fdinfo_mount_id(fd)
        finally:
            os.close(fd)

    def _by_statx(self, dir_fd: int, name: str | None) -> int | None:
        if self._statx is None:
            return None
        flags = _AT_SYMLINK_NOFOLLOW | _AT_STATX_DONT_SYNC | (_AT_EMPTY_PATH if name is None else 0)
        path = b"" if name is None else os.fsencode(name)
        if self._statx(dir_fd, path, flags, _STATX_MNT_ID, self._buf) != 0:
            return None
        mask = struct.unpack_from("<I", self._buf.raw, 0)[0]
        return struct.unpack_from("<Q", self._buf.raw, _MNT_ID_AT)[0] if mask & _STATX_MNT_ID else None

    def home(self, dir_fd: int) -> tuple[int, int | None]:
        """The device and mount ID of the directory ``dir_fd``: what its entries must share."""
        return os.fstat(dir_fd).st_dev, self.mount_id(dir_fd)

    def check_dir(self, dir_fd: int, home: tuple[int, int | None], where: str) -> tuple[int, int | None]:
        """The device and mount of the opened directory ``dir_fd``; :class:`MountInside` (naming
        ``where``) when they are not ``home``'s (the directory holding it)."""
        inner = self.home(dir_fd)
        if inner[0] != home[0] or (None not in (inner[1], home[1]) and inner[1] != home[1]):
            raise MountInside(where)
        return inner

    def is_other(self, dir_fd: int, name: str, home: tuple[int, int | None]) -> bool:
        """Whether ``name`` under ``dir_fd`` (not followed) is on another mount than ``home``."""
        got = self.mount_id(dir_fd, name)
        return home[1] is not None and got is not None and got != home[1]


def _fdinfo_mount_id(fd: int) -> int | None:
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def mount_points() -> list[str] | None:
    """Every mount point of this process's mount namespace (``/proc/self/mountinfo``, unescaped),
    or None when it cannot be read."""
    try:
        with open(MOUNTINFO, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split(b" ")
        if len(fields) > 4:
            out.append(os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4])))
    return out


def mounts_below(directory: Path, *, limit: int = 5) -> list[Path]:
    """Up to ``limit`` mount points strictly below ``directory`` (as the kernel resolves it: a
    symbolic link to it is followed), sorted; [] when there are none."""
    real = os.path.realpath(directory)
    points = mount_points()
    if points is None:
        return _walk_for_mounts(Path(real), limit)
    prefix = real.rstrip("/") + "/"
    return [Path(p) for p in sorted({p for p in points if p.startswith(prefix)})][:limit]


def is_mount_point(directory: Path) -> bool:
    """Whether ``directory`` (resolved) is itself a mount point, a bind mount of the same
    filesystem included."""
    points = mount_points()
    if points is not None:
        return os.path.realpath(directory) in points
    return os.path.ismount(directory)


def _walk_for_mounts(root: Path, limit: int) -> list[Path]:
    """:func:`mounts_below` without ``/proc``: every entry below ``root`` asked by :class:`MountProbe`."""
    probe, found = MountProbe(), []
    stack = [root]
    while stack and len(found) < limit:
        d = stack.pop()
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            home = probe.home(fd)
            with os.scandir(fd) as it:
                names = sorted(e.name for e in it)
            for name in names:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISLNK(st.st_mode) and (st.st_dev != home[0] or probe.is_other(fd, name, home)):
                    found.append(d / name)
                elif stat.S_ISDIR(st.st_mode):
                    stack.append(d / name)
        finally:
            os.close(fd)
    return sorted(found)[:limit]
