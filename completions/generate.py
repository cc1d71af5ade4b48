"""Regenerate the shell completion scripts from the CLI itself.

    python completions/generate.py [OUT_DIR]

Runs ``python -m ckptctl`` with ``_CKPTCTL_COMPLETE=source_<shell>`` (Typer's public completion
protocol) and writes ``ckptctl.bash``, ``_ckptctl`` (zsh) and ``ckptctl.fish`` into OUT_DIR (default:
this directory). The scripts call back into ``ckptctl`` at completion time, so they only change
when Typer changes its templates; tests/test_completions.py diffs them against a fresh run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {"bash": "ckptctl.bash", "zsh": "_ckptctl", "fish": "ckptctl.fish"}


def render(shell: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("_CKPTCTL_COMPLETE")}
    env["_CKPTCTL_COMPLETE"] = f"source_{shell}"
    proc = subprocess.run([sys.executable, "-m", "ckptctl"], env=env, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise SystemExit(f"generating the {shell} script failed (exit {proc.returncode}):\n{proc.stderr}")
    return proc.stdout if proc.stdout.endswith("\n") else proc.stdout + "\n"


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for shell, name in SCRIPTS.items():
        path = out_dir / name
        path.write_text(render(shell), encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else HERE
    for path in generate(out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
