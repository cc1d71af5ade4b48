"""Every file-name rule of the checkpoint formats we read and write, in one place.

- Weights files: ``{stem}[.{variant}][-{i:05d}-of-{n:05d}].{ext}`` where ``stem`` is the library's
  own name (transformers ``model`` / ``pytorch_model``, diffusers ``diffusion_pytorch_model``, PEFT
  ``adapter_model``) and ``ext`` is ``safetensors`` or ``bin``. This is how transformers' and
  diffusers' ``_add_variant`` insert a variant (before the last extension) and how their
  ``filename_pattern`` inserts the shard suffix.
- Index files: ``{stem}.{ext}.index[.{variant}].json`` (``_add_variant`` on the index name).
- The safe-member rule: a file name taken from a JSON document (an index's ``weight_map``, a
  manifest, a config) may be opened only when it is a relative path inside the checkpoint.
- Leftovers: the exact names that interrupted writers of known tools leave behind, and our own
  staging directory name. ``layout`` reports them, export drops them from a destination, and
  ``gc-tmp`` presets remove them: all from this one table.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from typing import NamedTuple

SAFETENSORS_EXT = "safetensors"
BIN_EXT = "bin"

# stem -> the library that writes it. Order matters only for display.
STEMS: dict[str, str] = {
    "model": "transformers",
    "pytorch_model": "transformers",
    "diffusion_pytorch_model": "diffusers",
    "adapter_model": "peft",
}
ADAPTER_STEM = "adapter_model"

_VARIANT = r"[A-Za-z0-9_]+"
_STEM_ALT = "|".join(sorted(STEMS, key=len, reverse=True))
_WEIGHTS_RE = re.compile(
    rf"^(?P<stem>{_STEM_ALT})(?:\.(?P<variant>{_VARIANT}))?(?:-(?P<i>\d{{5}})-of-(?P<n>\d{{5}}))?"
    r"\.(?P<ext>safetensors|bin)$")
_INDEX_RE = re.compile(rf"^(?P<stem>{_STEM_ALT})\.(?P<ext>safetensors|bin)\.index(?:\.(?P<variant>{_VARIANT}))?\.json$")
# Any shard-numbered name, whatever its prefix (an index may name shards of any scheme).
_ANY_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.(?P<ext>[A-Za-z0-9]+)$")


class WeightsName(NamedTuple):
    """A parsed weights file name."""

    stem: str
    ext: str
    variant: str | None = None
    shard: tuple[int, int] | None = None  # (i, n), 1-based

    @property
    def family(self) -> tuple[str, str, str | None]:
        """What identifies the family this file belongs to: (stem, ext, variant)."""
        return self.stem, self.ext, self.variant

    @property
    def name(self) -> str:
        return weights_file_name(self.stem, self.ext, variant=self.variant, shard=self.shard)


def parse_weights_name(name: str) -> WeightsName | None:
    """The parts of a library-named weights file (``model.fp16-00001-of-00002.safetensors``), or None."""
    m = _WEIGHTS_RE.match(name)
    if m is None:
        return None
    shard = (int(m.group("i")), int(m.group("n"))) if m.group("i") else None
    return WeightsName(m.group("stem"), m.group("ext"), m.group("variant"), shard)


def parse_index_name(name: str) -> tuple[str, str, str | None] | None:
    """(stem, ext, variant) of an index file name (``model.safetensors.index.fp16.json``), or None."""
    m = _INDEX_RE.match(name)
    return (m.group("stem"), m.group("ext"), m.group("variant")) if m else None


def weights_file_name(stem: str, ext: str, *, variant: str | None = None, shard: tuple[int, int] | None = None) -> str:
    v = f".{variant}" if variant else ""
    s = f"-{shard[0]:05d}-of-{shard[1]:05d}" if shard else ""
    return f"{stem}{v}{s}.{ext}"


def index_name(stem: str, ext: str, *, variant: str | None = None) -> str:
    v = f".{variant}" if variant else ""
    return f"{stem}.{ext}.index{v}.json"


def parse_shard_number(name: str) -> tuple[str, int, int, str] | None:
    """(prefix, i, n, ext) of any ``<prefix>-00001-of-00002.<ext>`` name, or None."""
    m = _ANY_SHARD_RE.match(name.rsplit("/", 1)[-1])
    return (m.group("prefix"), int(m.group("i")), int(m.group("n")), m.group("ext")) if m else None


# --------------------------------------------------------------------------------------------
# names taken from JSON documents


def member_problem(name: object) -> str | None:
    """Why a file name read from a JSON document may not be opened inside the checkpoint, or None.

    Accepted: a relative path below the checkpoint directory (``sub/x.safetensors`` too: loaders
    join it to the folder). Refused: empty, NUL, absolute, backslash, drive letter, ``..``."""
    if not isinstance(name, str) or not name:
        return "it is empty"
    if "\0" in name:
        return "it contains a NUL byte"
    if name.startswith("/"):
        return "it is an absolute path"
    if "\\" in name:
        return "it contains a backslash"
    if re.match(r"^[A-Za-z]:", name):
        return "it has a drive letter"
    parts = name.split("/")
    if ".." in parts:
        return "it climbs out of the directory with '..'"
    if any(p in ("", ".") for p in parts):
        return "it has an empty or '.' path component"
    return None


# --------------------------------------------------------------------------------------------
# leftovers of interrupted writers


class Leftover(NamedTuple):
    """What one known tool leaves behind when it is interrupted.

    ``kind`` is ``file`` or ``dir``; ``default`` says whether ``layout`` (and so export, resave
    and verify) treats a match as a leftover without being asked. Presets that are not default
    (too broad to be proof: another tool's ``_tmp_*``) are used only by ``gc-tmp --preset``."""

    preset: str
    patterns: tuple[str, ...]  # fnmatch, case-sensitive, whole name
    kind: str
    help: str
    default: bool = True
    beside_safetensors: bool = False  # only counts next to a .safetensors file

    def matches(self, name: str, *, is_dir: bool, beside_safetensors: bool = True) -> bool:
        if is_dir != (self.kind == "dir"):
            return False
        if self.beside_safetensors and not beside_safetensors:
            return False
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


LEFTOVERS: tuple[Leftover, ...] = (
    # '[?]' is a literal '?': streaming savers (mcore-bridge) name temp shards ...-of-?????.ext
    # until the count is known; a real shard never matches.
    Leftover("temp-shards", ("*-of-[?][?][?][?][?].safetensors", "*-of-[?][?][?][?][?].bin"), "file",
             "*-of-?????.safetensors/.bin (literal '?': temp shards of streaming savers)"),
    # Rust tempfile's NamedTempFile::new_in (safetensors >= 0.8): ".tmp" + 6 alphanumerics.
    Leftover("safetensors-tmp", (".tmp" + "[A-Za-z0-9]" * 6,), "file",
             ".tmpXXXXXX files beside a .safetensors file (safetensors' temp files)", beside_safetensors=True),
    Leftover("incomplete", ("*.incomplete",), "file", "*.incomplete (huggingface_hub partial downloads)"),
    Leftover("trainer-tmp", ("tmp-checkpoint-[0-9]*",), "dir", "tmp-checkpoint-N (transformers Trainer staging)"),
    Leftover("orbax", ("*.orbax-checkpoint-tmp-*",), "dir", "*.orbax-checkpoint-tmp-* (Orbax's unfinalized checkpoints)"),
    Leftover("miles", ("_tmp_*",), "dir", "_tmp_* directories without a ckptctl owner record (Miles' staging)",
             default=False),
)
PRESETS: dict[str, Leftover] = {lo.preset: lo for lo in LEFTOVERS}

# Our own staging directories: _tmp_<name>.<16-hex ns stamp>-<8-hex random>. A writer creates
# one under the hidden name "." + that name, takes its lock and writes its owner record there, and
# only then renames it to the visible name: a visible staging directory is always fully formed
# (gc-tmp's --min-age 0 cannot catch a writer between mkdir and flock). A hidden one is a writer
# starting, or one that died in those microseconds: gc-tmp leaves it for HIDDEN_GRACE seconds.
STAGING_PREFIX = "_tmp_"
HIDDEN = "."
_STAGING_RE = re.compile(r"^\.?_tmp_(?P<dest>.+)\.(?P<stamp>[0-9a-f]{16})-(?P<rand>[0-9a-f]{8})$", re.DOTALL)
STAGING = "staging"
STAGING_OVERHEAD = len(HIDDEN) + len(STAGING_PREFIX) + 1 + 16 + 1 + 8  # bytes a staging name adds
HIDDEN_GRACE = 3600.0


def staging_name(dest_name: str, *, hidden: bool = False) -> str:
    """A new staging directory name for ``dest_name``; the stamp orders writers by start. With
    ``hidden``, the name it is created under before it is fully formed."""
    import secrets  # here: not on every command's import path

    name = f"{STAGING_PREFIX}{dest_name}.{time.time_ns():016x}-{secrets.token_hex(4)}"
    return HIDDEN + name if hidden else name


def visible_staging_name(name: str) -> str:
    """The visible name of a (hidden or visible) staging directory name."""
    return name[len(HIDDEN):] if is_hidden_staging(name) else name


def is_hidden_staging(name: str) -> bool:
    return name.startswith(HIDDEN + STAGING_PREFIX) and parse_staging_name(name) is not None


def parse_staging_name(name: str) -> tuple[str, int] | None:
    """(destination name, start stamp) of one of our staging directory names (visible or
    hidden), or None."""
    m = _STAGING_RE.match(name)
    return (m.group("dest"), int(m.group("stamp"), 16)) if m else None


def destination_problem(name: str, name_max: int = 255) -> str | None:
    """Why ``name`` cannot be a destination directory's name (its staging directory is a sibling
    whose name is ``STAGING_OVERHEAD`` bytes longer), or None."""
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return f"the destination name {name!r} holds a control character (a newline or tab)"
    size = len(os.fsencode(name))
    if size + STAGING_OVERHEAD > name_max:
        return (f"the destination name is {size} bytes long; its staging directory beside it needs "
                f"{STAGING_OVERHEAD} more and the filesystem allows {name_max} bytes per name "
                f"(at most {name_max - STAGING_OVERHEAD})")
    return None


def leftover_kind(name: str, *, is_dir: bool, beside_safetensors: bool = True) -> str | None:
    """The default leftover a directory entry is (``staging`` for ours, else a preset name), or None."""
    if is_dir and parse_staging_name(name):
        return STAGING
    for lo in LEFTOVERS:
        if lo.default and lo.matches(name, is_dir=is_dir, beside_safetensors=beside_safetensors):
            return lo.preset
    return None


# --------------------------------------------------------------------------------------------
# what counts as a weights-like name (checkpoint discovery)

INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
MANIFEST_NAME = "ckptctl.manifest.json"  # ckptctl's own manifest (ckptctl.manifest)
CONFIG = "config.json"  # the model's config (transformers, and a diffusers component's)
SAFETENSORS_SUFFIX = f".{SAFETENSORS_EXT}"
TORCH_SAVE_SUFFIXES = (".pt", ".pth")  # torch.save files under their own names (not a family's)
PICKLE_SUFFIXES = (f".{BIN_EXT}", *TORCH_SAVE_SUFFIXES, ".ckpt")  # a torch pickle, by its name
WEIGHTS_SUFFIXES = (SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES)
DCP_METADATA = ".metadata"
DCP_SUFFIX = ".distcp"
ADAPTER_CONFIG = "adapter_config.json"


def is_safetensors(name: str) -> bool:
    """Whether ``name`` is a safetensors file name."""
    return name.endswith(SAFETENSORS_SUFFIX)


def is_weights_like(name: str) -> bool:
    """A name that marks a directory as holding checkpoint weights (for ``verify --recursive``)."""
    if name.endswith((SAFETENSORS_SUFFIX, DCP_SUFFIX)) or name in (DCP_METADATA, ADAPTER_CONFIG):
        return True
    return parse_weights_name(name) is not None or parse_index_name(name) is not None
