"""Cases, commands, and timing whole commands side by side.

A :class:`Case` is a list of :class:`Command` that run in the same invocation, interleaved round
by round and rotated (round 1: A B C, round 2: B C A, ...) so drift in the machine hits every
command alike and none is always the first of a round. Before every run, untimed: the command's
setup hook, ``sync`` (or dropping the page cache), and :func:`prefault`.

Each run is timed from fork to exit by ``spawn.py``; its peak RSS is the ``ru_maxrss`` that
``os.wait4`` returns for it, which Linux takes over the process and every descendant it waited
for: the largest single process of the tree (not the sum of processes alive at the same time).
It is never below the spawner's own RSS (:func:`rss_floor`, about 6.5 MiB).
"""

from __future__ import annotations

import mmap
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Hook = Callable[[], None]
CKPTCTL = [sys.executable, "-m", "ckptctl"]  # the package in this interpreter's environment
SPAWN = Path(__file__).with_name("spawn.py")
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.13 names it


@dataclass
class Command:
    """One command line. A ``str`` runs under ``sh -c`` (for globs); stdout goes to /dev/null.
    ``setup``/``teardown`` run around every timed run and are not timed; ``env``: variables set
    for it on top of the runner's environment. ``optional``: flags of its argv that an older
    revision may not know (``run.py --against`` drops them for a revision whose ``--help`` of the
    command does not list them, and says so)."""

    name: str
    argv: Sequence[str] | str
    setup: Hook | None = None
    teardown: Hook | None = None
    env: dict[str, str] | None = None
    optional: tuple[str, ...] = ()

    def args(self) -> list[str]:
        return ["sh", "-c", self.argv] if isinstance(self.argv, str) else list(self.argv)

    def display(self) -> str:
        return self.argv if isinstance(self.argv, str) else shlex.join(self.argv)


@dataclass
class Case:
    """Commands compared in one table. ``prepare`` runs once before the first round (generate
    inputs); ratios are relative to ``reference`` (default: the first command); ``prefault``
    bytes of memory are touched and freed before every run (see :func:`prefault`)."""

    name: str
    description: str
    commands: list[Command]
    prepare: Hook | None = None
    reference: str | None = None
    prefault: int = 256 << 20  # bytes a command may newly allocate (page cache it writes + RSS)

    def __post_init__(self) -> None:
        names = [c.name for c in self.commands]
        if len(set(names)) != len(names):
            raise ValueError(f"case {self.name}: duplicate command names")
        if self.reference is None:
            self.reference = names[0]
        elif self.reference not in names:
            raise ValueError(f"case {self.name}: reference {self.reference!r} is not one of its commands")


@dataclass
class Result:
    name: str
    command: str
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    peak_rss: int = 0  # bytes, max over rounds
    error: str | None = None
    ratio: float | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def to_dict(self) -> dict:
        return {"name": self.name, "command": self.command, "times_s": self.times, "cpu_s": self.cpu,
                "median_s": self.median, "min_s": min(self.times, default=None),
                "peak_rss_bytes": self.peak_rss, "ratio": self.ratio, "error": self.error}


def clear(*paths: Path) -> Hook:
    """A hook that removes files or directories (absent is fine) and creates their parents, so
    a command can create them afresh."""
    def hook() -> None:
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    return hook


def drop_caches() -> bool:
    """Write back and drop the page cache; False (and nothing done) when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def available_memory() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def prefault(size: int) -> None:
    """Touch ``size`` bytes of anonymous memory (at most half of what is available) and free it.

    On a VM whose balloon driver reports free pages to the host (Firecracker here, and many
    clouds), memory that has been free for a few seconds is handed back to the host, and the next
    touch of each page costs a host fault: writing 2 GB of page cache then takes 5-7x longer than
    right after other 2 GB were freed. Done untimed before every run, this gives each command the
    same start (recently used memory), whatever ran before it.
    """
    size = min(size, available_memory() // 2) // mmap.PAGESIZE * mmap.PAGESIZE
    if size <= 0:
        return
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
        try:
            m.madvise(MADV_POPULATE_WRITE)
        except OSError:  # kernel older than 5.14: one write per page
            for off in range(0, size, mmap.PAGESIZE):
                m[off] = 1


def measure(cmd: Command) -> tuple[float, float, int, int, str]:
    """Run once through ``spawn.py``: (wall s, cpu s, peak RSS bytes, exit status, stderr tail)."""
    with tempfile.TemporaryFile() as err:
        out = subprocess.run([sys.executable, "-I", "-S", str(SPAWN), *cmd.args()], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=err, check=True, text=True,
                             env={**os.environ, **cmd.env} if cmd.env else None).stdout
        err.seek(0)
        tail = err.read()[-2000:].decode(errors="replace")
    wall, cpu, rss, rc = out.split()
    return float(wall), float(cpu), int(rss), int(rc), tail


def rss_floor() -> int:
    """What a command that allocates nothing reports as peak RSS (the spawner's own size)."""
    return measure(Command("true", ["true"]))[2]


def run_case(case: Case, rounds: int, *, warmup: int = 0, drop: bool = False, prefault_bytes: int | None = None,
             log: Callable[[str], None] = print) -> list[Result]:
    """``warmup`` untimed rounds, then ``rounds`` timed ones; each round runs every command once,
    starting one command further than the round before."""
    if case.prepare:
        case.prepare()
    results = {c.name: Result(c.name, c.display()) for c in case.commands}
    hot = case.prefault if prefault_bytes is None else prefault_bytes
    for r in range(1 - warmup, rounds + 1):
        label = f"round {r}/{rounds}" if r > 0 else "warmup"
        shift = max(r - 1, 0) % len(case.commands)
        for cmd in case.commands[shift:] + case.commands[:shift]:
            res = results[cmd.name]
            if res.error:
                continue
            if cmd.setup:
                cmd.setup()
            if not (drop and drop_caches()):
                os.sync()  # earlier runs' dirty pages are not written back on this run's clock
            prefault(hot)
            try:
                wall, cpu, rss, rc, tail = measure(cmd)
            finally:
                if cmd.teardown:
                    cmd.teardown()
            if rc:
                res.error = f"exit {rc}: {tail.strip().splitlines()[-1] if tail.strip() else ''}"
                log(f"  {case.name} / {cmd.name}: FAILED ({res.error})")
                continue
            log(f"  {case.name} {label:<11} {cmd.name:<34} {wall:8.3f} s {rss / 2**20:8.1f} MiB")
            if r > 0:
                res.times.append(wall)
                res.cpu.append(cpu)
                res.peak_rss = max(res.peak_rss, rss)
    ref = results[case.reference].median
    for res in results.values():
        if ref and res.median is not None:
            res.ratio = res.median / ref
    return list(results.values())


def table(rows: list[tuple[Case, list[Result]]]) -> str:
    head = ("case", "command", "median s", "min s", "cpu s", "peak RSS MiB", "ratio")
    lines = []
    for case, results in rows:
        for r in results:
            if r.error:
                lines.append((case.name, r.name, "FAILED", "", "", "", r.error[:60]))
                continue
            ratio = f"{r.ratio:.2f}x" + (" (ref)" if r.name == case.reference else "") if r.ratio else "-"
            lines.append((case.name, r.name, f"{r.median:.3f}", f"{min(r.times):.3f}",
                          f"{statistics.median(r.cpu):.3f}", f"{r.peak_rss / 2**20:.1f}", ratio))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]

    def fmt(row: Sequence[str]) -> str:
        cells = (v.rjust(w) if 2 <= i <= 5 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, lines)])
