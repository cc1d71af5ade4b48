"""``gc-tmp``: find what dead writers left below some roots, prove it dead, and remove it safely.

``scan`` finds and measures candidates, ``judge`` decides each one, ``remove`` acts; ``model``
holds the option, candidate and result types and the :class:`Decision` enum (its values are the
strings of the JSON output).

Two kinds of candidates:

- **ours**: a directory named like a ckptctl staging directory (``format.names.parse_staging_name``)
  whose state (:func:`ckptctl.staging.inspect`) is not ``NOT_OURS``: a valid ckptctl owner record,
  or an empty stub. Removed when its writer is dead: the lock is free and, on this host, the pid is
  gone, reused, a zombie or from before the last reboot. An owner on another host is judged by the
  lock and ``older_than``. A half-done exchange-less publish inside is rolled forward or back
  (:func:`ckptctl.staging.recover`, as the state says) before anything goes.
- **foreign**: an entry whose *name* matches an opt-in preset (``format.names.LEFTOVERS``: each
  preset matches files or directories) or ``--pattern`` glob (any entry). Judged by age (the
  newest mtime in its tree), since nothing proves its writer dead, and kept whatever its age while
  a running process holds it (or, for a directory, a file in it) open or works in it
  (``staging.open_elsewhere`` over ``/proc/*/fd``): a huggingface_hub download still writing its
  ``*.incomplete`` blob, a Trainer still saving into ``tmp-checkpoint-N``.

A ``_tmp_*`` directory without a valid owner record is not ours (Orbax #394: never delete by "no
marker"); it is listed as ``unknown`` and kept unless a foreign pattern (``--preset miles``) takes it.
The one exception is an empty *stub* (nothing inside but empty ``lock``/``owner.json``: a writer
killed between ``mkdir`` and its owner record): it holds no data, so it goes once its lock is
free and it is older than ``min_age``. A writer creates its staging directory under a hidden name
(``.`` + the name) and renames it visible once its lock is held and its owner record written, so
a visible stub is never a writer starting; a hidden one is kept for ``HIDDEN_GRACE`` (1 h)
whatever ``min_age``. A staging-named directory that cannot be read is kept and reported (exit 3).

Safety: the scan never follows a symlink nor descends into a candidate; removal works on
directory file descriptors opened with ``O_NOFOLLOW`` from the root down, so it cannot leave the
root even if a path component is swapped for a symlink meanwhile. A staging directory is removed
under its own lock (a second gc run and the writer cannot race it), owner record last so that an
interrupted removal stays recognisable. NFS ``.nfsXXXX`` files still open elsewhere are retried,
then the candidate is *deferred* to the next run. An error on one entry is recorded and the scan
goes on. Nothing here prints; the CLI renders :class:`GcResult`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable

from ckptctl.errors import UsageError
from ckptctl.format.names import PRESETS
from ckptctl.gc.judge import format_age
from ckptctl.gc.model import Candidate, Decision, GcOptions, GcProblem, GcResult, Kind, Progress
from ckptctl.gc import remove, scan
from ckptctl.gc.scan import check_pattern, check_preset, check_root

__all__ = [
    "PRESETS", "Candidate", "Decision", "GcOptions", "GcProblem", "GcResult", "Kind", "Progress",
    "check_pattern", "check_preset", "check_root", "format_age", "run",
]


def run(roots: Iterable[str | os.PathLike[str]], opts: GcOptions | None = None,
        progress: Progress | None = None) -> GcResult:
    """Validate the roots, scan, and (unless ``opts.dry_run``) remove. Raises UsageError for bad
    roots or options; every other problem is recorded in the result."""
    opts = opts or GcOptions()
    if opts.max_depth < 1:
        raise UsageError(f"--max-depth must be at least 1 (got {opts.max_depth})", "use --max-depth 1 or more")
    if opts.older_than < 0 or opts.min_age < 0:
        raise UsageError("--older-than and --min-age must not be negative", "use e.g. --older-than 1h")
    for p in opts.presets:
        check_preset(p)
    for g in opts.patterns:
        check_pattern(g)
    checked: list[Path] = []
    for r in roots:
        p = check_root(r)
        if p not in checked:
            checked.append(p)
    if not checked:
        raise UsageError("no root given", "pass the directory that holds your checkpoints")
    started = time.monotonic()
    res = scan.scan(checked, opts)
    if not opts.dry_run:
        remove.remove(res, progress)
    res.seconds = time.monotonic() - started
    return res
