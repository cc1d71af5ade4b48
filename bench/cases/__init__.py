"""Benchmark cases. Every public module here exposes ``CASES``, a list of :class:`harness.Case`;
:func:`discover` collects them into one dict, so adding a case is adding a module."""

from __future__ import annotations

import importlib
import pkgutil

from bench.harness import Case


def discover() -> dict[str, Case]:
    found: dict[str, Case] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        for case in importlib.import_module(f"{__name__}.{info.name}").CASES:
            if case.name in found:
                raise ValueError(f"case {case.name!r} is defined twice (in {info.name})")
            found[case.name] = case
    return found
