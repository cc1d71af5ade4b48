"""`ckptctl env`: what a bug report needs to know about this machine, without importing any of it.

Versions come from the installed packages' metadata (``importlib.metadata``: torch is never
imported), the ``CKPTCTL_`` variables from the package's own source (every one it reads, so the
list cannot fall behind the code), the fast paths from ``fastpaths.FAST_PATHS``, and the working
directory's filesystem from ``/proc/self/mountinfo``, ``statvfs`` and a clone of one block
between two unnamed temporary files (``O_TMPFILE``: nothing is left behind).

No ``from __future__ import annotations`` (see ``verify_cmd``): Typer evaluates the annotations."""

import os
import platform
import re
from pathlib import Path
from typing import Any, Optional

from ckptctl.cli._options import JsonOpt, QuietOpt, VerboseOpt
from ckptctl.cli._output import Output, human_size

# What ckptctl runs on, then what it uses when installed (each read from its metadata only).
REQUIRED = ("typer", "rich", "safetensors", "huggingface_hub", "numpy", "torch", "transformers")
OPTIONAL = ("msgspec", "accelerate", "diffusers", "peft", "sentence-transformers", "deepspeed",
            "megatron-core", "tiktoken", "jsonschema")
_VARIABLE = re.compile(r"(?<![A-Za-z0-9_])CKPTCTL_[A-Z][A-Z0-9_]*")


def env(json_: JsonOpt = False, quiet: QuietOpt = 0, verbose: VerboseOpt = 0) -> None:
    """Versions, fast paths and the working directory's filesystem, for a bug report.

    Examples:

    \b
      ckptctl env
      ckptctl env --json > env.json
    """
    out = Output("env", json_mode=json_, quiet=quiet, verbose=verbose)
    with out.guard():
        report = collect(Path.cwd())
        if json_:
            out.emit_json(out.document(True, **report))
            return
        _render(out, report)


def collect(cwd: Path) -> dict[str, Any]:
    """The report (the JSON document's fields)."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: package_version(name) for name in REQUIRED},
        "optional": {name: package_version(name) for name in OPTIONAL},
        "fast_paths": fast_paths(),
        "variables": {name: os.environ.get(name) for name in variables_read()},
        "cwd": filesystem(cwd),
    }


def package_version(name: str) -> Optional[str]:
    """The installed version of distribution ``name`` (None when it is not installed)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def fast_paths() -> dict[str, dict[str, Any]]:
    from ckptctl.fastpaths import FAST_PATHS, enabled

    return {name: {"variable": fp.env, "on": enabled(name), "what": fp.what} for name, fp in FAST_PATHS.items()}


def variables_read() -> list[str]:
    """Every ``CKPTCTL_`` variable the package's source names, sorted (``_CKPTCTL_COMPLETE``, the
    completion protocol's, is the shell's, not a setting)."""
    root = Path(__file__).resolve().parent.parent
    found: set[str] = set()
    for path in root.rglob("*.py"):
        try:
            found.update(_VARIABLE.findall(path.read_text(encoding="utf-8", errors="replace")))
        except OSError:
            continue
    return sorted(found)


def filesystem(path: Path) -> dict[str, Any]:
    """The filesystem ``path`` is on: its type and mount point, free bytes, and whether a file
    there can be cloned (reflinks: XFS, btrfs; None when nothing can be written there)."""
    where = os.path.realpath(path)
    doc: dict[str, Any] = {"path": where, "type": None, "mount": None, "free_bytes": None, "reflink": None}
    mount = _mount_of(where)
    if mount is not None:
        doc["mount"], doc["type"] = mount
    try:
        st = os.statvfs(where)
        doc["free_bytes"] = st.f_bavail * st.f_frsize
    except OSError:
        pass
    doc["reflink"] = _can_clone(where)
    return doc


def _mount_of(path: str) -> Optional[tuple[str, str]]:
    """(mount point, filesystem type) of the longest mount point holding ``path``."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: Optional[tuple[str, str]] = None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if len(fields) < 5 or not after:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, after[0])
    return best


def _can_clone(directory: str) -> Optional[bool]:
    """Clone one block between two unnamed temporary files in ``directory``."""
    from ckptctl.write.files import clone

    fds: list[int] = []
    try:
        for _ in range(2):
            fds.append(os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600))
        block = os.fstatvfs(fds[0]).f_bsize or 4096
        os.pwrite(fds[0], b"\0" * block, 0)
        return clone(fds[0], fds[1])
    except OSError:
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _render(out: Output, report: dict[str, Any]) -> None:
    from ckptctl._version import __version__

    lines = [f"ckptctl {__version__}", f"python {report['python']} ({report['platform']})"]
    for name, version in report["packages"].items():
        lines.append(f"{name} {version or 'not installed'}")
    found = [f"{n} {v}" for n, v in report["optional"].items() if v]
    lines.append("optional: " + (", ".join(found) or "none found"))
    lines.append("fast paths: " + ", ".join(f"{n} {'on' if fp['on'] else 'off'} ({fp['variable']})"
                                            for n, fp in report["fast_paths"].items()))
    given = [f"{k}={v}" for k, v in report["variables"].items() if v is not None]
    lines.append("CKPTCTL_ variables set: " + (", ".join(given) or "none")
                 + f" (read: {', '.join(report['variables'])})")
    fs = report["cwd"]
    free = human_size(fs["free_bytes"]) if fs["free_bytes"] is not None else "unknown"
    reflink = {True: "yes", False: "no", None: "unknown (cannot write here)"}[fs["reflink"]]
    lines.append(f"working directory: {fs['path']} on {fs['type'] or 'an unknown filesystem'}"
                 f" (mounted at {fs['mount'] or '?'}), {free} free, reflinks: {reflink}")
    for line in lines:
        out.print(line)
