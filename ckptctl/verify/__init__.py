"""``verify``: every check of a checkpoint path, returned as a :class:`Report` of findings.

A pipeline of checks over the ``Layout`` that :func:`ckptctl.layout.scan` makes of a directory
(codes are documented in ``docs/VERIFY_CODES.md``):

* ``screen``: links that resolve outside the checkpoint, dangling links and special files are
  taken out of view (never opened) before layout sees the directory; layout's findings are
  passed through;
* ``weights``: every rule of :mod:`ckptctl.format.header` on every safetensors file, plus dtype
  notes; pickles statically (``pickles``); tensors stored twice; ``--max-shard-size``;
* ``index``: the index against the shard headers in both directions, shard numbering,
  ``total_size``/``total_parameters``, alias records;
* ``dcp``: DCP metadata (allow-list reader) against its storage files;
* ``model-class``: the library's own class built on the meta device and its loader's key matching
  (:mod:`ckptctl.verify.classes`; not with ``--static``);
* ``model`` and ``peft``: config.json and adapter_config.json against the tensors;
* ``consistency``: what no loader reports (generation config, added tokens, placeholders, a
  Trainer folder without the model, sentence-transformers dimensions, a ``.bin`` copy);
* ``manifest``: the ckptctl manifest (sizes; with ``deep`` also sha256);
* ``deep``: every byte read once, hashed, floats checked.

Every path's result lists the check groups that ran and those that did not, with why
(:class:`Checks`, ``PathResult.checks``).

Nothing here prints: progress goes to an optional callback. torch is imported for DCP directories
and by the model-class check; with ``--static``, or without transformers/diffusers installed,
safetensors checkpoints (with or without ``deep``) and ``.bin`` files never import it.
"""

from ckptctl.verify.context import ProgressFn, VerifyOptions
from ckptctl.verify.pipeline import discover, verify_path, verify_paths
from ckptctl.verify.report import SCHEMA_VERSION, Checks, FileRecord, PathResult, Report

__all__ = ["SCHEMA_VERSION", "Checks", "FileRecord", "PathResult", "ProgressFn", "Report", "VerifyOptions", "discover",
           "verify_path", "verify_paths"]
