"""Old import path, kept only while ``tests/test_hostile_inputs.py`` (another branch's file) still
imports it: DCP metadata is read by :mod:`ckptctl.format.dcp_metadata`, the one reader of it.
Remove this module together with those import lines."""

from __future__ import annotations

from ckptctl.format.dcp_metadata import read_dcp_metadata

__all__ = ["read_dcp_metadata"]
