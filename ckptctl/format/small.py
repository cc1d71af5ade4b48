"""Bounded reads of small files (config.json, tokenizer files, owner records, manifests).

Checkpoint trees are shared: a neighbour may put a FIFO, a device or a link to ``/dev/zero``
where a small file is expected. Every small file is read here, and so:

- it is opened ``O_NONBLOCK`` (opening a FIFO never waits for a writer) and, unless the caller
  follows links on purpose (a Hugging Face cache snapshot is made of links into ``blobs/``),
  ``O_NOFOLLOW``;
- it must be a regular file, checked before the open (a device is not even opened) and again on
  the open descriptor: anything else is :class:`NotRegularFile`;
- at most ``limit`` bytes are read: a larger file is :class:`TooLarge`, whatever its size
  claims (a file that grows while it is read is caught too);
- JSON nested deeper than the parser's recursion allows is :class:`TooDeep` (a ``ValueError``),
  a clear error instead of a ``RecursionError`` traceback.

Both errors are ``OSError`` subclasses (callers already handle an unreadable file) that
:func:`ckptctl.errors.from_oserror` reports as input errors (exit 2): the file is not what its
name says.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

DEFAULT_LIMIT = 64 << 20  # bytes; config/tokenizer files of real models are below 40 MB

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link"}


class NotRegularFile(OSError):
    """The path is a FIFO, a device, a socket, a directory or (not following links) a link."""

    input_problem = True


class TooLarge(OSError):
    """The file holds more than the reader's limit."""

    input_problem = True


class TooDeep(ValueError):
    """A JSON document nested deeper than the parser can follow."""


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _not_regular(path: str, mode: int) -> NotRegularFile:
    return NotRegularFile(errno.EINVAL, f"not a regular file ({_kind(mode)})", path)


def open_small(path: str | os.PathLike[str], *, follow: bool = False, dir_fd: int | None = None) -> int:
    """An fd of ``path`` opened read-only without blocking, checked to be a regular file."""
    p = os.fspath(path)
    st = os.stat(p, dir_fd=dir_fd, follow_symlinks=follow)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(p, st.st_mode)
    try:
        fd = os.open(p, _FLAGS | (0 if follow else os.O_NOFOLLOW), dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise _not_regular(p, stat.S_IFLNK) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped between the stat and the open
        os.close(fd)
        raise _not_regular(p, mode)
    return fd


def read_small(path: str | os.PathLike[str], *, limit: int = DEFAULT_LIMIT, follow: bool = False,
               dir_fd: int | None = None) -> bytes:
    """The bytes of a small regular file: at most ``limit``, else :class:`TooLarge`."""
    fd = open_small(path, follow=follow, dir_fd=dir_fd)
    try:
        chunks, got = [], 0
        while True:
            chunk = os.read(fd, min(limit + 1 - got, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if got > limit:
                raise TooLarge(errno.EINVAL, f"larger than {limit:,} bytes, too large for this file",
                               os.fspath(path))
    finally:
        os.close(fd)
    return b"".join(chunks)


def loads(raw: bytes | str, **kwargs: Any) -> Any:
    """``json.loads``; a document nested too deeply is :class:`TooDeep` (a ``ValueError``)."""
    try:
        return json.loads(raw, **kwargs)
    except RecursionError:
        raise TooDeep("JSON nested too deeply to parse") from None


def read_json(path: str | os.PathLike[str], *, limit: int = DEFAULT_LIMIT, follow: bool = False,
              dir_fd: int | None = None, **kwargs: Any) -> Any:
    """A small JSON file, parsed. Raises OSError (unreadable, not regular, too large) or
    ValueError (not UTF-8, not JSON, too deep)."""
    return loads(read_small(path, limit=limit, follow=follow, dir_fd=dir_fd), **kwargs)
