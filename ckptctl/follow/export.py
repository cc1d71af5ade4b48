"""One save exported as a plain ``ckptctl export SAVE DEST`` would, pinned to the files it had.

The sources pin every file they read (a file replaced or rewritten while it is read is
``changed``, exit 3). The follower pins the whole save besides: just before the publish (the
export job's ``check``), the save's fingerprint (every file's size and time, the listing) must be
the one its completion was judged on; a file added, removed or touched anywhere in it, or the
save deleted, raises :class:`SaveChanged` and nothing is published.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ckptctl.errors import OperationalError
from ckptctl.follow.saves import Fingerprint, fingerprint
from ckptctl.write.options import ExportOptions


class SaveChanged(OperationalError):
    """The save changed (or went) while it was exported: nothing was published."""


def pin(path: Path, expect: Fingerprint) -> Callable[[Path], None]:
    """The export job's check: ``path`` still holds exactly the files ``expect`` lists."""

    def check(_staged: Path) -> None:
        try:
            now = fingerprint(path)
        except FileNotFoundError:
            raise SaveChanged(f"{path} was deleted while it was exported; nothing was published",
                              "the trainer removed it (save_total_limit, save_retain_interval?)") from None
        except OSError as exc:
            raise SaveChanged(f"{path} cannot be read any more ({exc.strerror or exc}); nothing was published",
                              "check the source directory") from None
        if now.digest != expect.digest:
            raise SaveChanged(f"{path} changed while it was exported; nothing was published",
                              "the trainer was still writing it: it is exported again once complete")

    return check


def export_save(src: Path, dest: Path, opts: ExportOptions, *, key: str | None, only: str | None,
                check: Callable[[Path], None]):
    """``api.export(src, dest)`` with ``check`` run on the staged version before the publish.
    A multi-component root (a diffusers pipeline) is exported by ``export_root``, which takes no
    check: its pin is the sources' own."""
    from ckptctl.api import export_checked

    return export_checked(src, dest, opts, key=key, only=only, check=check)
