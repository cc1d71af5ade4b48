"""What building a model class and matching the checkpoint's keys against it gave: plain data
(no torch), made by the library oracles (:mod:`.transformers_class`, :mod:`.diffusers_class`,
:mod:`.st_class`) and turned into findings by :func:`ckptctl.verify.classes.report_outcome`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Outcome:
    """The library loader's view of a checkpoint against the class it builds.

    ``missing``: keys the class needs that the loader would initialise (not tied, not ignored);
    ``unexpected``: stored keys the loader drops (after its key conversions and ignore lists), by
    checkpoint name; ``disagrees``: the subset of ``unexpected`` that sits inside a module the
    class builds (a layer past the config's count, a bias or norm the config switched off): a
    config that disagrees with its weights; ``mismatched``: (key, stored shape, class shape);
    ``conversion``: keys whose conversion the loader fails on, with its message."""

    library: str  # transformers | diffusers | sentence-transformers
    cls: str  # the class built
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    disagrees: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    conversion: dict[str, str] = field(default_factory=dict)
    # what the library's loader does with each kind (for the messages)
    on_missing: str = "initialises them with random values and warns"
    on_mismatch: str = "raises a size-mismatch error"
    on_unexpected: str = "drops them with a warning"
    unexpected_raises: bool = False  # the loader refuses a stored key it has no place for


class NotChecked(Exception):
    """The class check cannot run here: ``reason`` says why (a note, never an error)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Refused(Exception):
    """The library itself refuses config.json, in a step its own loader runs the same way (its
    config class, its quantizer's config, the model's constructor): ``reason`` names the step and
    the library's error. The loader raises too: an error, not a note."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def deepest_module(modules: set[str], key: str) -> str:
    """The longest dotted prefix of ``key`` (its parameter name excluded) that names a module of
    the class (``""``: the root). ``modules`` holds every module path of the class."""
    parts = key.split(".")[:-1]
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return ""


def split_unexpected(unexpected: list[str], modules: set[str], roots: set[str]) -> list[str]:
    """The unexpected keys that mean a config disagreeing with its weights: those inside a module
    the class builds below its root (a ``layers`` list one entry short, an attention block without
    the bias or norm the key is). A key whose deepest module is the root or one of ``roots`` (the
    base model's own container, ``model``) is a tensor the class has no place for: stored but
    unused."""
    return [k for k in unexpected if deepest_module(modules, k) not in roots]
