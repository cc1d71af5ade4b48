"""Mount the test FUSE filesystem (``fs.py``) in a real process, drive its switches, unmount it.

::

    with mounted(tmp_path, refuse_rename_flags=True, silly="nfs", cache=60) as m:
        ...  # m.mnt is the mount point, m.backing what is really stored
        m.lose_reply(src="ckpt", dst="old")  # the next matching rename is done, then answers EIO
        assert m.faults("lost-reply")

The filesystem is a separate process (``python tests/fusefs/fs.py``); unmounting is
``fusermount3 -u``. :class:`MountRefused` is raised only when the kernel or the sandbox refuses
the mount (no ``/dev/fuse``, no ``fusermount3``, permission denied): tests skip with its reason.
Any other failure to mount is an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

FS = Path(__file__).resolve().with_name("fs.py")
_REFUSED = ("fuse: device not found", "failed to open /dev/fuse", "Operation not permitted", "Permission denied",
            "fusermount3: mount failed", "fuse: failed to exec fusermount3", "No such file or directory: 'fusermount3'")


class MountRefused(RuntimeError):
    """The system does not let us mount a FUSE filesystem here."""


def mounted_fstype(path: Path) -> str | None:
    """The filesystem type ``/proc/self/mountinfo`` shows for the mount point ``path``."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) > 4 and fields[4].replace("\\040", " ") == str(path):
                return right.split()[0]
    return None


class FuseMount:
    def __init__(self, base: Path, *, refuse_rename_flags: bool = True, silly: str = "nfs", cache: float = 0.0,
                 subtype: str = "ckptfuse") -> None:
        self.base = base
        self.backing = base / "backing"
        self.mnt = base / "mnt"
        self.control = base / "control.json"
        self.log = base / "faults.jsonl"
        self.subtype = subtype
        self.argv = [sys.executable, str(FS), str(self.backing), str(self.mnt), "--silly", silly,
                     "--cache", str(cache), "--subtype", subtype, "--control", str(self.control),
                     "--log", str(self.log)] + (["--refuse-rename-flags"] if refuse_rename_flags else [])
        self.proc: subprocess.Popen | None = None
        self._stderr = base / "fs.stderr"

    def start(self, timeout: float = 30.0) -> FuseMount:
        if not os.path.exists("/dev/fuse"):
            raise MountRefused("no /dev/fuse in this environment")
        if shutil.which("fusermount3") is None:
            raise MountRefused("fusermount3 is not installed (apt-get install fuse3)")
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        err = open(self._stderr, "wb")
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        finally:
            err.close()
        deadline = time.monotonic() + timeout
        while mounted_fstype(self.mnt) is None:
            if self.proc.poll() is not None:
                text = self._stderr.read_text(errors="replace")
                if any(s in text for s in _REFUSED):
                    raise MountRefused(f"mounting FUSE is refused here: {text.strip()[-300:]}")
                raise RuntimeError(f"the test FUSE filesystem exited ({self.proc.returncode}): {text[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the test FUSE filesystem did not mount within {timeout}s")
            time.sleep(0.02)
        return self

    def lose_reply(self, *, src: str = "*", dst: str = "*", times: int = 1) -> None:
        """The next ``times`` renames whose base names match are performed, then answered EIO."""
        self._add_rule("lost_reply", src, dst, times)

    def fail_rename(self, *, src: str = "*", dst: str = "*", times: int = 1) -> None:
        """The next ``times`` renames whose base names match are answered EIO and not performed."""
        self._add_rule("fail", src, dst, times)

    def _add_rule(self, kind: str, src: str, dst: str, times: int) -> None:
        doc = json.loads(self.control.read_text()) if self.control.exists() else {}
        doc.setdefault(kind, []).append({"src": src, "dst": dst, "times": times})
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.control)

    def faults(self, kind: str | None = None) -> list[dict]:
        """The faults the filesystem injected so far (``kind``: lost-reply, rename-failed,
        rename-flags-refused, silly-rename)."""
        if not self.log.exists():
            return []
        events = [json.loads(line) for line in self.log.read_text().splitlines() if line]
        return [e for e in events if kind is None or e["fault"] == kind]

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        while mounted_fstype(self.mnt) is not None:
            r = subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True, text=True)
            if r.returncode == 0:
                break
            if time.monotonic() > deadline:  # still busy: detach it, the process exits when released
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
                break
            time.sleep(0.1)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@contextlib.contextmanager
def mounted(base: Path, **opts) -> Iterator[FuseMount]:
    m = FuseMount(base, **opts).start()
    try:
        yield m
    finally:
        m.stop()
