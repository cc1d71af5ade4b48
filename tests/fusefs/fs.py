"""A passthrough FUSE filesystem (mfusepy over libfuse3) with the semantics of NFS and other
network/FUSE mounts that break the usual local-filesystem assumptions, each behind a switch.

Run as its own process (``tests/fusefs/__init__.py`` starts it and unmounts it with
``fusermount3 -u``)::

    python tests/fusefs/fs.py BACKING MOUNTPOINT [--refuse-rename-flags] [--silly nfs|libfuse|none]
                              [--cache SECONDS] [--subtype NAME] [--control FILE] [--log FILE]

Every operation is done on ``BACKING`` (a directory of a local filesystem). The switches:

``--refuse-rename-flags``
    ``rename`` with ``RENAME_EXCHANGE`` or ``RENAME_NOREPLACE`` fails with EINVAL, as the Linux
    NFS client answers ``renameat2`` with flags. Without it, the flags are honoured on the backing
    filesystem (``renameat2``).
``--silly nfs``
    NFS "silly rename": unlinking (or renaming over) a file that some process still has open
    renames it to ``.nfs<inode><counter>`` in the same directory instead; it is deleted when its
    last descriptor is closed. Unlinking such a ``.nfs`` file while it is open fails with EBUSY,
    and ``rmdir`` of its directory fails with ENOTEMPTY, as on an NFS client.
``--silly libfuse``
    libfuse's own equivalent (``hard_remove`` off): open files are hidden as ``.fuse_hidden*``.
``--cache SECONDS``
    the kernel keeps dentries and attributes for that long (``entry_timeout``/``attr_timeout``,
    like an NFS client's attribute cache): a name looked up once is not asked for again, so after
    a rename whose reply was lost the kernel still believes the old name exists. Negative lookups
    are never cached (``negative_timeout`` 0, NFS ``lookupcache=positive``). 0 (default) caches
    nothing.
``--subtype NAME``
    the filesystem type shown in ``/proc/self/mountinfo`` is ``fuse.NAME`` (e.g. ``gcsfuse``).
``--control FILE``
    JSON rules read whenever the file changes (``{"lost_reply": [RULE...], "fail": [RULE...]}``,
    a RULE being ``{"src": GLOB, "dst": GLOB, "times": N}``): a rename whose source and target
    base names match a ``lost_reply`` rule is **performed** on the backing filesystem and then
    answered with EIO, as a network filesystem does when the reply to a rename is lost (a soft
    mount's timeout); one matching a ``fail`` rule is answered EIO and not performed (the server
    is unreachable). Rewriting the file resets the counts.
``--log FILE``
    one JSON line per injected fault (lost reply, refused flags, silly rename), so a test can
    prove that its fault really happened.

Kernel-side ``flock`` is used (no ``flock`` operation is implemented: the kernel keeps flock
locks for a FUSE mount itself), as on NFS clients that emulate flock locally.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fnmatch
import json
import os
import stat
import sys
import threading

import mfusepy
from mfusepy import FUSE, FuseOSError, Operations

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_UTIME_NOW = (1 << 30) - 1
_UTIME_OMIT = (1 << 30) - 2
_STAT_KEYS = ("st_mode", "st_ino", "st_dev", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks",
              "st_atime_ns", "st_mtime_ns", "st_ctime_ns")

_libc = ctypes.CDLL(None, use_errno=True)


def _renameat2(src: str, dst: str, flags: int) -> None:
    fn = _libc.renameat2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(-100, os.fsencode(src), -100, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Passthrough(Operations):
    use_ns = True

    def __init__(self, backing: str, *, refuse_flags: bool, silly: str, cache: float, control: str | None,
                 log: str | None) -> None:
        self.root = os.path.realpath(backing)
        self.refuse_flags = refuse_flags
        self.silly = silly
        self.cache = cache
        self.control = control
        self.log_path = log
        self.mutex = threading.Lock()
        self.open_count: dict[tuple[int, int], int] = {}  # backing inode -> open descriptors
        self.fd_key: dict[int, tuple[int, int]] = {}
        self.hidden: dict[tuple[int, int], list[tuple[int, str]]] = {}  # inode -> [(dir fd, .nfs name)]
        self.silly_counter = 0
        self.rules: dict[str, list[dict]] = {}
        self.rules_stamp: tuple[int, int] | None = None

    # ------------------------------------------------------------------------------------------
    def _p(self, path: str) -> str:
        return self.root + path

    def _log(self, **event) -> None:
        if self.log_path:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(event) + "\n")

    def init_with_config(self, conn_info, config_3) -> None:
        if config_3 is not None:
            config_3.use_ino = 1  # st_ino is the backing inode (stable across renames, as NFS fileids)
            config_3.hard_remove = 0 if self.silly == "libfuse" else 1
            config_3.entry_timeout = self.cache
            config_3.attr_timeout = self.cache
            config_3.negative_timeout = 0.0

    # ------------------------------------------------------------------------------------------
    # attributes and directories

    def getattr(self, path, fh=None):
        st = os.fstat(fh) if fh is not None and path is None else os.lstat(self._p(path))
        out = {k: getattr(st, k) for k in _STAT_KEYS}
        for k in ("st_atime", "st_mtime", "st_ctime"):
            out[k] = out.pop(k + "_ns")
        return out

    def readdir(self, path, fh):
        # real inode numbers: with use_ino, an entry whose d_ino is 0 is skipped by readdir(3)
        here = os.lstat(self._p(path))
        out = [(".", {"st_mode": here.st_mode, "st_ino": here.st_ino}, 0), ("..", {"st_mode": stat.S_IFDIR, "st_ino": 1}, 0)]
        with os.scandir(self._p(path)) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                out.append((e.name, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0))
        return out

    def readlink(self, path):
        return os.readlink(self._p(path))

    def statfs(self, path):
        sv = os.statvfs(self._p(path))
        return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                             "f_files", "f_flag", "f_frsize", "f_namemax")}

    def mkdir(self, path, mode):
        os.mkdir(self._p(path), mode)
        return 0

    def rmdir(self, path):
        os.rmdir(self._p(path))
        return 0

    def mknod(self, path, mode, dev):
        os.mknod(self._p(path), mode, dev)
        return 0

    def symlink(self, target, source):
        os.symlink(source, self._p(target))
        return 0

    def link(self, target, source):
        os.link(self._p(source), self._p(target), follow_symlinks=False)
        return 0

    def chmod(self, path, mode):
        os.chmod(self._p(path), mode)
        return 0

    def chown(self, path, uid, gid):
        os.lchown(self._p(path), uid, gid)
        return 0

    def utimens(self, path, times=None):
        if times is None:
            os.utime(self._p(path), follow_symlinks=False)
            return 0
        st = os.lstat(self._p(path))
        now = None
        resolved = []
        for ns, current in zip(times, (st.st_atime_ns, st.st_mtime_ns)):
            if ns % 10**9 == _UTIME_OMIT:
                resolved.append(current)
            elif ns % 10**9 == _UTIME_NOW:
                import time

                now = now or time.time_ns()
                resolved.append(now)
            else:
                resolved.append(ns)
        os.utime(self._p(path), ns=tuple(resolved), follow_symlinks=False)
        return 0

    def fsyncdir(self, path, datasync, fh):
        fd = os.open(self._p(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return 0

    # ------------------------------------------------------------------------------------------
    # files

    def _opened(self, fd: int) -> int:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self.mutex:
            self.fd_key[fd] = key
            self.open_count[key] = self.open_count.get(key, 0) + 1
        return fd

    def open(self, path, flags):
        return self._opened(os.open(self._p(path), flags & ~os.O_CREAT))

    def create(self, path, mode, flags):
        return self._opened(os.open(self._p(path), flags | os.O_CREAT, mode))

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._p(path), length)
        return 0

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        (os.fdatasync if datasync else os.fsync)(fh)
        return 0

    def release(self, path, fh):
        with self.mutex:
            key = self.fd_key.pop(fh, None)
            gone: list[tuple[int, str]] = []
            if key is not None:
                left = self.open_count.get(key, 1) - 1
                if left:
                    self.open_count[key] = left
                else:
                    self.open_count.pop(key, None)
                    gone = self.hidden.pop(key, [])
        os.close(fh)
        for dfd, name in gone:  # the last close of a silly-renamed file: now it goes
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
            finally:
                os.close(dfd)
        return 0

    # ------------------------------------------------------------------------------------------
    # NFS silly rename

    def _silly_rename(self, path: str) -> bool:
        """NFS: a file still open is renamed to .nfsXXXX instead of being removed. True if done."""
        if self.silly != "nfs":
            return False
        try:
            st = os.lstat(self._p(path))
        except FileNotFoundError:
            return False
        key = (st.st_dev, st.st_ino)
        with self.mutex:
            if not stat.S_ISREG(st.st_mode) or not self.open_count.get(key):
                return False
            if os.path.basename(path).startswith(".nfs"):
                raise FuseOSError(errno.EBUSY)  # the NFS client refuses to unlink a silly-renamed file
            self.silly_counter += 1
            parent = os.path.dirname(self._p(path))
            name = f".nfs{st.st_ino:016x}{self.silly_counter:08x}"
            os.rename(self._p(path), os.path.join(parent, name))
            self.hidden.setdefault(key, []).append((os.open(parent, os.O_RDONLY | os.O_DIRECTORY), name))
        self._log(fault="silly-rename", path=path, name=name)
        return True

    def unlink(self, path):
        if not self._silly_rename(path):
            os.unlink(self._p(path))
        return 0

    # ------------------------------------------------------------------------------------------
    # rename: refused flags, lost replies

    def _load_rules(self) -> None:
        if not self.control:
            return
        try:
            st = os.stat(self.control)
        except FileNotFoundError:
            self.rules, self.rules_stamp = {}, None
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self.rules_stamp:
            with open(self.control, encoding="utf-8") as f:
                doc = json.load(f)
            self.rules = {kind: [dict(r) for r in doc.get(kind, [])] for kind in ("lost_reply", "fail")}
            self.rules_stamp = stamp

    def _matches(self, kind: str, old: str, new: str) -> bool:
        """Does a ``kind`` rule match this rename (and has it uses left)? Uses one up."""
        with self.mutex:
            self._load_rules()
            for rule in self.rules.get(kind, []):
                if rule.get("times", 1) <= 0:
                    continue
                if fnmatch.fnmatchcase(os.path.basename(old), rule.get("src", "*")) and \
                        fnmatch.fnmatchcase(os.path.basename(new), rule.get("dst", "*")):
                    rule["times"] = rule.get("times", 1) - 1
                    return True
        return False

    def rename(self, old, new, flags=0):
        if flags and self.refuse_flags:
            self._log(fault="rename-flags-refused", src=old, dst=new, flags=flags)
            raise FuseOSError(errno.EINVAL)
        if self._matches("fail", old, new):
            self._log(fault="rename-failed", src=old, dst=new)
            raise FuseOSError(errno.EIO)  # not done: the server never got it
        lost = self._matches("lost_reply", old, new)
        if flags:
            _renameat2(self._p(old), self._p(new), flags)
        else:
            if not os.path.isdir(self._p(new)):
                self._silly_rename(new)  # NFS renames an open file out of the way first
            os.rename(self._p(old), self._p(new))
        if lost:
            self._log(fault="lost-reply", src=old, dst=new)
            raise FuseOSError(errno.EIO)  # performed, but the reply never arrived
        return 0


class PassthroughFUSE(FUSE):
    """mfusepy drops the flags of libfuse3's rename; this passes them on."""

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return self.operations.rename(old.decode(self.encoding, self.errors),
                                      new.decode(self.encoding, self.errors), flags)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backing")
    ap.add_argument("mountpoint")
    ap.add_argument("--refuse-rename-flags", action="store_true")
    ap.add_argument("--silly", choices=("nfs", "libfuse", "none"), default="none")
    ap.add_argument("--cache", type=float, default=0.0)
    ap.add_argument("--subtype", default="ckptfuse")
    ap.add_argument("--control")
    ap.add_argument("--log")
    a = ap.parse_args(argv)
    ops = Passthrough(a.backing, refuse_flags=a.refuse_rename_flags, silly=a.silly, cache=a.cache,
                      control=a.control, log=a.log)
    print(f"libfuse {mfusepy.fuse_version_major}.{mfusepy.fuse_version_minor}", file=sys.stderr, flush=True)
    PassthroughFUSE(ops, a.mountpoint, foreground=True, fsname=f"ckptfuse:{a.backing}", subtype=a.subtype)


if __name__ == "__main__":
    main()
