"""The Megatron-core ``torch_dist`` source kind: the ``--save`` root or an iteration folder
(``locate``: the cheap probe, the tracker; ``files``: reading ``common.pt`` as data; ``mapping``:
the declarative tables per family; ``config``: the arguments mapped to a family and config.json
(``config_v3``: the DeepSeek-V3 and GLM-4.5 families; ``config_hf``: ``--config`` for a checkpoint
without arguments); ``source``: the chunks cut into output tensors)."""
