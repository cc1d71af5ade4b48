"""The Megatron-core ``torch_dist`` source kind: the ``--save`` root or an iteration folder
(``files``: finding it and reading ``common.pt`` as data; ``mapping``: the declarative tables per
family; ``config``: the arguments mapped to a family and config.json; ``source``: the chunks cut
into output tensors)."""
