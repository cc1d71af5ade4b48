"""Cases run for the working tree and for another git revision side by side (``run.py --against``).

A revision is checked out into ``work/rev-<sha>`` (``git worktree add --detach``) for the run and
removed after it (``--keep-checkout`` keeps it, and a kept one is reused while it stays at that
commit). Before a case runs, both trees' ``ckptctl`` packages are compiled
with :mod:`compileall`, so both run from bytecode as an installed package does, whatever
``PYTHONDONTWRITEBYTECODE`` says (compileall writes the ``.pyc`` files regardless; a file edited
later is only recompiled, never written, by a process that has that variable set).

Every command of a case that runs ckptctl (``python -m ckptctl``, or Python code importing it) is
run twice per round, once per tree, with ``PYTHONPATH`` at that tree and ``PYTHONSAFEPATH=1`` (so
the current directory, prepended by ``python -m``, cannot put the other tree first; the editable
install's finder comes after ``PYTHONPATH``). The other commands (``cp``, the raw scan) run once
per round. All of them are interleaved and rotated round by round as any case's commands are.
:func:`compare_table` prints, per command, both medians, both ratios to the case's reference (each
tree's own, where the reference runs ckptctl too), their difference and the time ratio.
"""

from __future__ import annotations

import compileall
import os
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.gen import WORK
from bench.harness import Case, Command, Result

ROOT = Path(__file__).resolve().parents[1]  # the working tree this bench belongs to
TREE = "tree"  # the working tree's label


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str) -> tuple[str, Path]:
    """(short sha, path) of a detached worktree of ``rev`` under ``work/``, made or reused."""
    try:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"error: {rev!r} is not a revision of {ROOT}: {exc.stderr.strip()}") from None
    short = sha[:7]
    path = WORK / f"rev-{short}"
    if path.is_dir():
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0 and head.stdout.strip() == sha:
            return short, path
        _git("worktree", "remove", "--force", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    _git("worktree", "prune")
    _git("worktree", "add", "--detach", str(path), sha)
    return short, path


def remove(path: Path) -> None:
    """Remove a checkout made by :func:`checkout` (``git worktree remove``): a tree of another
    revision's sources left under ``work/`` would be read by whatever walks the repository's
    ``bench/`` folder for Python files (tests/test_layering.py does)."""
    _git("worktree", "remove", "--force", str(path))


def compile_tree(root: Path) -> None:
    """Bytecode for every module of ``root/ckptctl`` (only what changed is compiled again)."""
    if not compileall.compile_dir(str(root / "ckptctl"), quiet=1, workers=1):
        raise SystemExit(f"error: compileall failed under {root / 'ckptctl'}")


def runs_ckptctl(cmd: Command) -> bool:
    text = cmd.display()
    return "-m ckptctl" in text or "from ckptctl" in text or "import ckptctl" in text


def tree_env(root: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}


def _knows(root: Path, argv: Sequence[str], flag: str, seen: dict[tuple[Path, str], str]) -> bool:
    """Whether ``--help`` of the ckptctl subcommand in ``argv`` lists ``flag`` in tree ``root``."""
    sub = argv[argv.index("ckptctl") + 1]
    if (root, sub) not in seen:
        seen[root, sub] = subprocess.run([*argv[:argv.index("ckptctl") + 1], sub, "--help"], capture_output=True,
                                         text=True, env={**os.environ, **tree_env(root), "COLUMNS": "200"}).stdout
    return flag in seen[root, sub]


def side_by_side(case: Case, trees: Sequence[tuple[str, Path]], notes: list[str] | None = None) -> Case:
    """``case`` with each ckptctl command once per tree (``label: name``), the others once. A
    command's ``optional`` flags are dropped for a tree that does not know them (a line in
    ``notes`` says so)."""
    commands: list[Command] = []
    helps: dict[tuple[Path, str], str] = {}
    for cmd in case.commands:
        if not runs_ckptctl(cmd):
            commands.append(cmd)
            continue
        for label, root in trees:
            argv = cmd.argv
            for flag in cmd.optional:
                assert not isinstance(argv, str), "optional flags need an argv list"
                if flag in argv and not _knows(root, argv, flag, helps):
                    argv = [a for a in argv if a != flag]
                    if notes is not None:
                        notes.append(f"{label}: {cmd.name}: run without {flag} (its --help does not list it)")
            commands.append(replace(cmd, name=f"{label}: {cmd.name}", argv=argv,
                                    env={**(cmd.env or {}), **tree_env(root)}))
    ref = case.reference
    if ref not in {c.name for c in commands}:
        ref = f"{TREE}: {ref}"
    prepare = case.prepare

    def prepare_both() -> None:
        for _, root in trees:
            compile_tree(root)
        if prepare:
            prepare()

    return Case(case.name, case.description, commands, prepare=prepare_both, reference=ref, prefault=case.prefault)


def compare_table(rows: list[tuple[Case, list[Result]]], rev: str) -> str:
    """Per command run by both trees: medians, ratios to the reference, difference, tree / rev."""
    head = ("case", "command", f"{rev} s", f"{TREE} s", f"{rev} ratio", f"{TREE} ratio", "difference",
            f"{TREE}/{rev}")
    lines: list[tuple[str, ...]] = []
    for case, results in rows:
        by = {r.name: r for r in results}
        for r in results:
            if not r.name.startswith(f"{TREE}: "):
                continue
            base = r.name.removeprefix(f"{TREE}: ")
            other = by.get(f"{rev}: {base}")
            if other is None:
                continue
            cells = [case.name, base]
            if r.error or other.error or not r.times or not other.times:
                lines.append((*cells, "FAILED" if other.error else "", "FAILED" if r.error else "", "", "", "", ""))
                continue
            assert case.reference is not None
            ratios = []
            for label, res in ((rev, other), (TREE, r)):
                ref = by.get(case.reference.replace(f"{TREE}: ", f"{label}: ", 1)) or by[case.reference]
                ratios.append(res.median / ref.median if ref.times else None)
            a, b = statistics.median(other.times), statistics.median(r.times)
            ra, rb = ratios
            lines.append((*cells, f"{a:.3f}", f"{b:.3f}", _x(ra), _x(rb),
                          f"{rb - ra:+.2f}x" if ra is not None and rb is not None else "-", f"{b / a:.2f}"))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if i >= 2 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def environment_note() -> str:
    return (f"{TREE} = {ROOT} (PYTHONPATH), PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}; "
            "both compiled with compileall")
