"""What a replaced destination keeps: the files that appeared in it while a new version was
being written, and its permissions (DESIGN I3: nothing of the user's lost; modes, group, setgid
and ACLs kept). :class:`ckptctl.publish.Stage` calls :func:`keep_permissions` when it seals and
:func:`carry_late` right after the publish."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ckptctl.staging.fs import remove_tree, rename

KEPT_SUFFIX = ".ckptctl-kept"


def carry_late(old: Path, dest: Path, known: dict[str, int]) -> tuple[list[str], list[str]]:
    """Move from ``old`` (the previous version, just replaced) into ``dest`` (the new version) what
    appeared in the destination while the new version was written, and what was replaced there
    meanwhile (a file an editor saved by rename: the new version carried its previous inode).
    ``known`` is the destination as it was when staging began (name -> inode): an entry with the
    same inode was there then, and the plan dropped or carried it. When the destination was a
    symbolic link (replaced as a link), ``old`` is that link: nothing is taken from its target. Where the new version has an
    entry of that name of its own, the user's is kept beside it as ``<name>.ckptctl-kept``.

    Returns (names moved in, names kept aside). Raises OSError (with the path that failed) when
    something cannot be moved: the caller keeps ``old``."""
    moved: list[str] = []
    aside: list[str] = []
    if os.path.islink(old):
        return moved, aside  # the destination was a link: its target is not ours to move from
    for name, ino in sorted(entries(old).items()):
        if known.get(name) == ino:
            continue  # there when we began: dropped or carried by plan
        src, dst = old / name, dest / name
        try:
            there = os.lstat(dst)
        except FileNotFoundError:
            there = None
        if there is not None and there.st_ino == ino:
            continue  # carried already (linked when the extras were written)
        if there is not None and there.st_ino == known.get(name):
            remove_tree(dst)  # we carried its previous inode: the user's is newer
            there = None
        if there is None:
            rename(src, dst)
            moved.append(name)
        else:
            kept = free_name(dest, name + KEPT_SUFFIX)
            rename(src, dest / kept)
            aside.append(kept)
    return moved, aside


def entries(directory: Path) -> dict[str, int]:
    """A directory's entries, name -> inode (never following a link); {} when it does not exist."""
    try:
        with os.scandir(directory) as it:
            return {e.name: e.inode() for e in it}
    except (FileNotFoundError, NotADirectoryError):
        return {}


def free_name(directory: Path, name: str) -> str:
    """``name``, or ``name.2``, ``name.3``, ... : the first that ``directory`` does not hold."""
    candidate, n = name, 1
    while os.path.lexists(directory / candidate):
        n += 1
        candidate = f"{name}.{n}"
    return candidate


_ACLS = ("system.posix_acl_access", "system.posix_acl_default")
_NO_ACL = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)


def keep_permissions(old: Path, new: Path) -> None:
    """Give ``new`` (the staged version) and each of its directories the permissions of the same
    directory in ``old`` (the destination it replaces), where ``old`` has one: owner and group
    where permitted, the mode with its setgid/sticky bits, and the POSIX ACLs (access and
    default). A team's 2775 directory stays 2775 with its group; a carried 0700 folder stays
    0700. Files are hard-linked (their own inode, their own permissions) or written fresh."""
    if not os.path.isdir(old):
        return
    for root, dirs, _files in os.walk(new):
        rel = os.path.relpath(root, new)
        was = old if rel == "." else old / rel
        try:
            st = os.stat(was, follow_symlinks=rel == ".")  # the destination may be a link to its directory
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        _copy_permissions(was, st, Path(root), follow=rel == ".")
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]


def _copy_permissions(was: Path, st: os.stat_result, to: Path, *, follow: bool) -> None:
    try:
        os.chown(to, st.st_uid, st.st_gid)
    except PermissionError:
        try:
            os.chown(to, -1, st.st_gid)  # a member of the group may give it the group
        except PermissionError:
            pass  # ownership only where permitted
    os.chmod(to, stat.S_IMODE(st.st_mode))  # after chown, which clears setgid
    for name in _ACLS:
        try:
            value = os.getxattr(was, name, follow_symlinks=follow)
        except OSError as exc:
            if exc.errno in _NO_ACL:
                continue
            raise
        os.setxattr(to, name, value)
