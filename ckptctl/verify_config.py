"""Old import path, kept only while ``tests/test_hostile_inputs.py`` (another branch's file) still
imports it: the config rules are :mod:`ckptctl.verify.model`, the PEFT rules
:mod:`ckptctl.verify.peft`, and a tensor is a :class:`~ckptctl.format.tensor.TensorSpec`.
Remove this module together with those import lines."""

from __future__ import annotations

from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.model import check_config
from ckptctl.verify.peft import check_adapter

__all__ = ["TensorMeta", "check_adapter", "check_config"]


def TensorMeta(name: str, dtype: str | None, shape: tuple[int, ...], file: str) -> TensorSpec:  # noqa: N802
    """The old four-field record; the file a tensor sits in was never read by a rule."""
    return TensorSpec(name, dtype, tuple(shape))
