"""A DeepSpeed ZeRO checkpoint (stages 1, 2, 3) as a source: the fp32 master weights.

``ckptctl export CKPT_DIR DST``, where CKPT_DIR is a DeepSpeed root (with ``latest``) or a step
folder (``checkpoint-N/global_stepN/``). The rank files are read by :mod:`.files` (no torch,
no deepspeed: DeepSpeed's globals are data to the allow-list unpickler), the parameters placed by
:mod:`.zero_layout` exactly as DeepSpeed's ``zero_to_fp32`` reconstructs them. Every parameter is
a list of :class:`Piece` s of the ranks' flat fp32 partitions, so a same-dtype export is a kernel
copy of byte ranges; a conversion (``--dtype bf16``) streams them in bounded chunks. Buffers are
fp32 as ``zero_to_fp32`` makes them (a floating buffer saved in bf16 is widened), frozen
parameters keep the dtype they were saved in, and ``shared_params`` become aliases (an output
head whose config says ``tie_word_embeddings: false`` is stored with its own copy). The config
and tokenizer files come from the root beside the step folder, as the HF Trainer lays it out.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

from ckptctl.errors import InputError
from ckptctl.format import dtypes as dt
from ckptctl.format.tensor import TensorSpec
from ckptctl.format.torch_pickle import DISCARD_SUFFIXES
from ckptctl.sources.base import CHUNK_BYTES, FileId, Piece, Source, SourceTensor, file_chunks, key_refused, read_pinned
from ckptctl.sources.zero.locate import ZeroLocation
from ckptctl.sources.zero.files import (Flat, ModelStates, OptimStates, rank_files,
                                        read_model_states, read_optim_states)
from ckptctl.sources.zero.layout import frozen3_pieces, stage3_pieces, stage12_pieces

_FLOATING = frozenset({"F16", "BF16", "F64", "F8_E4M3", "F8_E5M2"})
_REBUILD = "save the checkpoint again (or copy the missing files from the training run)"


def optim_name(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model3_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


class ZeroCheckpoint:
    """The rank files of one ZeRO checkpoint, read and checked against each other: the stage,
    the world size (every rank's file present, complete and of the same run), the model
    states (rank 0's, and each rank's for stage 3)."""

    def __init__(self, loc: ZeroLocation) -> None:
        self.loc = loc
        where = loc.folder
        optim, model, parallel = rank_files(loc)
        if parallel:
            raise InputError(f"{where}: model- or pipeline-parallel files ({', '.join(parallel[:3])}) are not "
                             "supported, only data-parallel ZeRO", "convert with DeepSpeed's ds_to_universal first")
        if not optim:
            raise InputError(f"{where}: no optimizer states files (*_optim_states.pt)",
                             "the fp32 master weights are in them: " + _REBUILD)
        bf16 = any(n.startswith("bf16_") for n in optim.values())
        first = min(optim)
        # the version of each file read: its bytes are copied from that version only (Source.pin)
        self.idents: dict[str, FileId | None] = {}
        probe = self._read(where / optim[first], read_optim_states, f"rank {first}'s optimizer states")
        self.stage, self.world = probe.stage, probe.world
        missing = [r for r in range(self.world) if r not in optim]
        if missing:
            r = missing[0]
            raise InputError(f"{where}: rank {r}'s optimizer states file {optim_name(r, bf16)} is missing "
                             f"(the checkpoint was saved by {self.world} ranks)", _REBUILD)
        extra = sorted(r for r in optim if r >= self.world)
        if extra:
            raise InputError(f"{where}: optimizer states files for {len(optim)} ranks, but rank {first}'s says the "
                             f"world size was {self.world} ({optim[extra[0]]} is from another run)",
                             "remove the stale rank files, or " + _REBUILD)
        self.optim: list[OptimStates] = [probe if r == first else
                                          self._read(where / optim[r], read_optim_states, f"rank {r}'s optimizer states")
                                          for r in range(self.world)]
        for r, o in enumerate(self.optim):
            if (o.stage, o.world) != (self.stage, self.world):
                raise InputError(f"{where}: rank {r}'s optimizer states say ZeRO stage {o.stage} with {o.world} ranks, "
                                 f"rank {first}'s stage {self.stage} with {self.world}: mismatched world sizes",
                                 "the files come from different runs: " + _REBUILD)
        self.files = [where / optim[r] for r in range(self.world)]
        self.models = self._read_models(where, model)
        check_steps(where, self.optim, self.models, self.stage)
        self.version = self.models[0].version

    def _read_models(self, where: Path, present: list[str]) -> list[ModelStates]:
        if self.stage < 3:
            names = ["mp_rank_00_model_states.pt"]
        else:
            names = [model3_name(r) for r in range(self.world)]
        models = []
        for r, name in enumerate(names):
            what = "the model states" if self.stage < 3 else f"rank {r}'s model states"
            if name not in present:
                raise InputError(f"{where}: {what} file {name} is missing", _REBUILD)
            m = self._read(where / name, read_model_states, what)
            if m.world is not None and m.world != self.world:
                raise InputError(f"{where}: {name} says the world size was {m.world}, the optimizer states "
                                 f"{self.world}: mismatched world sizes", "the files come from different runs: " + _REBUILD)
            models.append(m)
            self.files.append(where / name)
        return models

    def _read(self, path: Path, read: Any, what: str) -> Any:
        """``read(path, what)``, recording the identity of the file version it read."""
        out, self.idents[str(path)] = read_pinned(path, lambda: read(path, what))
        return out

    def parameters(self) -> list[tuple[str, tuple[int, ...], str, list[Piece]]]:
        """Every trainable parameter: (name, shape, dtype, pieces), in ``param_shapes`` order."""
        where = str(self.loc.folder)
        shapes = self.models[0].param_shapes
        groups = [o.groups for o in self.optim]
        if self.stage < 3:
            return stage12_pieces(shapes, groups, self.optim[0].paddings, self.world, where)
        return stage3_pieces(shapes, groups, self.world, where)

    def frozen(self) -> list[tuple[str, tuple[int, ...], str, list[Piece]]]:
        """Every frozen parameter, with the dtype it was saved in (as ``zero_to_fp32`` keeps it)."""
        m0 = self.models[0]
        out = []
        for name, shape in m0.frozen_shapes.items():
            if self.stage < 3:
                frag = m0.frozen_fragments.get(name)
                if frag is None or frag.numel != math.prod(shape):
                    raise InputError(f"{m0.path}: frozen parameter {name!r} is not stored whole", _REBUILD)
                out.append((name, shape, frag.dtype, [_whole(frag)]))
                continue
            frags = []
            for m in self.models:
                frag = m.frozen_fragments.get(name)
                if frag is None:
                    raise InputError(f"{m.path}: has no fragment of frozen parameter {name!r}", _REBUILD)
                frags.append(frag)
            if len({f.dtype for f in frags}) != 1:
                raise InputError(f"{self.loc.folder}: the fragments of frozen parameter {name!r} mix dtypes", _REBUILD)
            out.append((name, shape, frags[0].dtype, frozen3_pieces(shape, frags, name, str(self.loc.folder))))
        return out

    def describe(self) -> dict[str, Any]:
        """What inspect shows: stage, world size, tag, DeepSpeed version, the rank files."""
        return {"stage": self.stage, "world_size": self.world, "tag": self.loc.tag, "ds_version": self.version,
                "folder": str(self.loc.folder), "files": [str(f) for f in self.files]}


def _steps(steps: tuple[int | float, ...]) -> str:
    return " and ".join(map(str, steps))


def check_steps(where: Path, optim: list[OptimStates], models: list[ModelStates], stage: int) -> None:
    """Every rank's files are of one save: the ranks' optimizer step counters agree, the model
    states' ``global_steps`` agree (one file per rank at stage 3), and no optimizer has taken
    more steps than the engine counted (``global_steps - skipped_steps``). An optimizer behind
    the engine is what a run resumed without its optimizer state saves, and is accepted. Raises
    InputError naming the rank and both steps (a rank file of another step: a tag re-used after
    a save that died, a half-finished copy)."""
    hint = "the files come from different saves: copy the whole step folder again, or " + _REBUILD
    counted = [(r, o.steps) for r, o in enumerate(optim) if o.steps]
    for r, steps in counted[1:]:
        if steps != counted[0][1]:
            raise InputError(f"{where}: rank {r}'s optimizer states are at step {_steps(steps)}, rank {counted[0][0]}'s "
                             f"at step {_steps(counted[0][1])}: the rank files are of different saves", hint)
    engine = [(r, m) for r, m in enumerate(models) if m.global_steps is not None]
    for r, m in engine[1:]:
        if m.global_steps != engine[0][1].global_steps:
            raise InputError(f"{where}: rank {r}'s model states say global step {m.global_steps}, rank {engine[0][0]}'s "
                             f"{engine[0][1].global_steps}: the rank files are of different saves", hint)
    if counted and engine:
        r, steps = max(counted, key=lambda rs: rs[1][-1])
        m = engine[0][1]
        if steps[-1] > m.global_steps - m.skipped_steps:
            whose = "the model states" if stage < 3 else "the model states of every rank"
            raise InputError(f"{where}: rank {r}'s optimizer states are at step {_steps(steps)}, {whose} at global "
                             f"step {m.global_steps}: the files are of different saves", hint)


def _whole(flat: Flat) -> Piece:
    return Piece(flat.file, flat.offset, 0, flat.numel * flat.itemsize)


class ZeroSource(Source):
    """The fp32 master weights of a ZeRO checkpoint (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stored: dict[str, str] = {}  # the dtype of each tensor's bytes in the rank files
        self._where: dict[str, tuple[Piece, ...]] = {}  # where they are, in the tensor's order
        self.checkpoint: ZeroCheckpoint | None = None
        self.fast_convert = True  # fp32 -> bf16/fp16 by numpy (zero_convert), else torch's reference

    @classmethod
    def open(cls, loc: ZeroLocation, *, tie_heads: bool = True, fast_convert: bool = True) -> "ZeroSource":
        ckpt = ZeroCheckpoint(loc)
        src = cls(path=loc.folder, kind="zero")
        src.fast_convert = fast_convert
        src.checkpoint = ckpt
        src.stem = "model"
        for path, ident in ckpt.idents.items():
            src.pin(path, ident)
        origin = loc.folder.name
        for name, (flat, shape) in ckpt.models[0].buffers.items():
            # zero_to_fp32 widens a floating buffer to fp32 (``v.float()``)
            out = "F32" if dt.BY_NAME[flat.dtype].name in _FLOATING else flat.dtype
            src._list(name, shape, out, flat.dtype, [_whole(flat)] if flat.numel else [], origin)
        for name, shape, dtype, pieces in [*ckpt.frozen(), *ckpt.parameters()]:
            src._list(name, shape, dtype, dtype, pieces, origin)
        listed = {t.name: t for t in src.tensors}
        for alias, kept in ckpt.models[0].shared.items():
            if kept not in listed or alias in listed:
                continue
            if not tie_heads and alias.endswith(DISCARD_SUFFIXES):  # the loader would not tie it: a copy
                t = listed[kept]
                src._list(alias, t.shape, t.dtype, src._stored[kept], list(src._where[kept]), origin)
            else:
                src.aliases[alias] = kept
        if not src.tensors:
            raise InputError(f"{loc.folder}: the ZeRO checkpoint lists no parameters", _REBUILD)
        return src

    def _list(self, name: str, shape: tuple[int, ...], dtype: str, stored: str, pieces: list[Piece],
              origin: str) -> None:
        """List tensor ``name`` of ``dtype`` whose bytes (of ``stored``) are ``pieces``: a range
        or pieces for the writer to copy when it is stored as listed, else bytes to convert."""
        spec = TensorSpec(name, dtype, tuple(shape))
        if dtype != stored:  # widened on the way (a bf16 buffer): never a byte range
            t = SourceTensor(spec)
        elif len(pieces) == 1:
            t = SourceTensor(spec, file=pieces[0].file, offset=pieces[0].src_offset)
        else:
            t = SourceTensor(spec, pieces=tuple(pieces))
        self._stored[name] = stored
        self._where[name] = tuple(pieces)
        self.add(t, origin)

    def chunks(self, t: SourceTensor, target_dtype: str | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
        from ckptctl.sources.zero.convert import convert_chunks

        stored = self._stored[t.name]
        out = target_dtype or t.dtype
        for p in self._where[t.name]:
            raw = file_chunks(p.file, p.src_offset, p.nbytes, stored, None, chunk_bytes,
                              f"{p.file} is shorter than its zip directory says (tensor {t.name!r})",
                              self.identity(p.file))
            if out == stored:
                yield from raw
                continue
            for chunk in raw:
                yield from convert_chunks(chunk, stored, out, fast=self.fast_convert)

    def close(self) -> None:
        self._where.clear()


def open_location(loc: ZeroLocation, path: Path, *, key: str | None = None, **_: Any) -> ZeroSource:
    """The registry's open hook (``sources/kinds.py``): the ZeRO checkpoint ``find_zero`` found at
    ``path``, with the config and tokenizer files of the root beside the step folder. Raises
    InputError (UsageError for a ``key``: the fp32 weights are not a nested state dict)."""
    from ckptctl import layout as L
    from ckptctl.config_fields import read_config
    from ckptctl.sources.torch_source import heads_tied
    from ckptctl.fastpaths import enabled

    if key:
        raise key_refused(path, "DeepSpeed ZeRO", key, "the export rebuilds the fp32 master weights from every rank")
    src = ZeroSource.open(loc, tie_heads=heads_tied(read_config(loc.root)), fast_convert=enabled("convert"))
    lay = L.scan(loc.root)
    src.extras = [loc.root / n for n in lay.extras if n in L.COPIED_EXTRAS]
    return src
