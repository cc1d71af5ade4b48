"""Screening and scanning a directory: what must never be opened is taken out of the directory's view before
``layout.scan`` sees it, and reported once.

Out of view: links that resolve outside the checkpoint (``dir.symlink_escape``), dangling links
(``dir.broken_link``), and FIFOs, sockets, devices, or directories under weights names
(``dir.not_a_file``: opening a FIFO would block forever). A Hugging Face cache snapshot may link
into its repo's ``blobs/`` (:func:`~ckptctl.verify.context.allowed_root`).
"""

from __future__ import annotations

import os
import stat

from ckptctl import layout as L
from ckptctl.errors import CkptctlError
from ckptctl.findings import ERROR
from ckptctl.format import names as N
from ckptctl.verify.context import Context, within

_REPLACE = "replace it with the file it should be"


def _harmless(name: str, mode: int) -> bool:
    """A regular file, or a directory whose name no loader takes for weights."""
    return stat.S_ISREG(mode) or (stat.S_ISDIR(mode) and not N.is_weights_like(name))


def screen(ctx: Context) -> None:
    """One ``lstat`` per entry: what must not be opened is hidden and reported; a regular file's
    ``lstat`` is kept as its ``stat`` (:meth:`Context.stat`), and every entry left in view is
    known to stay inside the checkpoint (:meth:`Context.inside`) when the directory itself is (a
    component folder may be a link)."""
    vetted = ctx.vetted if within(os.path.realpath(ctx.root), ctx.allowed) else set()
    for n in ctx.names:
        p = ctx.root / n
        try:
            st = os.lstat(p)
        except OSError:
            continue  # gone since listdir: layout will not find it either
        if not stat.S_ISLNK(st.st_mode):
            if not _harmless(n, st.st_mode):
                ctx.hidden.add(n)
                what = "directory" if stat.S_ISDIR(st.st_mode) else "special file"
                ctx.not_a_file(n, f"is a {what}, not a regular file; not opened", _REPLACE)
                continue
            if stat.S_ISREG(st.st_mode):
                ctx.stats[n] = st
            vetted.add(n)
            continue
        real = os.path.realpath(p)
        if not within(real, ctx.allowed):
            ctx.escaped(n, f"is a symlink to {real}")
        elif not os.path.exists(p):
            ctx.hidden.add(n)
            ctx.add("dir.broken_link", ERROR, ctx.disp(n), f"{ctx.disp(n)} is a dangling symlink",
                    "restore its target or remove the link")
        elif not _harmless(n, os.stat(p).st_mode):
            ctx.hidden.add(n)
            ctx.not_a_file(n, "links to something that is not a regular file; not opened", _REPLACE)
        else:
            vetted.add(n)


def scan_directory(ctx: Context) -> None:
    """List the directory, screen it, and let ``layout.scan`` describe what is left in view (a
    pipeline step that always runs: a directory that cannot be listed stops the pipeline)."""
    try:
        ctx.names = sorted(os.listdir(ctx.root))
    except OSError as exc:
        ctx.stop("", exc)
        return None
    screen(ctx)
    try:
        ctx.layout = L.scan(ctx.root, names=[n for n in ctx.names if n not in ctx.hidden], reading=ctx.reading)
    except CkptctlError as exc:
        ctx.stop("", exc)
    return None
