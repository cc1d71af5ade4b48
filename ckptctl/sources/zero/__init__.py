"""The DeepSpeed ZeRO source kind: a root with ``latest`` or a ``global_stepN/`` folder, its fp32
master weights rebuilt from every rank's files (``files``: the rank files read as data;
``layout``: where each parameter lies in them; ``source``: the checkpoint and the source;
``convert``: fp32 to bf16/fp16)."""
