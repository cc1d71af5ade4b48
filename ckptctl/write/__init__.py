"""Writing a checkpoint, as one straight pipe (DESIGN.md section 2).

- ``options``: :class:`~ckptctl.write.options.ExportOptions` as given, validated up front into
  :class:`~ckptctl.write.options.ExportSettings` before anything touches the filesystem.
- ``inputs``: what is written: :class:`~ckptctl.write.inputs.Entry` per tensor and the
  :class:`~ckptctl.write.inputs.ExportInputs` value (entries, options, extras, aliases).
- ``job``: :class:`~ckptctl.write.job.ExportJob`, the steps plan, stage, write, finalize, publish
  (run in one process by :func:`~ckptctl.write.job.write_inputs`, across ranks by
  ``ckptctl.distributed``).
- ``shards``: the bytes of one shard: creating the file (header + data area), placing tensors
  (kernel copy or bounded chunks), linking unchanged files.
- ``superseded``: what the destination's old version loses and keeps.
- ``extras``: the small files written beside the weights (config.json follows ``--dtype``).
"""
