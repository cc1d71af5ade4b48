"""Multi-component roots: diffusers pipelines (``model_index.json``) and sentence-transformers
models (``modules.json``), each component with its own layout."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Protocol

from ckptctl.findings import ERROR
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.layout.model import MODEL_INDEX, MODULES_JSON, PIPELINE, SENTENCE_TRANSFORMERS, Component, Layout


class _Scanner(Protocol):
    """What a directory's scan (``layout.scan``) offers the search for its components."""

    root: Path
    present: set[str]
    lay: Layout
    claimed: set[str]

    def add(self, code: str, severity: str, path: str, message: str, hint: str | None = None) -> None: ...

    def regular(self, path: Path) -> bool: ...

    def scan_folder(self, where: Path) -> Layout: ...

_MAX_MANIFEST = 1 << 20  # model_index.json / modules.json are a few hundred bytes


def scan_components(scanner: "_Scanner") -> None:
    """Find the components a root's manifest names and scan each one's folder."""
    lay = scanner.lay
    if MODEL_INDEX in scanner.present:
        entries = _pipeline_components(_manifest(scanner, MODEL_INDEX, dict))
        lay.kind = PIPELINE
    elif MODULES_JSON in scanner.present:
        entries = _st_modules(_manifest(scanner, MODULES_JSON, list))
        lay.kind = SENTENCE_TRANSFORMERS
    else:
        return
    for name, path, library, cls in entries:
        comp = Component(name, path, library, cls)
        lay.components.append(comp)
        if path == "":
            continue  # the root module: its weights are the root's own families
        why = N.member_problem(path)
        where = scanner.root / path
        if why is None:
            try:
                st = os.lstat(where)
            except OSError:
                why = "it does not exist"
            else:
                why = None if stat.S_ISDIR(st.st_mode) else "it is not a directory (links are not followed)"
        if why is not None:
            scanner.add("layout.component_missing", ERROR, str(where),
                     f"component {name!r} lives in {path!r}, but {why}",
                     "restore the component's folder from the save that wrote it, or fix "
                     f"{MODEL_INDEX if lay.kind == PIPELINE else MODULES_JSON}")
            continue
        comp.layout = scanner.scan_folder(where)
        scanner.claimed.add(path.split("/", 1)[0])


def _manifest(scanner: "_Scanner", name: str, want: type) -> object:
    """A small JSON manifest, read with a bound; malformed is a finding and reads as empty."""
    path = scanner.root / name
    try:
        if not scanner.regular(path) or os.path.getsize(path) > _MAX_MANIFEST:
            raise ValueError("not a regular file of at most 1 MiB")
        doc = small.read_json(path, limit=_MAX_MANIFEST, follow=True)
        if not isinstance(doc, want):
            raise ValueError(f"not a JSON {'object' if want is dict else 'array'}")
    except (OSError, ValueError, RecursionError) as exc:
        scanner.add("layout.bad_component_manifest", ERROR, str(path), f"{name} is unreadable: {exc}",
             "restore it from the save that wrote it")
        return want()
    return doc


def _pipeline_components(doc: object) -> list[tuple[str, str, str | None, str | None]]:
    """diffusers' model_index.json: every public key whose value is ``[library, class]`` with a
    library is a component in the folder of the same name (``[null, null]`` is an absent one)."""
    out = []
    for key, value in sorted(doc.items()) if isinstance(doc, dict) else ():
        if key.startswith("_") or not (isinstance(value, list) and len(value) == 2):
            continue
        library, cls = value
        if isinstance(library, str) and isinstance(cls, str):
            out.append((key, key, library, cls))
    return out


def _st_modules(doc: object) -> list[tuple[str, str, str | None, str | None]]:
    """sentence-transformers' modules.json: a list of ``{"name", "path", "type"}``."""
    out = []
    for m in doc if isinstance(doc, list) else ():
        if isinstance(m, dict) and isinstance(m.get("path"), str):
            typ = m.get("type") if isinstance(m.get("type"), str) else None
            out.append((str(m.get("name", m["path"])), m["path"].rstrip("/"), "sentence_transformers", typ))
    return out
