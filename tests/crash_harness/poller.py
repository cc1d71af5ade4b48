"""A reader polling the destination while writers publish (K19): every consistent read must show
exactly the old or the new version, for each of the three loaders' rules (glob, index-first,
single-first). Reads go through descriptors (``openat`` relative to the directory read), so a
view is one directory even when the path is swapped meanwhile."""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tests.support import INDEX, SINGLE, sha256


class ViewError(Exception):
    pass


Opener = Callable[[str], int]  # file name -> an open read-only descriptor
_SIG_CACHE: dict[tuple, dict[str, str]] = {}


def _read_fd(fd: int) -> bytes:
    chunks = []
    while True:
        b = os.read(fd, 1 << 22)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def _tensor_sigs(open_file: Opener, name: str) -> dict[str, str]:
    """Tensor name -> dtype, shape and a digest of its bytes, from one safetensors file. An
    unchanged file (same inode, size, mtime and ctime) is hashed once."""
    fd = open_file(name)
    try:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if ident in _SIG_CACHE:
            return _SIG_CACHE[ident]
        raw = _read_fd(fd)
    finally:
        os.close(fd)
    if len(raw) < 8:
        raise ViewError(f"{name}: too short")
    n = struct.unpack("<Q", raw[:8])[0]
    if 8 + n > len(raw):
        raise ViewError(f"{name}: header longer than file")
    hdr = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        b, e = v["data_offsets"]
        if base + e > len(raw):
            raise ViewError(f"{name}: truncated")
        out[k] = f"{v['dtype']}{v['shape']}{sha256(raw[base + b:base + e])}"
    if len(_SIG_CACHE) > 10_000:
        _SIG_CACHE.clear()
    _SIG_CACHE[ident] = out
    return out


def view_signature(names: list[str], open_file: Opener) -> tuple[str, str, str]:
    """(glob, index-first, single-first): what each loader would load from a directory view, as a
    digest of tensor names, dtypes, shapes and bytes; 'error:...' where it could not."""

    def digest(sigs: dict[str, str]) -> str:
        return sha256(json.dumps(sorted(sigs.items())).encode())[:16]

    def files(fs: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in fs:
            for k, v in _tensor_sigs(open_file, f).items():
                if k in out:
                    raise ViewError(f"{k} twice")
                out[k] = v
        return out

    def via_index() -> dict[str, str]:
        fd = open_file(INDEX)
        try:
            wm = json.loads(_read_fd(fd))["weight_map"]
        finally:
            os.close(fd)
        got = files(sorted(set(wm.values())))
        if set(got) != set(wm):
            raise ViewError("index names tensors its shards do not hold")
        return got

    result = []
    for how in ("glob", "index-first", "single-first"):
        try:
            if how == "glob":
                sigs = files(sorted(n for n in names if n.endswith(".safetensors")))
            elif how == "index-first":
                sigs = via_index() if INDEX in names else files([SINGLE])
            else:
                sigs = files([SINGLE]) if SINGLE in names else via_index()
            result.append(digest(sigs))
        except FileNotFoundError as exc:
            result.append(f"error:missing {os.path.basename(str(exc.filename))}")
        except (ViewError, ValueError, KeyError, OSError) as exc:
            result.append(f"error:{type(exc).__name__}")
    return tuple(result)  # type: ignore[return-value]


def dir_signature(d: Path) -> tuple[str, str, str]:
    """The loaders' view of ``d``, each file opened by its path (as transformers does)."""
    return view_signature(sorted(os.listdir(d)), lambda n: os.open(d / n, os.O_RDONLY | os.O_CLOEXEC))


@dataclass
class PollStats:
    observations: int = 0  # consistent views of the destination (old or new)
    old: int = 0
    new: int = 0
    absent: int = 0  # no destination at all (only the exchange-less fallback may cause this)
    superseded: int = 0  # the directory we read was replaced while we read it: read again
    violations: list[str] = field(default_factory=list)
    path_straddled: int = 0  # path-based reads that crossed a publish (informational)
    path_mixed_across_publish: int = 0  # ... and saw a mix: what a path-by-path loader risks


class Poller:
    """A thread that reads the destination as fast as it can while a writer publishes.

    Each read opens the directory once and reads the index and shards relative to that descriptor
    (``openat``), like a reader holding on to one version; afterwards it checks that the
    destination is still that directory. A read of a directory that stayed the destination must
    show, for every loader, exactly the old or the new version. Reads whose directory was
    superseded meanwhile are counted and retried. A second, path-by-path read (what transformers
    does: join paths for each file) is recorded separately: across a publish it can mix versions,
    which no directory-rename publish prevents; while the destination did not change it must not.
    """

    def __init__(self, dst: Path, versions: dict[str, tuple[str, str, str]], *, absent_ok: bool = False,
                 path_reads: bool = True) -> None:
        self.dst, self.versions, self.absent_ok, self.path_reads = dst, versions, absent_ok, path_reads
        self.stats = PollStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _classify(self, sig: tuple[str, str, str]) -> str | None:
        for name, v in self.versions.items():
            if sig == v:
                return name
        return None

    def _run(self) -> None:
        s = self.stats
        while not self._stop.is_set():
            try:
                dfd = os.open(self.dst, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                s.absent += 1
                if not self.absent_ok and len(s.violations) < 20:
                    s.violations.append("destination absent")
                continue
            except NotADirectoryError:
                s.violations.append("destination is not a directory")
                continue
            try:
                st0 = os.fstat(dfd)
                sig = view_signature(sorted(os.listdir(dfd)),
                                     lambda n: os.open(n, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd))
            finally:
                os.close(dfd)
            try:
                st1 = os.stat(self.dst)
                still = (st1.st_dev, st1.st_ino) == (st0.st_dev, st0.st_ino)
            except FileNotFoundError:
                still = False
            version = self._classify(sig)
            if not still:
                s.superseded += 1
            elif version is None:
                if len(s.violations) < 20:
                    s.violations.append(f"inconsistent view {sig}")
            else:
                s.observations += 1
                setattr(s, version, getattr(s, version) + 1)
            if self.path_reads:
                self._path_read()

    def _path_read(self) -> None:
        s = self.stats
        try:
            before = os.stat(self.dst).st_ino
            sig = dir_signature(self.dst)
            after = os.stat(self.dst).st_ino
        except (FileNotFoundError, NotADirectoryError):
            return
        if before != after:
            s.path_straddled += 1
            if self._classify(sig) is None:
                s.path_mixed_across_publish += 1
        elif self._classify(sig) is None:
            s.violations.append(f"path-based read of an unchanged destination is inconsistent {sig}")
