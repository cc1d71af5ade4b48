"""A Megatron-core ``torch_dist`` checkpoint as a source: its model weights under Hugging Face
names (Llama, Qwen2, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3/Kimi with MLA, GLM-4.5; MTP layers as
the HF checkpoints hold them), or under Megatron's own (``--names megatron``).

The checkpoint is torch DCP with Megatron's extra planning records in ``.metadata`` (read as
data by :mod:`ckptctl.format.dcp_metadata`); :mod:`.files` finds it and reads the run's
arguments from ``common.pt`` (without them: ``--config``, :mod:`.config_hf`). The model's tensors are the DCP tensors outside ``optimizer.``
(Megatron's ``_extra_state`` and RNG entries are byte objects, not tensors). Every chunk of them
is located in its ``.distcp`` file (:func:`ckptctl.sources.dcp.chunks.chunk_bytes_at`: the
chunk's ``torch.save`` archive read from its records, nothing imported) and the chunks of each
tensor must tile its global shape (:func:`ckptctl.sources.dcp.hf.check_tiling`), so tensor- and
pipeline-parallel degrees do not matter.

Each exported tensor is a set of :class:`~ckptctl.sources.dcp.hf.Block` s, sub-blocks of those
chunks cut by the mapping (:mod:`.mapping`: a layer of a stacked tensor or a per-layer key, the
vocabulary the run's tokenizer had, a query group's q/k/v rows, the gate or up half of ``linear_fc1``, one
expert): this is the DCP-HF source's own representation, so the same code places them. Blocks
that are few long runs of the output become :class:`~ckptctl.sources.base.Piece` s copied by the
kernel; others (the column shards of a tensor-parallel ``linear_proj``/``linear_fc2``) stream
through :meth:`DcpHfSource.chunks` in bounded windows. ``config.json`` is built from the
arguments (:mod:`.config`, :mod:`.config_v3`). Nothing is guessed: a tensor no rule consumes, a shape the
arguments do not explain, an argument no mapping covers, each refuses the export.
"""

from __future__ import annotations

import itertools
import json
import operator
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ckptctl.errors import InputError, UsageError, from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format import names as N
from ckptctl.format.dcp_metadata import DType, MetadataIndex, TensorStorageMetadata
from ckptctl.sources.base import OpenFiles, Piece, SourceTensor, key_refused, read_pinned
from ckptctl.sources.dcp.chunks import chunk_bytes_at
from ckptctl.sources.dcp.hf import MAX_PIECES, Block, DcpHfSource, block_pieces, check_tiling, run_count, strides
from ckptctl.sources.dcp.source import check_storage, read_dcp_metadata
from ckptctl.sources.megatron.config import ArgsError
from ckptctl.sources.megatron.files import Common, backend, read_common
from ckptctl.sources.megatron.locate import MegatronLocation

KIND = "megatron"
OPTIMIZER = "optimizer."
# A tensor whose blocks are runs of at least this many bytes is copied by the kernel run by run
# (the column shards of a tensor-parallel linear_proj/linear_fc2 too: 2 GB export 5.8 -> 3.1 s
# against streaming them, bench/cases/megatron.py); shorter runs stream in windows.
MIN_RUN_BYTES = 1024
_AGAIN = "save the checkpoint again, or copy the missing files from the training run"


class GeneratedFile(bytes):
    """An extra file made by the source (config.json): its bytes, and the ``name`` it is written as."""

    name: str

    def __new__(cls, name: str, data: bytes) -> "GeneratedFile":
        obj = super().__new__(cls, data)
        obj.name = name
        return obj


class RunPieces(Sequence[Piece]):
    """The pieces of an output tensor, made on demand from its blocks (each block's contiguous
    runs of the output, :func:`~ckptctl.sources.dcp.hf.block_pieces`): a column-sharded layer is
    thousands of runs, and only its few blocks are kept. Iterated in destination order."""

    def __init__(self, blocks: list[Block], shape: tuple[int, ...], itemsize: int) -> None:
        self._blocks = [b for b in blocks if b.numel]
        self._shape, self._itemsize = shape, itemsize
        self._len = sum(run_count(b, shape)[0] for b in self._blocks)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Piece]:
        """In the order of the output's bytes (the blocks' runs interleave in a column-sharded
        tensor): each page of the output is written once, before its writeback starts."""
        if len(self._blocks) == 1:
            return block_pieces(self._blocks[0], self._shape, self._itemsize)
        runs = [p for b in self._blocks for p in _block_runs(b, self._shape, self._itemsize)]
        runs.sort(key=_DST)  # the blocks tile the output: no two runs start at one byte
        return iter(runs)

    def __getitem__(self, i: Any) -> Any:  # the writer asks only for [0] of a one-piece tensor
        if isinstance(i, slice):
            return list(self)[i]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return next(itertools.islice(iter(self), i, None))


_DST = operator.attrgetter("dst_offset")


def _block_runs(b: Block, shape: tuple[int, ...], itemsize: int) -> list[Piece]:
    """:func:`~ckptctl.sources.dcp.hf.block_pieces` of ``b`` as a list, its destinations
    computed dimension by dimension (a column shard's thousands of rows, without a sum per row)."""
    count, length = run_count(b, shape)
    if count == 1:
        return list(block_pieces(b, shape, itemsize))
    split = max(i for i in range(len(shape)) if b.sizes[i] != shape[i])
    st = strides(shape)
    starts = [sum(o * s for o, s in zip(b.offsets, st))]
    for d in range(split):  # row-major over the block's leading dimensions, as block_pieces counts them
        starts = [x + i * st[d] for x in starts for i in range(b.sizes[d])]
    n, file, first = length * itemsize, b.file, b.start
    return [Piece(file, first + r * n, x * itemsize, n) for r, x in enumerate(starts)]


def pieces_of(blocks: list[Block], shape: tuple[int, ...], dtype: str, max_pieces: int,
              min_run: int = MIN_RUN_BYTES) -> Sequence[Piece]:
    """The tensor's pieces (:class:`RunPieces`), or ``()`` when it streams: ``max_pieces=0``
    (the reference), a sub-byte dtype, or blocks cut into runs shorter than ``min_run`` bytes
    (a block that is one run is a piece whatever its size)."""
    d = dt.BY_NAME[dtype]
    live = [b for b in blocks if b.numel]
    if not max_pieces or not live or d.bits % 8:
        return ()
    counts = [run_count(b, shape) for b in live]
    if sum(c for c, _ in counts) > len(live) and min(n for _, n in counts) * d.itemsize < min_run:
        return ()  # short runs, several to a block (a small model's column shards): streamed
    return RunPieces(live, shape, d.itemsize)


def model_tensors(meta: Any) -> dict[str, Any]:
    """The model's tensors (fqn -> TensorStorageMetadata): every DCP tensor outside ``optimizer.``."""
    return {fqn: item for fqn, item in meta.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata) and not fqn.startswith(OPTIMIZER)}


def _dtype(root: Path, fqn: str, item: Any) -> str:
    tdtype = getattr(item.properties, "dtype", None)
    d = dt.get(tdtype.name) if isinstance(tdtype, DType) and tdtype.name else None
    if d is None or d.bits % 8:
        shown = tdtype.torch_name if isinstance(tdtype, DType) else "unknown"
        raise InputError(f"{root}: tensor {fqn!r} has dtype {shown}, which cannot be exported",
                         "the metadata is corrupt, or the tensor is of a kind safetensors cannot store")
    return d.name


def _shape(root: Path, fqn: str, item: Any) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in item.size)
    except (TypeError, ValueError):
        raise InputError(f"{root}: tensor {fqn!r} has no size", "the metadata is corrupt") from None
    if any(n < 0 for n in shape):
        raise InputError(f"{root}: tensor {fqn!r} has a negative size {list(shape)}", "the metadata is corrupt")
    return shape


def global_blocks(root: Path, fqn: str, item: Any, storage: Any, dtype: str, shape: tuple[int, ...],
                  open_fd: Any) -> list[Block]:
    """Every chunk of ``fqn`` as a :class:`Block` of its global tensor, located in its file.
    Raises InputError when a chunk is not stored as a plain contiguous tensor or the chunks do
    not tile the tensor."""
    blocks = []
    for chunk in item.chunks if isinstance(item.chunks, (list, tuple)) else ():
        try:
            offsets, sizes = tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes)
        except (TypeError, ValueError):
            raise InputError(f"{root}: a chunk of {fqn!r} has no offsets or sizes", "the metadata is corrupt") from None
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > f for o, n, f in zip(offsets, sizes, shape)):
            raise InputError(f"{root}: a chunk of {fqn!r} (offsets {list(offsets)}, sizes {list(sizes)}) lies outside "
                             f"its shape {list(shape)}", "the metadata is corrupt")
        info = storage.get(MetadataIndex(fqn, offsets))
        if info is None:
            raise InputError(f"{root}: chunk {list(offsets)} of {fqn!r} has no storage entry",
                             "the metadata is corrupt: " + _AGAIN)
        if getattr(info, "transform_descriptors", None):
            raise InputError(f"{root}: chunk {list(offsets)} of {fqn!r} is stored transformed (compressed)",
                             "save the checkpoint without compression")
        path = str(root / info.relative_path)
        at = chunk_bytes_at(open_fd(path), int(info.offset), int(info.length), dtype, sizes)
        if at is None:
            raise InputError(f"{root}: chunk {list(offsets)} of {fqn!r} in {info.relative_path} is not a plain "
                             f"contiguous {dtype} tensor of shape {list(sizes)}", "the file is damaged: " + _AGAIN)
        blocks.append(Block(path, at, offsets, sizes))
    check_tiling(fqn, shape, blocks)
    return blocks


def cut(blocks: list[Block], prefix: tuple[int, ...], start: int, stop: int, dst: int, itemsize: int) -> list[Block]:
    """The parts of a global tensor's ``blocks`` that lie in rows ``[start, stop)`` of dimension
    ``len(prefix)`` at the fixed indices ``prefix``, as blocks of an output whose rows start at
    ``dst``: each is a contiguous run of its chunk's bytes (fixed leading indices, a row range,
    and the chunk's whole extent below)."""
    k = len(prefix)
    out = []
    for b in blocks:
        o, s = b.offsets, b.sizes
        if any(not o[j] <= prefix[j] < o[j] + s[j] for j in range(k)):
            continue
        lo, hi = max(start, o[k]), min(stop, o[k] + s[k])
        if lo >= hi:
            continue
        st = strides(s)
        first = sum((prefix[j] - o[j]) * st[j] for j in range(k)) + (lo - o[k]) * st[k]
        out.append(Block(b.file, b.start + first * itemsize, (dst + lo - start, *o[k + 1:]), (hi - lo, *s[k + 1:])))
    return out


class Holding:
    """The blocks of each tensor that hold a fixed leading index (a layer, a layer's expert),
    found once per index and kept for the cuts that ask again (an expert's gate, up and down
    projections): :func:`cut` of a stacked expert tensor then looks at that expert's blocks only."""

    def __init__(self, blocks: dict[str, list[Block]]) -> None:
        self._blocks = blocks
        self._found: dict[tuple[str, tuple[int, ...]], list[Block]] = {}

    def __call__(self, fqn: str, prefix: tuple[int, ...]) -> list[Block]:
        """The blocks of ``fqn`` that hold index ``prefix`` of its leading dimensions, in order."""
        if not prefix:
            return self._blocks[fqn]
        found = self._found.get((fqn, prefix))
        if found is None:
            j, at = len(prefix) - 1, prefix[-1]
            found = [b for b in self(fqn, prefix[:-1]) if b.offsets[j] <= at < b.offsets[j] + b.sizes[j]]
            self._found[(fqn, prefix)] = found
        return found


class NoArgsError(ArgsError):
    """Neither the run's arguments nor ``--config``: the HF architecture is not known."""


def _mapped(src: "MegatronSource", dtypes: dict[str, str], shapes: dict[str, tuple[int, ...]],
            vocab_size: int | None, no_mtp: bool, config: str | None) -> tuple[Any, list[Any]]:
    """The family and the output tensors: from ``--config`` when given (its field names in the
    messages), else from the run's arguments. Raises ArgsError, MappingError, NoArgsError."""
    from ckptctl.sources.megatron.config import OptionError
    from ckptctl.sources.megatron.config_v3 import describe_any
    from ckptctl.sources.megatron.mapping import MappingError, plan

    args = src.common.args if src.common else None
    if config is not None:
        from ckptctl.sources.megatron.config_hf import describe_hf, in_config_words, read_target_config

        if vocab_size is not None:
            raise OptionError("--vocab-size with --config: the config's vocab_size is the vocabulary")
        try:
            desc = describe_hf(read_target_config(config), no_mtp)
            return desc, plan(desc.family, shapes, desc.dims)
        except MappingError as exc:
            raise type(exc)(in_config_words(str(exc))) from None
    if not args:
        from ckptctl.sources.megatron.config import args_from_run_config
        from ckptctl.sources.megatron.files import read_run_config

        run = read_run_config(src.path)
        emb = shapes.get("embedding.word_embeddings.weight")
        if run is not None and emb:
            try:
                args = args_from_run_config(run, emb[0])
            except ArgsError as exc:
                raise NoArgsError(str(exc)) from None
    if not args:
        where = ("common.pt holds no Megatron-LM arguments (args)" if (src.path / "common.pt").exists()
                 else "there is no common.pt (megatron-core 0.17 and later write none)")
        raise NoArgsError(f"{where}, so the HF architecture is not known")
    main = dtypes.get("embedding.word_embeddings.weight") or next(iter(dtypes.values()))
    desc = describe_any(args, dt.CONFIG_NAMES.get(main), vocab_size, no_mtp)
    return desc, plan(desc.family, shapes, desc.dims)


class MegatronSource(DcpHfSource):
    """The model weights of one Megatron ``torch_dist`` iteration folder (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.location: MegatronLocation | None = None
        self.common: Common | None = None
        self.family: str | None = None  # the mapping applied (None: Megatron's names)
        self.config: dict[str, Any] | None = None
        self.origin: dict[str, str] = {}  # exported name -> the Megatron tensor it comes from
        self.mapping_error: str | None = None  # why no mapping applies (inspect's fallback)
        self.disagrees = False  # mapping_error is a tensor contradicting the arguments (or --config)
        self.keys = "stacked"  # how the layers are saved: stacked or per-layer (decoder.layers.{i}.*)
        self.mtp_layers = 0  # MTP layers stored (mtp.layers.{k}.*)
        self._min_run = MIN_RUN_BYTES

    @classmethod
    def open_location(cls, loc: MegatronLocation, *, names: bool = False, max_pieces: int = MAX_PIECES,
                      fallback: bool = False, min_run: int = MIN_RUN_BYTES,
                      vocab_size: int | None = None, no_mtp: bool = False,
                      config: str | None = None) -> "MegatronSource":
        """The weights at ``loc``: HF names through the mapping, or Megatron's (``names``).
        Raises InputError (a damaged checkpoint, an architecture no mapping covers; with
        ``fallback``, inspect's, the latter gives Megatron's names and ``mapping_error`` says why).
        ``max_pieces=0`` streams every tensor (the reference); ``min_run``: see :func:`pieces_of`;
        ``vocab_size``: ``--vocab-size`` (the rows of the embedding and head kept); ``no_mtp``:
        ``--no-mtp``; ``config``: ``--config`` (the target config.json, :mod:`.config_hf`)."""
        from ckptctl.sources.megatron.config import OptionError
        from ckptctl.sources.megatron.mapping import Contradiction, MappingError, split_layers

        root = loc.folder
        kind = backend(root)
        if kind not in (None, "torch_dist"):
            raise InputError(f"{root}: a Megatron {kind!r} checkpoint; only torch_dist is read",
                             "convert it to torch_dist with Megatron (--ckpt-convert-format torch_dist)")
        src = cls(path=root, kind=KIND)
        src.location, src.stem, src._min_run = loc, "model", min_run
        meta, ident = read_pinned(root / N.DCP_METADATA, lambda: read_dcp_metadata(root))
        src.pin(root / N.DCP_METADATA, ident)
        check_storage(root, meta, src.pin)
        src.common, cident = read_common(root)
        src.pin(root / "common.pt", cident)
        items = model_tensors(meta)
        if not items:
            raise InputError(f"{root}: the Megatron checkpoint holds no model tensors", _AGAIN)
        dtypes = {fqn: _dtype(root, fqn, item) for fqn, item in items.items()}
        shapes = {fqn: _shape(root, fqn, item) for fqn, item in items.items()}
        blocks: dict[str, list[Block]] = {}
        files = OpenFiles(flags=os.O_NOFOLLOW)
        try:
            for fqn, item in items.items():
                blocks[fqn] = global_blocks(root, fqn, item, meta.storage_data, dtypes[fqn], shapes[fqn],
                                            lambda path: files.fd(path, src.identity))
            files.check()
        except OSError as exc:
            raise from_oserror(exc, "cannot read the Megatron checkpoint") from None
        finally:
            files.close()
        per = split_layers(shapes)[1]
        src.keys = "per-layer" if per else "stacked"
        src.mtp_layers = len({n.split(".")[2] for n in shapes if n.startswith("mtp.layers.")})
        given = [o for o, v in (("--vocab-size", vocab_size), ("--no-mtp", no_mtp), ("--config", config)) if v]
        if names and given:
            raise UsageError(f"{given[0]} applies to the HF names; --names megatron writes Megatron's own",
                             f"drop {given[0]} or --names megatron")
        desc, outputs = None, None
        try:
            if not names:
                desc, outputs = _mapped(src, dtypes, shapes, vocab_size, no_mtp, config)
        except OptionError as exc:
            raise UsageError(f"{root}: {exc}", "drop --vocab-size" if config else
                             "pass a size no larger than the rows stored") from None
        except (ArgsError, MappingError) as exc:
            if not fallback:
                hint = ("pass the model's Hugging Face config.json with --config CONFIG_JSON, or export the Megatron "
                        "names as they are with --names megatron" if isinstance(exc, NoArgsError) else
                        "export the Megatron names as they are with --names megatron, and map them with your own code")
                raise InputError(f"{root}: {exc}", hint) from None
            src.mapping_error = str(exc)
            src.disagrees = isinstance(exc, Contradiction)
        if desc is None or outputs is None:
            for fqn in sorted(items):
                src._add(fqn, fqn, dtypes[fqn], shapes[fqn], blocks[fqn], max_pieces)
            return src
        holding = Holding(blocks)
        for o in outputs:
            size = dt.BY_NAME[dtypes[o.source]].itemsize
            parts = [b for s in o.slabs
                     for b in cut(holding(s.fqn, s.prefix), s.prefix, s.start, s.stop, s.dst, size)]
            src._add(o.name, o.source, dtypes[o.source], o.shape, parts, max_pieces)
        src.family, src.config = desc.family.name, desc.config
        src.notes = [desc.note] if desc.note else []
        src.extras = [GeneratedFile(N.CONFIG, (json.dumps(desc.config, indent=2) + "\n").encode())]  # type: ignore[list-item]
        return src

    def _add(self, name: str, fqn: str, dtype: str, shape: tuple[int, ...], blocks: list[Block],
             max_pieces: int) -> None:
        check_tiling(name, shape, blocks)
        pieces = pieces_of(blocks, shape, dtype, max_pieces, self._min_run)
        self.add(SourceTensor(name, dtype, shape, pieces=pieces), fqn)  # type: ignore[arg-type]
        self.blocks[name] = blocks
        self.origin[name] = fqn

    def place(self, t: SourceTensor, shown: Path) -> str:
        """Where ``t`` is stored, for inspect (relative to ``shown``): its ``.distcp`` file, or a
        glob when several hold it."""
        files = {Path(b.file).name for b in self.blocks[t.name]}
        rel = os.path.relpath(self.path, shown)
        name = next(iter(files)) if len(files) == 1 else "*.distcp"
        return name if rel == "." else f"{rel}/{name}"

    def describe(self) -> dict[str, Any]:
        """What inspect shows: where, the iteration, the arguments and the mapping applied."""
        from ckptctl.sources.megatron.config import summary

        loc, common = self.location, self.common
        return {"folder": str(self.path), "root": str(loc.root) if loc and loc.root else None,
                "iteration": loc.iteration if loc else None,
                "checkpoint_version": common.version if common and isinstance(common.version, (int, float)) else None,
                "args": summary(common.args) if common and common.args else None,
                "mapping": self.family, "mapping_error": self.mapping_error, "notes": list(self.notes),
                "family": (self.config or {}).get("architectures", [None])[0], "keys": self.keys,
                "mtp_layers": self.mtp_layers,
                "inert_globals": common.stubs if common else []}


def open_location(loc: MegatronLocation, path: Path, *, key: str | None = None, names: str | None = None,
                  max_pieces: int | None = None, vocab_size: int | None = None, no_mtp: bool = False,
                  config: str | None = None, **_: Any) -> MegatronSource:
    """The registry's open hook (``sources/kinds.py``): the Megatron checkpoint ``find_megatron``
    found at ``path``, under HF names through the mapping, or Megatron's own with ``names``
    ``megatron``. ``max_pieces`` unset: the ``pieces`` fast path's switch (``ckptctl.fastpaths``).
    Raises InputError (UsageError for a ``key``)."""
    from ckptctl.fastpaths import enabled

    if max_pieces is None:
        max_pieces = MAX_PIECES if enabled("pieces") else 0
    if key:
        raise key_refused(path, "Megatron-core", key, "the model's tensors are read (the optimizer state is left out)")
    return MegatronSource.open_location(loc, names=names == "megatron", max_pieces=max_pieces, vocab_size=vocab_size,
                                        no_mtp=no_mtp, config=config)
