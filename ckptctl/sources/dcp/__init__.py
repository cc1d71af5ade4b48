"""torch distributed checkpoint source kinds: DCP (``source``: ``.metadata`` and its ``.distcp``
files; ``chunks``: a chunk's bytes inside its embedded archive) and DCP-HF (``hf``: torch's
HuggingFaceStorageWriter ``sharded/`` output, read from each shard's ``DCP_SHARDING_INFO``)."""
