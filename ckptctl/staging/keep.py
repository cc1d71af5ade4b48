"""What a replaced destination keeps: the files that appeared in it (at any depth) while a new
version was being written, and its permissions (DESIGN I3: nothing of the user's lost; modes, group, setgid
and ACLs kept). :class:`ckptctl.publish.Stage` calls :func:`keep_permissions` when it seals and
:func:`carry_late` right after the publish."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ckptctl import _libc
from ckptctl.layout.model import named_slot
from ckptctl.staging.fs import moved as _was_moved, remove_tree, rename

KEPT_SUFFIX = ".ckptctl-kept"


def carry_late(old: Path, dest: Path, known: dict[str, int]) -> tuple[list[str], list[str]]:
    """Move from ``old`` (the previous version, just replaced) into ``dest`` (the new version), at
    every depth, what appeared in the destination while the new version was written, and what was
    replaced there meanwhile (a file an editor saved by rename: the new version carried its
    previous inode). ``known`` is the destination as :func:`entries` listed it when the plan was
    made (relative path -> inode): an entry with the same inode was there then, and the plan
    dropped or carried it; a folder that was there is looked into, since what is inside may be
    new. A new folder the new version has no entry for is moved whole.

    Where the new version has an entry of that name of its own (``config.json``), the user's is
    kept beside it as ``<name>.ckptctl-kept``; so is a late file of a weights family the new
    version writes in that folder (a stale shard, an old index): a loader never picks it. A name
    taken in the new version meanwhile is never replaced (``RENAME_NOREPLACE``). The walk is
    repeated (up to three passes) until it finds nothing more: a process that was creating a
    file in the old version at the instant of the publish is caught by the next pass. When the
    destination was a symbolic link (replaced as a link), ``old`` is that link: nothing is taken
    from its target.

    Returns (paths moved in, paths kept aside), relative to ``dest``. Raises OSError (with the
    path that failed) when something cannot be moved: the caller keeps ``old``."""
    moved: list[str] = []
    aside: list[str] = []
    if os.path.islink(old):
        return moved, aside  # the destination was a link: its target is not ours to move from
    for _ in range(_PASSES):
        done = len(moved) + len(aside)
        _merge(old, dest, "", known, moved, aside)
        if len(moved) + len(aside) == done:
            break
    return moved, aside


_PASSES = 3


def _merge(old: Path, new: Path, rel: str, known: dict[str, int], moved: list[str], aside: list[str]) -> None:
    """:func:`carry_late` for one folder: ``old`` (at ``rel`` in the previous version) into ``new``."""
    try:
        with os.scandir(old) as it:
            late = sorted((e.name, e.inode(), e.is_dir(follow_symlinks=False)) for e in it)
    except (FileNotFoundError, NotADirectoryError):
        return
    slots: set[tuple[str, str | None]] | None = None  # the weights families the new version writes here
    for name, ino, is_dir in late:
        path, src, dst = rel + name, old / name, new / name
        there = _lstat(dst)
        if there is not None and there.st_ino == ino:
            continue  # carried already (linked when the extras were written)
        if known.get(path) == ino:
            if is_dir and _is_dir(there):
                _merge(src, dst, path + "/", known, moved, aside)  # there before: its content may be new
            continue  # there when the plan listed it: dropped or carried by plan
        if not is_dir and named_slot(name) is not None:
            if slots is None:
                slots = _written_slots(new, rel, known)
            if named_slot(name) in slots:  # a stale file of a family we write: never under its own name
                aside.append(rel + _move_aside(src, new, name))
                continue
        if there is not None and there.st_ino == known.get(path) and not stat.S_ISDIR(there.st_mode):
            remove_tree(dst)  # we carried its previous inode: the user's is newer
            there = None
        if there is None:
            if _move(src, dst):
                moved.append(path)
                continue
            there = _lstat(dst)  # the name was taken in the new version meanwhile
        if is_dir and _is_dir(there):
            _merge(src, dst, path + "/", known, moved, aside)  # a folder the new version has too
        else:
            aside.append(rel + _move_aside(src, new, name))


def _written_slots(new: Path, rel: str, known: dict[str, int]) -> set[tuple[str, str | None]]:
    """The weights families (slots) that the new version wrote itself into the folder ``new``
    (``rel``): a file of one that is not an inode the destination had (a carried one)."""
    out = set()
    for name, ino in entries_at(new).items():
        slot = named_slot(name)
        if slot is not None and known.get(rel + name) != ino:
            out.add(slot)
    return out


def _move(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst`` unless ``dst`` exists (then False: nothing moved). Where the
    filesystem cannot refuse to replace (NFS), checked first, then renamed."""
    try:
        _libc.renameat2(os.fsencode(src), os.fsencode(dst), _RENAME_NOREPLACE)
        return True
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            if _was_moved(src, dst):
                return True  # done, its reply lost
            raise OSError(exc.errno, exc.strerror, str(src)) from None
    if os.path.lexists(dst):
        return False
    rename(src, dst)
    return True


_RENAME_NOREPLACE = 1


def _move_aside(src: Path, folder: Path, name: str) -> str:
    """Move ``src`` into ``folder`` as ``<name>.ckptctl-kept`` (or ``.2``, ...); returns that name."""
    while True:
        kept = free_name(folder, name + KEPT_SUFFIX)
        if _move(src, folder / kept):
            return kept


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _is_dir(st: os.stat_result | None) -> bool:
    return st is not None and stat.S_ISDIR(st.st_mode)


def entries(directory: Path) -> dict[str, int]:
    """Everything below ``directory`` at every depth, relative path (``logs/run.log``) -> inode,
    never following a link (``directory`` itself may be one) and never entering another
    filesystem; {} when it does not exist. The destination as the plan saw it: what is new or
    replaced below it at publish time is carried then (:func:`carry_late`)."""
    try:
        root_dev = os.stat(directory).st_dev
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out: dict[str, int] = {}
    stack = [("", directory)]
    while stack:
        rel, folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                for e in it:
                    out[rel + e.name] = e.inode()
                    if e.is_dir(follow_symlinks=False) and e.stat(follow_symlinks=False).st_dev == root_dev:
                        stack.append((rel + e.name + "/", folder / e.name))
        except (FileNotFoundError, NotADirectoryError):
            if not rel:
                return {}
        except OSError:
            if not rel:
                raise
            # a folder we cannot list (mode 0, another user's): it is recorded by its inode; what
            # is inside it is the plan's to carry (and its error to report), never guessed here
    return out


def entries_at(directory: Path) -> dict[str, int]:
    """One directory's entries, name -> inode (never following a link); {} when it does not exist."""
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
