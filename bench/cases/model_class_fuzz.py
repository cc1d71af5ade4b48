"""The full sweep of the model-class box's fuzz (issue 44; tests/box_fuzz.py, whose sample runs
in tests/test_verify_class_box.py): every model type the installed transformers registers and
every diffusers model class with a config, each with one seeded hostile value, through one
``ckptctl verify --json`` with a recorder of socket connections. The command exits 1 when the run
hung past its deadline, wrote no parsable document, holds an error finding the box caused, or
tried a connection (its output lists them: ``python -m tests.box_fuzz DIR --all``)."""

from __future__ import annotations

import shutil
import sys

from bench.gen import WORK
from bench.harness import Case, Command

ROOT = WORK / "out" / "box-fuzz"


def _clear() -> None:
    shutil.rmtree(ROOT, ignore_errors=True)


CASES = [
    Case("model-class-fuzz", "verify's model-class box under hostile config values: every transformers model type "
         "and diffusers class with a config, one verify run",
         [Command("fuzz, full sweep", [sys.executable, "-m", "tests.box_fuzz", str(ROOT), "--all"], setup=_clear)]),
]
