"""A DeepSpeed ZeRO checkpoint's files, read without torch or deepspeed.

``engine.save_checkpoint(root, tag)`` writes ``root/latest`` (the tag) and ``root/<tag>/`` (HF
Trainer and accelerate: ``checkpoint-N/global_stepN/``) holding, per data-parallel rank ``r``,
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (the optimizer state, with the rank's flat
fp32 master partitions) and the model states: ``mp_rank_00_model_states.pt`` once (stages 1/2)
or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (stage 3, whose ``module`` holds
0-element placeholders), with ``param_shapes``, ``shared_params``, buffers and frozen parameters.

Each file is a ``torch.save`` archive whose pickle is read by the allow-list unpickler
(:mod:`ckptctl.format.torch_pickle`), DeepSpeed's own globals (:data:`DEEPSPEED_GLOBALS`) as
data; every tensor this module hands on is a :class:`Flat`: a contiguous run of elements at a
known offset of its file, checked to lie inside its uncompressed storage record.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ckptctl.errors import InputError, from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format.torch_pickle import DEEPSPEED_GLOBALS, DataObject, TensorRef, load_pickles
from ckptctl.sources.zero.locate import _OPTIM, ZeroLocation
from ckptctl.sources.torch_archive import open_regular, read_archive_pickle

MAX_STATES_PICKLE = 1 << 30
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL12 = "mp_rank_00_model_states.pt"
_REBUILD = "save the checkpoint again (or copy the missing files from the training run)"


def is_states_file(name: str) -> bool:
    """Whether ``name`` is a DeepSpeed model- or optimizer-states file name."""
    return bool(_OPTIM.match(name) or _MODEL3.match(name) or re.match(r"^mp_rank_\d+_model_states\.pt$", name))


@dataclass(frozen=True)
class Flat:
    """A contiguous run of ``numel`` elements of ``dtype`` at byte ``offset`` of ``file``."""

    file: str
    offset: int
    numel: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return dt.BY_NAME[self.dtype].itemsize


@dataclass
class ModelStates:
    """One model-states file: ``param_shapes`` (per optimizer group, in order), the aliases
    (``shared_params``: {alias: kept}), the buffers (name -> (record, shape)), frozen parameters
    (their shapes; this file's fragment of each) and the world size it names."""

    path: Path
    param_shapes: list[dict[str, tuple[int, ...]]]
    shared: dict[str, str]
    buffers: dict[str, tuple[Flat, tuple[int, ...]]]
    frozen_shapes: dict[str, tuple[int, ...]]
    frozen_fragments: dict[str, Flat]
    world: int | None
    version: str | None
    global_steps: int | None = None  # the engine's step count when it saved (None: not recorded)
    skipped_steps: int = 0  # steps the engine skipped (an fp16 overflow): the optimizer did not take them


@dataclass
class OptimStates:
    """One rank's optimizer-states file: the stage, the partition count and the rank's flat fp32
    groups (the ``single_partition_of_fp32_groups`` of stages 1/2, ``fp32_flat_groups`` of 3)."""

    path: Path
    stage: int
    world: int
    groups: list[Flat]
    paddings: list[list[int]] | None = None
    steps: tuple[int | float, ...] = ()  # the optimizer's step counters, distinct, sorted (none recorded: empty)


def rank_files(loc: ZeroLocation) -> tuple[dict[int, str], list[str], list[str]]:
    """The optimizer-states files by rank, the model-states files, and any model-parallel or
    pipeline files (refused by the caller)."""
    try:
        names = sorted(os.listdir(loc.folder))
    except OSError as exc:
        raise from_oserror(exc, "cannot list the ZeRO checkpoint") from None
    optim: dict[int, str] = {}
    model: list[str] = []
    parallel: list[str] = []
    for n in names:
        m = _OPTIM.match(n)
        if m:
            if int(m.group(3)) != 0:
                parallel.append(n)
            elif int(m.group(2)) in optim:
                raise InputError(f"{loc.folder}: rank {int(m.group(2))} has two optimizer states files "
                                 f"({optim[int(m.group(2))]}, {n})", "remove the stale one (bf16_ or not)")
            else:
                optim[int(m.group(2))] = n
            continue
        m3 = _MODEL3.match(n)
        if n == _MODEL12 or (m3 and int(m3.group(2)) == 0):
            model.append(n)
        elif m3 or re.match(r"^(mp_rank_\d+|layer_\d+-model_\d+)_model_states\.pt$", n):
            parallel.append(n)
    return optim, model, parallel


def _flat(path: Path, ref: Any, members: Mapping[str, Any], prefix: str, what: str) -> Flat:
    """The record of a contiguous tensor ``ref`` (``what`` names it in errors). Raises InputError."""
    if not isinstance(ref, TensorRef) or ref.storage is None or not ref.exact or ref.dtype is None:
        raise InputError(f"{path}: {what} is not a plain tensor", "the file is damaged: " + _REBUILD)
    d = dt.get(ref.dtype)
    if d is None or d.bits < 8:
        raise InputError(f"{path}: {what} has dtype {ref.dtype}, which cannot be exported", _REBUILD)
    st = ref.storage
    rec = members.get(f"{prefix}data/{st.key}")
    if rec is None or not rec.stored:
        raise InputError(f"{path}: {what} needs storage record data/{st.key}, which is missing or compressed",
                         "the file is damaged or truncated: " + _REBUILD)
    numel = math.prod(ref.shape)
    expect = 1
    for n, s in zip(reversed(ref.shape), reversed(ref.stride)):
        if n != 1 and s != expect:
            raise InputError(f"{path}: {what} is not contiguous", _REBUILD)
        expect *= n
    storage_bytes = st.numel * (d.itemsize if st.dtype is not None else 1)
    end = (ref.offset + numel) * d.itemsize
    if ref.offset < 0 or len(ref.stride) != len(ref.shape) or end > storage_bytes or rec.size < storage_bytes:
        raise InputError(f"{path}: {what} reaches past the end of its storage record",
                         "the file is damaged or truncated: " + _REBUILD)
    return Flat(str(path), rec.offset + ref.offset * d.itemsize, numel, d.name)


def load_states(path: Path, what: str) -> tuple[Any, dict[str, Any], str]:
    """The unpickled object of the ``torch.save`` archive ``path`` (DeepSpeed globals as data),
    its members and prefix. ``what`` ("rank 1's optimizer states") names it in errors. Raises
    InputError for a missing, truncated or damaged file, or one naming a global outside the
    allow-list (nothing is run)."""
    try:
        fd = open_regular(path)
    except InputError as exc:
        if not path.exists():
            raise InputError(f"{what} file {path.name} is missing from {path.parent}", _REBUILD) from None
        raise exc from None
    try:
        raw, members, prefix = read_archive_pickle(fd, f"{what} file {path}", MAX_STATES_PICKLE, _REBUILD)
    except OSError as exc:
        raise from_oserror(exc, f"cannot read {what}") from None
    finally:
        os.close(fd)
    objs, unsafe, err = load_pickles(raw, data_globals=DEEPSPEED_GLOBALS)
    if unsafe:
        names = sorted(set(unsafe))
        raise InputError(f"{path}: refused to unpickle: it references {', '.join(names[:5])}, outside the "
                         "allow-list of ZeRO checkpoints (nothing was run)",
                         "only checkpoints saved by DeepSpeed's engine are read; convert it with trusted code")
    if err or not objs or not isinstance(objs[0], dict):
        raise InputError(f"{what} file {path} is not a readable DeepSpeed checkpoint ({err or 'not a dict'})",
                         _REBUILD)
    return objs[0], members, prefix


def _shape(x: Any, path: Path, name: str) -> tuple[int, ...]:
    if isinstance(x, (tuple, list)) and all(type(v) is int and v >= 0 for v in x):
        return tuple(x)
    raise InputError(f"{path}: param_shapes gives {name!r} no valid shape", _REBUILD)


def read_model_states(path: Path, what: str) -> ModelStates:
    """One model-states file. Raises InputError."""
    obj, members, prefix = load_states(path, what)
    shapes = obj.get("param_shapes")
    if isinstance(shapes, Mapping):
        shapes = [shapes]
    if not isinstance(shapes, list) or not all(isinstance(g, Mapping) for g in shapes):
        raise InputError(f"{path}: no param_shapes: not a DeepSpeed model-states file", _REBUILD)
    groups = [{str(k): _shape(v, path, str(k)) for k, v in g.items()} for g in shapes]
    module = obj.get("module") if isinstance(obj.get("module"), Mapping) else {}
    buffers: dict[str, tuple[Flat, tuple[int, ...]]] = {}
    for name in obj.get("buffer_names") or []:
        ref = module.get(name)
        if ref is None:
            raise InputError(f"{path}: buffer {name!r} is listed but not stored", _REBUILD)
        buffers[str(name)] = (_flat(path, ref, members, prefix, f"buffer {name!r}"), tuple(ref.shape))
    frozen_shapes = {str(k): _shape(v, path, str(k)) for k, v in (obj.get("frozen_param_shapes") or {}).items()}
    fragments = {str(k): _flat(path, v, members, prefix, f"frozen parameter {k!r}")
                 for k, v in (obj.get("frozen_param_fragments") or {}).items()}
    shared = obj.get("shared_params") or {}
    if not isinstance(shared, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in shared.items()):
        raise InputError(f"{path}: shared_params is not a map of names", _REBUILD)
    world = obj.get("dp_world_size")
    version = obj.get("ds_version")
    steps, skipped = obj.get("global_steps"), obj.get("skipped_steps")
    return ModelStates(path, groups, dict(shared), buffers, frozen_shapes, fragments,
                       world if type(world) is int else None, version if isinstance(version, str) else None,
                       steps if type(steps) is int else None, skipped if type(skipped) is int else 0)


def read_optim_states(path: Path, what: str) -> OptimStates:
    """One rank's optimizer-states file. Raises InputError."""
    obj, members, prefix = load_states(path, what)
    osd = obj.get("optimizer_state_dict")
    if not isinstance(osd, Mapping):
        raise InputError(f"{path}: no optimizer_state_dict: not a DeepSpeed optimizer-states file", _REBUILD)
    stage_obj = osd.get("zero_stage")
    stage = stage_obj.value if isinstance(stage_obj, DataObject) else stage_obj
    if type(stage) is not int or stage not in (1, 2, 3):
        raise InputError(f"{path}: not a ZeRO checkpoint (zero_stage {stage!r})",
                         "only ZeRO stage 1, 2 and 3 checkpoints are read")
    count = osd.get("partition_count")
    world = max(count) if isinstance(count, list) and count and all(type(c) is int for c in count) else count
    if type(world) is not int or world < 1:
        raise InputError(f"{path}: partition_count {count!r} is not a world size", _REBUILD)
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    refs = osd.get(key)
    if not isinstance(refs, list) or not refs:
        raise InputError(f"{path}: no {key} in the optimizer state", _REBUILD)
    groups = [_flat(path, r, members, prefix, f"{key}[{i}]") for i, r in enumerate(refs)]
    for i, g in enumerate(groups):
        if not dt.BY_NAME[g.dtype].floating:
            raise InputError(f"{path}: {key}[{i}] holds {g.dtype}, not floating point (DeepSpeed's master weights "
                             "always are): the file is damaged or was not saved by DeepSpeed", _REBUILD)
    pads = osd.get("param_alignment_paddings")
    if pads is not None and not (isinstance(pads, list) and all(
            isinstance(g, list) and all(type(x) is int and x >= 0 for x in g) for g in pads)):
        raise InputError(f"{path}: param_alignment_paddings is not a list of counts", _REBUILD)
    inner = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    return OptimStates(path, stage, world, groups, pads, _step_counters(path, inner, members, prefix))


def _step_counters(path: Path, state: Any, members: Mapping[str, Any], prefix: str) -> tuple[int | float, ...]:
    """The distinct step counters of a rank's wrapped optimizer state (``state``: torch's
    ``{"state": {i: {"step": ...}}, "param_groups": [...]}``, or a list of per-group states):
    each parameter state's ``step`` and each group's, a number or a one-element tensor read
    from its record. Raises InputError for a step that is neither."""
    found: list[Any] = []
    if isinstance(state, Mapping):
        per_param = state.get("state")
        found += [v.get("step") for v in (per_param.values() if isinstance(per_param, Mapping) else ())
                  if isinstance(v, Mapping)]
        groups = state.get("param_groups")
        found += [g.get("step") for g in (groups if isinstance(groups, list) else ()) if isinstance(g, Mapping)]
    elif isinstance(state, list):
        found += [v.get("step") for v in state if isinstance(v, Mapping)]
    out: set[int | float] = set()
    for i, step in enumerate(x for x in found if x is not None):
        if isinstance(step, TensorRef):
            step = _scalar(path, step, members, prefix, f"optimizer step counter {i}")
        if type(step) not in (int, float) or step != step:
            raise InputError(f"{path}: optimizer step counter {i} is {step!r}, not a number", _REBUILD)
        out.add(int(step) if step == int(step) else step)
    return tuple(sorted(out))


_SCALARS = {"F32": "<f", "F64": "<d", "F16": "<e", "I64": "<q", "I32": "<i", "I16": "<h", "U8": "<B"}


def _scalar(path: Path, ref: TensorRef, members: Mapping[str, Any], prefix: str, what: str) -> int | float:
    """The value of the one-element tensor ``ref`` of ``path``, read from its record."""
    import struct

    flat = _flat(path, ref, members, prefix, what)
    if flat.numel != 1 or flat.dtype not in _SCALARS and flat.dtype != "BF16":
        raise InputError(f"{path}: {what} is not one number ({flat.numel} elements of {flat.dtype})", _REBUILD)
    fd = open_regular(path)
    try:
        raw = os.pread(fd, flat.itemsize, flat.offset)
    except OSError as exc:
        raise from_oserror(exc, f"cannot read {path}") from None
    finally:
        os.close(fd)
    if len(raw) != flat.itemsize:
        raise InputError(f"{path}: {what} lies past the end of the file", "the file is truncated: " + _REBUILD)
    if flat.dtype == "BF16":
        return struct.unpack("<f", b"\0\0" + raw)[0]
    return struct.unpack(_SCALARS[flat.dtype], raw)[0]


ZERO_HINT = ("it is one file of a DeepSpeed ZeRO checkpoint: export its folder, `ckptctl export {folder} DST` "
             "(the ZeRO source rebuilds the fp32 weights from every rank)")


def placeholders(path: Path, empty: list[str]) -> dict[str, tuple[int, ...]]:
    """Of the 0-element tensors ``empty`` of the ``torch.save`` file ``path``, those that are
    ZeRO-3 placeholders: {name: the real shape its ``param_shapes`` records}. Empty when the
    file is not a DeepSpeed model-states file."""
    if not empty:
        return {}
    try:
        obj, _members, _prefix = load_states(path, "the model states")
    except InputError:
        return {}
    real: dict[str, tuple[int, ...]] = {}
    shapes = obj.get("param_shapes")
    for group in (shapes if isinstance(shapes, list) else [shapes]):
        if isinstance(group, Mapping):
            real.update({str(k): tuple(v) for k, v in group.items() if isinstance(v, (tuple, list))})
    frozen = obj.get("frozen_param_shapes")
    if isinstance(frozen, Mapping):
        real.update({str(k): tuple(v) for k, v in frozen.items() if isinstance(v, (tuple, list))})
    out = {}
    for name in empty:
        shape = real.get(name)
        if shape is not None and all(type(x) is int for x in shape) and math.prod(shape) > 0:
            out[name] = shape
    return out


def refuse_placeholders(path: Path, empty: list[str]) -> None:
    """Raise InputError when one of the 0-element tensors ``empty`` of ``path`` is a ZeRO-3
    placeholder (an export would publish it as a weight)."""
    found = placeholders(path, empty)
    if found:
        name, shape = next(iter(found.items()))
        raise InputError(f"{path}: tensor {name!r} is a 0-element ZeRO-3 placeholder (its real shape, "
                         f"{list(shape)}, is partitioned across the ranks' optimizer states); "
                         f"{len(found)} such tensors", ZERO_HINT.format(folder=path.parent))
