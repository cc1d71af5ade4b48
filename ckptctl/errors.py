"""Error hierarchy for ckptctl.

Every expected failure is a :class:`CkptctlError` carrying a one-line message, a hint that names
the next thing to do, and the exit code the CLI uses. Nothing here imports typer or rich: the CLI
decides how to render an error, the core only describes it.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_OPERATIONAL = 3
EXIT_INTERRUPTED = 130
# A fatal signal handled like Ctrl-C exits with the shell's convention, 128 + the signal number:
# SIGHUP 129, SIGTERM 143. A closed stdout (``ckptctl inspect DIR | head -1``) exits 141
# (128 + SIGPIPE), quietly, as a process killed by SIGPIPE would.
EXIT_SIGNAL_BASE = 128
EXIT_BROKEN_PIPE = 141


class CkptctlError(Exception):
    """Base class: an expected failure with a message, a hint and an exit code."""

    exit_code = EXIT_OPERATIONAL
    code = "error"

    def __init__(self, message: str, hint: str | None = None, *, phase: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.phase = phase

    def __str__(self) -> str:
        if self.phase:
            return f"{self.message} (phase: {self.phase})"
        return self.message

    def to_dict(self) -> dict:
        return {
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
            "phase": self.phase,
            "exit_code": self.exit_code,
        }


class UsageError(CkptctlError):
    """Bad or conflicting arguments, or refusing to act without an explicit flag (exit 2)."""

    exit_code = EXIT_USAGE
    code = "usage"


class InputError(CkptctlError):
    """The input is missing, not a checkpoint, corrupt or unsafe (exit 2)."""

    exit_code = EXIT_USAGE
    code = "input"


class OperationalError(CkptctlError):
    """I/O, permission, disk full, lock held, publish rolled back (exit 3)."""

    exit_code = EXIT_OPERATIONAL
    code = "operational"


class LockHeldError(OperationalError):
    code = "lock_held"


class DiskFullError(OperationalError):
    code = "disk_full"


class UnrepairableError(CkptctlError):
    """A repair needs data that is not there; nothing was changed (exit 1)."""

    exit_code = EXIT_FINDINGS
    code = "unrepairable"


class Interrupted(CkptctlError):
    """The user pressed Ctrl-C (exit 130), or SIGTERM/SIGHUP arrived (exit 128 + the signal
    number: 143, 129); cleanup has run."""

    exit_code = EXIT_INTERRUPTED
    code = "interrupted"

    def by_signal(self, signum: int, name: str) -> Interrupted:
        """This interruption, caused by the signal ``signum`` (named ``name``, e.g. SIGTERM)."""
        self.exit_code = EXIT_SIGNAL_BASE + signum
        self.message = f"{name} received: {self.message}"
        return self


_FULL = {"ENOSPC": "no space left on the device", "EDQUOT": "no space left within the disk quota",
         "EFBIG": "no space left: the file size limit is reached"}


def from_oserror(exc: OSError, what: str, *, phase: str | None = None) -> CkptctlError:
    """Turn an OSError into a CkptctlError with a hint that fits its errno.

    The message is ``<what>: <what went wrong>[: <path>]`` (the path when the OSError names one).
    A file that is missing here was there when the command started (a missing input is refused
    up front, exit 2): it vanished mid-operation, an operational failure (exit 3)."""
    import errno

    err = exc.errno
    at = f": {exc.filename}" if exc.filename else ""
    reason = exc.strerror or str(exc)
    if getattr(exc, "input_problem", False):  # format.small: a FIFO, a device, a huge file
        return InputError(f"{what}: {reason}{at}", "replace it with the regular file it should be", phase=phase)
    if err == errno.ENOSPC and _out_of_inodes(exc.filename):
        return DiskFullError(
            f"{what}: no free inodes left on the device (there may be free space){at}",
            "remove files from that filesystem (or write to one with more inodes) and run the command again",
            phase=phase,
        )
    if err in (errno.EMFILE, errno.ENFILE):
        return OperationalError(
            f"{what}: too many open files{at}",
            "raise the limit of open files (ulimit -n) or close other programs' files, and run the command again",
            phase=phase,
        )
    if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DiskFullError(
            f"{what}: {_FULL[errno.errorcode[err]]}{at}",
            "free space on that filesystem (or raise the quota/file size limit) and run the command again",
            phase=phase,
        )
    if err in (errno.EACCES, errno.EPERM):
        return OperationalError(
            f"{what}: permission denied{at}",
            "check the permissions of that path and of its parent directory",
            phase=phase,
        )
    if err == errno.EROFS:
        return OperationalError(
            f"{what}: read-only filesystem{at}",
            "write to a writable location or remount the filesystem read-write",
            phase=phase,
        )
    if err == errno.ENOENT:
        return OperationalError(
            f"{what}: no such file or directory{at}",
            "another process removed or renamed it while this command ran; check the path and run again",
            phase=phase)
    if err == errno.EXDEV:
        return OperationalError(
            f"{what}: staging and destination are on different filesystems{at}",
            "the destination must not be a mount point; write to a directory inside it instead",
            phase=phase,
        )
    if err == errno.EIO:
        return OperationalError(
            f"{what}: I/O error ({reason}){at}",
            "the storage reported an error: check the device and system log; nothing was published",
            phase=phase,
        )
    return OperationalError(f"{what}: {reason}{at}", "check the path and the storage", phase=phase)


_FEW_INODES = 64
_SOME_BYTES = 1 << 20


def _out_of_inodes(filename: object) -> bool:
    """Whether the filesystem that holds ``filename`` (its nearest existing ancestor) counts inodes
    and has none left for us, or next to none while it has bytes free (the few a failed command
    freed when it cleaned up): then ENOSPC meant inodes, not bytes."""
    import os

    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    path = os.path.abspath(os.fsdecode(filename))
    while True:
        try:
            st = os.statvfs(path)
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return False
            path = parent
            continue
        few = st.f_favail < _FEW_INODES and st.f_bavail * st.f_frsize >= _SOME_BYTES
        return st.f_files > 0 and (st.f_favail == 0 or few)
