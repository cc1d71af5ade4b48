"""Looking at directory trees: content snapshots (links never followed) and staging directories."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

MANIFEST = "ckptctl.manifest.json"

_DIGESTS: dict[tuple, str] = {}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_digest(path: Path, ignore_manifest_stamp: bool = False) -> str:
    """sha256 of a file's bytes, remembered per (device, inode, size, mtime, ctime) so a file that
    did not change is hashed once however many snapshots include it. ``ignore_manifest_stamp``:
    a ckptctl manifest is digested without its ``created`` field (the one field two clean runs
    write differently)."""
    st = os.lstat(path)
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, ignore_manifest_stamp)
    got = _DIGESTS.get(ident)
    if got is None:
        data = path.read_bytes()
        got = sha256(data)
        if ignore_manifest_stamp and path.name == MANIFEST:
            try:
                doc = json.loads(data)
                doc.pop("created", None)
                got = "manifest:" + sha256(json.dumps(doc, sort_keys=True).encode())
            except ValueError:
                pass  # not JSON: compared by its bytes
        if len(_DIGESTS) > 100_000:
            _DIGESTS.clear()
        _DIGESTS[ident] = got
    return got


def snapshot(root: Path, skip: Callable[[str], bool] | None = None, *,
             ignore_manifest_stamp: bool = False) -> dict[str, str]:
    """Every entry below ``root`` by relative path (links not followed): ``dir``,
    ``link:<target>`` or the file's digest (:func:`file_digest`). ``skip(relpath)`` prunes
    entries. An absent ``root`` is ``{}``."""
    out: dict[str, str] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirs, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        for n in sorted(dirs + files):
            rel = n if rel_dir == "." else f"{rel_dir}/{n}"
            if skip and skip(rel):
                if n in dirs:
                    dirs.remove(n)
                continue
            p = Path(dirpath) / n
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
                if n in dirs:
                    dirs.remove(n)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = file_digest(p, ignore_manifest_stamp)
    return out


def fill_filesystem(path: Path, leave: int) -> Path:
    """Fill the filesystem ``path`` is on with the file ``path`` until a write fails (ENOSPC),
    then give back ``leave`` bytes: a disk that fills up under a running writer."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    os.truncate(path, max(0, path.stat().st_size - leave))
    return path


def staging_dirs(parent: Path) -> list[Path]:
    """Entries of ``parent`` named like staging directories (``_tmp_*``, and ``._tmp_*`` of a writer
    stopped before it made its staging directory visible), sorted."""
    return sorted(p for p in parent.iterdir() if p.name.startswith(("_tmp_", "._tmp_")))
