"""The names other modules import from the writer; the code lives in ``ckptctl.write``.

Kept for the importers outside the writer's package (``ckptctl/__init__.py``, ``resave.py``,
``cli/resave_cmd.py``); new code imports from ``ckptctl.write.*`` directly.
"""

from __future__ import annotations

from ckptctl.write.inputs import Entry, entries_for
from ckptctl.write.job import ExportResult, write_checkpoint
from ckptctl.write.options import ExportOptions

__all__ = ["Entry", "ExportOptions", "ExportResult", "entries_for", "write_checkpoint"]
