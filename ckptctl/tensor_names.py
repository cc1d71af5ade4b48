"""A family's tensor names as one text, so that a rule reads all of them in a few C-level passes.

At DeepSeek-V3's scale (92k tensors) a regular expression matched name by name costs about a
microsecond per name and rule. Here the names are joined with newlines once, and a rule's
pattern runs over the whole text:

* :meth:`TensorNames.runs`: a pattern written for one name (``^...``, :class:`RunPattern`) and a
  *run* form of it that also swallows the following lines that provably give the same groups (a
  back-reference to the prefix that decides them). Checkpoints store a layer's (an expert's)
  tensors side by side, so one match stands for a whole run of names: the result is the set of
  the groups, computed from a few hundred matches instead of 92k;
* :meth:`TensorNames.ending` and :meth:`TensorNames.count_prefix`: ``str.endswith`` /
  ``str.startswith`` over every name, as substring searches of the text.

A name may hold a newline (safetensors allows any string): then the text cannot tell the names
apart, and every method reads the names one by one with the one-name pattern, which is what the
rules always meant. The run form of a pattern must therefore read a line exactly as the one-name
pattern reads a name without a newline: it starts with a literal ``\\n`` where the one-name pattern
has ``^`` (a literal first character lets the regex engine skip to the next line quickly), and
nothing in either matches a newline inside a name (``.`` without DOTALL, ``[^\\n]``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cached_property
from itertools import repeat
from typing import Any, NamedTuple

from ckptctl.format.tensor import TensorSpec, dtypes


class RunPattern(NamedTuple):
    """``one_source``: the pattern for one name (anchored with ``^``); ``run_source``: its run form
    over the newline-prefixed lines of the text (MULTILINE); ``keys``: the names of the groups
    both give. Compiled on first use (``re`` keeps them), not when a module defines them."""

    one_source: str
    run_source: str
    keys: tuple[str, ...] = ()

    @property
    def one(self) -> re.Pattern[str]:
        return re.compile(self.one_source)

    @property
    def run(self) -> re.Pattern[str]:
        return re.compile(self.run_source, re.MULTILINE)


class TensorNames:
    """The names of a tensor table, joined once (``text`` is None when a name holds a newline)."""

    def __init__(self, tensors: Mapping[str, TensorSpec]) -> None:
        self.tensors = tensors
        # what rules worked out from these names alone, by rule (each rule keeps its own answer
        # here, and reads it back); given from outside only for the very same set of names: the
        # names are then listed and joined only if a rule has no answer there
        self.facts: dict[str, Any] = {}

    @cached_property
    def names(self) -> list[str]:
        return list(self.tensors)

    @cached_property
    def text(self) -> str | None:
        # "\n" before every name and after the last: a name is exactly what lies between two newlines
        # (one join: the text is never copied to frame it)
        text = "\n".join(["", *self.names, ""])
        return text if text.count("\n") == len(self.names) + 1 else None

    @classmethod
    def of_text(cls, text: str) -> "TensorNames":
        """Names without their table, as a text made as ``text`` is (a newline before every
        name and after the last; no name holds one): for the rules that read names only."""
        out = cls.__new__(cls)
        out.tensors, out.names, out.text, out.facts = {}, [], text, {}
        return out

    @cached_property
    def dtypes(self) -> set[str | None]:
        return dtypes(self.tensors)

    @classmethod
    def of(cls, tensors: "Mapping[str, TensorSpec] | TensorNames") -> "TensorNames":
        return tensors if isinstance(tensors, TensorNames) else cls(tensors)

    def runs(self, pattern: RunPattern) -> set[tuple[str, ...]]:
        """The distinct ``pattern.keys`` groups of every name the one-name pattern matches."""
        matches = (pattern.run.finditer(self.text) if self.text is not None
                   else filter(None, map(pattern.one.match, self.names)))
        return {tuple(map(m.group, pattern.keys)) for m in matches}

    def ending(self, suffix: str) -> list[str]:
        """The names that end with ``suffix`` (no newline in it), in table order."""
        text = self.text
        if text is None:
            return [n for n in self.names if n.endswith(suffix)]
        out: list[str] = []
        key = suffix + "\n"
        i = text.find(key)
        while i >= 0:
            out.append(text[text.rfind("\n", 0, i) + 1:i + len(suffix)])
            i = text.find(key, i + len(key))
        return out

    def count_prefix(self, prefix: str) -> int:
        """How many names start with ``prefix``."""
        if self.text is None:
            return sum(1 for n in self.names if n.startswith(prefix))
        return self.text.count("\n" + prefix)

    def any_ending(self, suffixes: tuple[str, ...]) -> bool:
        return any(map(str.endswith, self.names, repeat(suffixes)))

    def ending_any(self, suffixes: tuple[str, ...]) -> list[str]:
        """The names that end with any of ``suffixes``, each once, in no particular order."""
        if self.text is None:
            return [n for n in self.names if n.endswith(suffixes)]
        # a suffix holding a newline ends no name here (no name holds one)
        return list(dict.fromkeys(n for s in suffixes if "\n" not in s for n in self.ending(s)))

    def matching(self, pattern: RunPattern) -> list[tuple[str, re.Match[str]]]:
        """(name, match) of every name the one-name pattern matches, in table order. The run form
        must end with ``$`` and swallow no further line: its match is the name's whole line."""
        if self.text is None:
            return [(n, m) for n in self.names if (m := pattern.one.match(n))]
        return [(m.group()[1:], m) for m in pattern.run.finditer(self.text)]


def run_pattern(core: str, tail: str, more: str, keys: tuple[str, ...] = ()) -> RunPattern:
    """The :class:`RunPattern` of ``^core tail`` whose run form also swallows the following lines
    that ``more`` accepts (``more`` may refer back to the groups of ``core``)."""
    return RunPattern("^" + core + tail, "\n" + core + tail + more, keys)
