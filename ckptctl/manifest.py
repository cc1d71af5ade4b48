"""The manifest: every file of a published checkpoint with its size and sha256.

Written by ``export``/``resave --manifest`` inside the staging directory once every other file is
there, so it is published atomically with the data it describes. The sha256 is the digest the
Hub shows for LFS files.

Format (``ckptctl.manifest.json``)::

    {"schema_version": 1, "tool": "ckptctl", "tool_version": "...", "label": "step-1000",
     "created": "2026-11-30T09:00:00Z",
     "files": {"model-00001-of-00002.safetensors": {"size": 123, "sha256": "..."}, ...}}

The manifest does not list itself.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from ckptctl._version import __version__
from ckptctl.findings import ERROR, Finding
from ckptctl.format import small
from ckptctl.format.names import MANIFEST_NAME
from ckptctl.threads import check, ordered_map

SCHEMA_VERSION = 1
HASH_CHUNK = 8 * 1024 * 1024
# What opening a link's target says when the target is no regular file (a link to a link, a
# directory, a FIFO, or nothing): such a link is left out of the manifest.
_NOT_A_FILE = (errno.ELOOP, errno.EINVAL, errno.EISDIR, errno.ENOENT, errno.ENOTDIR)


def sha256_file(path: str | os.PathLike[str], chunk: int = HASH_CHUNK, *, stop: threading.Event | None = None) -> str:
    """The sha256 of the regular file at ``path`` (never through a link at its last component,
    never blocking on a FIFO: anything else raises OSError); with ``stop``, raises
    :class:`~ckptctl.threads.Stopped` between chunks once it is set."""
    return _hash_regular(path, chunk, stop)[1]


def _hash_regular(path: str | os.PathLike[str], chunk: int, stop: threading.Event | None) -> tuple[int, str]:
    """(size, sha256) of the regular file at ``path``, read once and no further than the size it
    had when opened: a FIFO, a device or a link is refused (OSError), and a file that shrinks
    while it is read is an OSError, never a digest of what is not there."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        h = hashlib.sha256()
        buf = bytearray(min(chunk, max(st.st_size, 1)))
        view = memoryview(buf)
        pos = 0
        while pos < st.st_size:
            check(stop)
            n = os.preadv(fd, [view[:min(len(buf), st.st_size - pos)]], pos)
            if n <= 0:
                raise OSError(errno.EIO, "the file shrank while it was read", str(path))
            h.update(view[:n])
            pos += n
        return st.st_size, h.hexdigest()
    finally:
        os.close(fd)


def list_files(root: Path) -> list[str]:
    """Every file below ``root`` (not following links to directories), as sorted paths relative to
    it: what a manifest may list."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def _as_published(root: Path, name: str, final: Path | None) -> Path | None:
    """Where ``root/name`` reads from once ``root`` is published at ``final``, or None when it is
    not a file the manifest may read. A relative symbolic link (a Hugging Face cache snapshot's
    ``config.json -> ../../blobs/...``, carried as the link itself) resolves from the published
    directory, not from the staging one, and is followed only when it stays inside the published
    tree, or, for a cache snapshot (``.../snapshots/REV``), inside the cache's repository folder:
    a link out of the tree (an absolute one, ``../../../etc``, ``/dev/zero``) is never read."""
    p = root / name
    if not p.is_symlink():
        return p
    target = os.readlink(p)
    if os.path.isabs(target):
        return None
    home = os.path.normpath(final if final is not None else root)
    there = os.path.normpath(os.path.join(home, os.path.dirname(name), target))
    if _within(home, there):  # a file of the new version itself: read from where it is staged
        base, there = os.path.normpath(root), os.path.join(root, os.path.relpath(there, home))
    elif os.path.basename(os.path.dirname(home)) == "snapshots":  # a cache snapshot: its blobs
        base = os.path.dirname(os.path.dirname(home))
    else:
        return None
    real = os.path.realpath(there)
    return Path(real) if _within(base, there) and _within(os.path.realpath(base), real) else None


def _within(tree: str, path: str) -> bool:
    return os.path.commonpath([tree, path]) == tree


def build_manifest(root: Path, files: list[str], *, label: str | None = None,
                   final: Path | None = None, known: Mapping[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """Manifest for ``files`` (names relative to ``root``): each one's size and sha256 (the
    manifest itself is never listed). ``known``: files the writer hashed as it wrote them
    (name -> (size, sha256)), taken as they are when the regular file there has that size; every
    other file is read from disk. ``final`` is where ``root`` will be published, for relative
    links. Files are read two at a time (hashlib and the reads release the GIL), so a
    multi-shard checkpoint keeps both cores busy."""
    known = known or {}
    entries: dict[str, dict[str, Any]] = {}
    todo: list[tuple[str, Path]] = []
    for n in sorted(n for n in files if n != MANIFEST_NAME):
        st = os.lstat(root / n)
        if n in known and stat.S_ISREG(st.st_mode) and st.st_size == known[n][0]:
            entries[n] = {"size": st.st_size, "sha256": known[n][1]}
            continue
        where = _as_published(root, n, final) if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) else None
        if where is not None:  # a FIFO, socket or device, or a link out of the tree, is not listed
            todo.append((n, where))

    def entry(item: tuple[str, Path], stop: threading.Event) -> dict[str, Any] | None:
        try:
            size, digest = _hash_regular(item[1], HASH_CHUNK, stop)
        except OSError as exc:
            if stat.S_ISLNK(os.lstat(root / item[0]).st_mode) and exc.errno in _NOT_A_FILE:
                return None  # a link to something that is not a regular file: not listed
            raise
        return {"size": size, "sha256": digest}

    with ordered_map(entry, todo) as results:
        entries.update((n, e) for (n, _), e in zip(todo, results) if e is not None)
    entries = dict(sorted(entries.items()))
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "ckptctl",
        "tool_version": __version__,
        "label": label,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": entries,
    }


def add_late_files(root: Path, names: list[str], *, fsync: bool = True) -> list[str]:
    """Add to the published manifest of ``root`` the files carried into it after the manifest
    was written (what the user added to the destination while the new version was written:
    ``names``, files or folders relative to ``root``), each hashed as :func:`build_manifest`
    does; the manifest is replaced whole (a temporary file renamed over it), so a reader sees it
    with or without them, never half. Returns the files added."""
    doc, found = read_manifest(root / MANIFEST_NAME)
    if doc is None or found:
        return []
    files = []
    for name in names:
        p = root / name
        if p.is_dir() and not p.is_symlink():
            files += [os.path.join(name, f) for f in list_files(p)]
        else:
            files.append(name)
    added = build_manifest(root, files)["files"]
    if not added:
        return []
    doc["files"] = dict(sorted({**doc["files"], **added}.items()))
    tmp = root / f".{MANIFEST_NAME}.ckptctl-{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(encode_manifest(doc))
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, root / MANIFEST_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return sorted(added)


def encode_manifest(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


def read_manifest(path: Path) -> tuple[dict[str, Any] | None, list[Finding]]:
    """Parse a manifest; returns (doc or None, findings about its own form)."""
    shown = str(path)
    try:
        doc = small.read_json(path, follow=True)
    except FileNotFoundError:
        return None, []
    except (OSError, ValueError) as exc:
        return None, [Finding("manifest.bad_json", ERROR, shown, f"{shown}: unreadable manifest ({exc})",
                              "re-export with --manifest to write a new one")]
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
        for v in files.values()
    ):
        return None, [Finding("manifest.bad_schema", ERROR, shown, f"{shown}: manifest has no valid 'files' map",
                              "re-export with --manifest to write a new one")]
    return doc, []
