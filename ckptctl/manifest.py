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


def sha256_file(path: str | os.PathLike[str], chunk: int = HASH_CHUNK, *, stop: threading.Event | None = None) -> str:
    """The file's sha256; with ``stop``, raises :class:`~ckptctl.threads.Stopped` between chunks
    once it is set."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            check(stop)
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def list_files(root: Path) -> list[str]:
    """Every file below ``root``, as sorted paths relative to it (what a manifest lists)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def _as_published(root: Path, name: str, final: Path | None) -> Path:
    """Where ``root/name`` reads from once ``root`` is published at ``final``: a relative
    symbolic link (a Hugging Face cache snapshot's ``config.json -> ../../blobs/...``, carried
    as the link itself) resolves from the published directory, not from the staging one."""
    p = root / name
    if final is None or not p.is_symlink():
        return p
    target = os.readlink(p)
    return p if os.path.isabs(target) else final / os.path.dirname(name) / target


def build_manifest(root: Path, files: list[str], *, label: str | None = None,
                   final: Path | None = None, known: Mapping[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """Manifest for ``files`` (names relative to ``root``): each one's size and sha256 (the
    manifest itself is never listed). ``known``: files the writer hashed as it wrote them
    (name -> (size, sha256)), taken as they are when the regular file there has that size; every
    other file is read from disk. ``final`` is where ``root`` will be published, for relative
    links. Files are read two at a time (hashlib and the reads release the GIL), so a
    multi-shard checkpoint keeps both cores busy."""
    names = sorted(n for n in files if n != MANIFEST_NAME)
    known = known or {}
    entries: dict[str, dict[str, Any]] = {}
    todo: list[str] = []
    for n in names:
        st = os.lstat(root / n)
        if n in known and stat.S_ISREG(st.st_mode) and st.st_size == known[n][0]:
            entries[n] = {"size": st.st_size, "sha256": known[n][1]}
        else:
            todo.append(n)

    def entry(p: Path, stop: threading.Event) -> dict[str, Any]:
        return {"size": p.stat().st_size, "sha256": sha256_file(p, stop=stop)}

    with ordered_map(entry, [_as_published(root, n, final) for n in todo]) as results:
        entries.update(zip(todo, results))
    entries = {n: entries[n] for n in names}
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "ckptctl",
        "tool_version": __version__,
        "label": label,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": entries,
    }


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
