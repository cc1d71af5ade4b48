"""Scanning a path into a :class:`~ckptctl.layout.model.Layout`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckptctl import _faults
from ckptctl.errors import InputError
from ckptctl.findings import ERROR, INFO, WARNING, Finding
from ckptctl.format import names as N
from ckptctl.format.dcp_hf_names import SHARD_NAME, SHARDED_DIR
from ckptctl.format.index import Index
from ckptctl.layout import components as C
from ckptctl.layout import native as NV
from ckptctl.layout.model import (DCP, DCP_HF, EXTRA_NAMES, PEFT, PYTORCH, SAFETENSORS, Family, Layout)
from ckptctl.layout.policy import label
from ckptctl.layout.reading import MetadataReading


def _add(lay: Layout, code: str, severity: str, path: str, message: str, hint: str | None = None) -> None:
    lay.findings.append(Finding(code, severity, path, message, hint))


def scan(path: str | os.PathLike[str], *, names: list[str] | None = None,
         reading: MetadataReading | None = None) -> Layout:
    """Describe what ``path`` holds. Raises :class:`InputError` when it does not exist.

    ``names`` restricts a directory scan to those entries (verify passes the entries left after
    screening out links that escape the directory). ``reading``: the command's metadata reading
    (a new one when none is given), kept on the layout (``Layout.reading``) for the reads that
    follow."""
    p = Path(path)
    reading = reading if reading is not None else MetadataReading()
    try:
        is_dir = p.is_dir()
        exists = p.exists()
    except OSError as exc:  # e.g. permission denied on a parent
        raise InputError(f"cannot access {p}: {exc.strerror}", "check the path and its permissions") from None
    if not exists:
        raise InputError(f"no such file or directory: {p}", "check the path (a repo id needs the local HF cache)")
    if not is_dir:
        return _scan_file(p, reading)
    if names is None:
        try:
            names = os.listdir(p)
        except OSError as exc:
            raise InputError(f"cannot list {p}: {exc.strerror}", "check the directory's permissions") from None
    _faults.point("read-listed")  # a reader between its listing and its reads (tests hold a publish here)
    return _Scanner(p, sorted(names), reading).run()


def _mode(path: str | Path) -> int | None:
    """st_mode after following links (an HF cache snapshot links into ../../blobs), or None."""
    try:
        return os.stat(path).st_mode
    except OSError:
        return None


def _regular(path: str | Path) -> bool:
    """A regular file, so reading it cannot block like a FIFO or a device would."""
    m = _mode(path)
    return m is not None and stat.S_ISREG(m)


def _scan_file(p: Path, reading: MetadataReading) -> Layout:
    lay = Layout(root=p.parent, single_file=p.name, reading=reading)
    name = p.name
    if N.is_safetensors(name):
        w = N.parse_weights_name(name)
        lay.families.append(Family(SAFETENSORS, [name], stem=w.stem if w else None, variant=w.variant if w else None))
    elif name.endswith(N.PICKLE_SUFFIXES):
        lay.families.append(Family(PYTORCH, [name], container=PYTORCH))
    elif N.parse_index_name(name) or name.endswith(N.INDEX_SUFFIXES):
        return scan(p.parent, reading=reading)
    else:
        raise InputError(f"{p} is not a checkpoint file (expected .safetensors, .bin, .pt or .pth)",
                         "pass a weights file or a checkpoint directory")
    return lay


class _Scanner:
    def __init__(self, root: Path, names: list[str], reading: MetadataReading) -> None:
        self.root = root
        self.root_text = os.fspath(root)  # joined as text where a path is only stat'ed (not shown)
        self.names = names
        self.present = set(names)
        self.reading = reading
        self.lay = Layout(root=root, reading=reading)
        self.claimed: set[str] = set()

    def add(self, code: str, severity: str, path: str, message: str, hint: str | None = None) -> None:
        _add(self.lay, code, severity, path, message, hint)

    def regular(self, path: Path) -> bool:
        return _regular(path)

    def scan_folder(self, where: Path) -> Layout:
        """A component's folder, scanned with this scan's reading."""
        return scan(where, reading=self.reading)

    def run(self) -> Layout:
        self._leftovers()
        self._named_families()
        self._dcp()
        self._strays()
        self._conflicts()
        C.scan_components(self)
        for n in self.names:
            if n not in self.claimed:
                (self.lay.extras if n in EXTRA_NAMES else self.lay.others).append(n)
        return self.lay

    def _is_dir(self, n: str) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(os.path.join(self.root_text, n)).st_mode)
        except OSError:
            return False

    def _leftovers(self) -> None:
        """First: a temp shard must never count as a weights file."""
        beside = any(N.is_safetensors(n) for n in self.names)
        for n in self.names:
            kind = N.leftover_kind(n, is_dir=self._is_dir(n), beside_safetensors=beside)
            if kind:
                self.lay.leftovers.append(n)
                self.claimed.add(n)
                _add(self.lay, "layout.leftover", WARNING, str(self.root / n),
                     f"{n} looks like a leftover of an interrupted write ({kind})",
                     "remove it with `ckptctl gc-tmp` or `ckptctl resave --repair`; an upload would push it")

    def _named_families(self) -> None:
        groups: dict[tuple[str, str, str | None], dict] = {}
        for n in self.names:
            if n in self.claimed:
                continue
            w = N.parse_weights_name(n)
            if w is not None:
                g = groups.setdefault(w.family, {"index": None, "single": None, "shards": []})
                if w.shard:
                    g["shards"].append(n)
                else:
                    g["single"] = n
                continue
            ix = N.parse_index_name(n)
            if ix is not None:
                groups.setdefault(ix, {"index": None, "single": None, "shards": []})["index"] = n
        order = {"model": 0, "pytorch_model": 1, "diffusion_pytorch_model": 2, "adapter_model": 3}
        for key in sorted(groups, key=lambda k: (order[k[0]], k[1] != "safetensors", k[2] or "")):
            self._family(key, **groups[key])

    def _family(self, key: tuple[str, str, str | None], *, index: str | None, single: str | None,
                shards: list[str]) -> None:
        stem, ext, variant = key
        kind = PEFT if stem == N.ADAPTER_STEM else (SAFETENSORS if ext == N.SAFETENSORS_EXT else PYTORCH)
        container = SAFETENSORS if ext == N.SAFETENSORS_EXT else PYTORCH
        shown = str(self.root)
        lay = self.lay

        def fam(files: list[str], index: str | None = None, doc: Index | None = None) -> None:
            lay.families.append(Family(kind, files, index=index, container=container, stem=stem, variant=variant,
                                       index_doc=doc))
            self.claimed.update(files)
            if index:
                self.claimed.add(index)

        if index is not None and not _regular(self.root / index):
            _add(lay, "layout.unsafe_index", ERROR, str(self.root / index),
                 f"{index} is not a regular file (a directory, FIFO, device or dangling link)",
                 "replace it with a real index: `ckptctl resave --repair` rebuilds it from the shard headers")
            self.claimed.add(index)
            index = None
        if index is not None:
            doc = self.reading.index(self.root / index, display=str(self.root / index))
            lay.findings.extend(doc.findings)  # a broken index is reported, never silently replaced
            files = self._indexed_files(index, doc) if doc.ok else []
            if doc.ok:
                named = set(doc.shards)
                for n in shards:
                    if n not in named:
                        _add(lay, "layout.unreferenced_shard", ERROR, str(self.root / n),
                             f"{n} is not named by {index}", "run `ckptctl resave --repair` to remove it")
            fam(files or shards, index, doc)
            self.claimed.update(shards)
            if single:
                _add(lay, "layout.index_and_single", ERROR, shown,
                     f"both {single} and {index} are present; loaders disagree on which wins",
                     "keep one with `ckptctl resave --repair --prefer index|single`")
                fam([single])
            return
        if shards:
            _add(lay, "layout.missing_index", ERROR, shown,
                 f"{len(shards)} {N.weights_file_name(stem, ext, variant=variant)} shards but no "
                 f"{N.index_name(stem, ext, variant=variant)}",
                 "run `ckptctl resave --repair` to rebuild the index from the shard headers")
            fam(shards)
        if single:
            fam([single])
            if stem == N.ADAPTER_STEM and N.ADAPTER_CONFIG not in self.present:
                _add(lay, "layout.adapter_without_config", ERROR, str(self.root / single),
                     f"{single} without adapter_config.json", "copy the adapter_config.json that belongs to it")

    def _indexed_files(self, index: str, doc: Index) -> list[str]:
        """The shards an index names that are safe member names and regular files."""
        files = []
        for s in doc.shards:
            why = N.member_problem(s)
            if why is None and _regular(os.path.join(self.root_text, s)):
                files.append(s)
                continue
            detail = f" ({why})" if why else ""
            _add(self.lay, "layout.shard_missing", ERROR, str(self.root / index),
                 f"{index} names {s!r}, which is not a file in {self.root}{detail}",
                 "restore the shard (download or export it again), or rebuild the index with "
                 "`ckptctl resave --repair`")
        return files

    def _dcp(self) -> None:
        distcp = [n for n in self.names if n.endswith(N.DCP_SUFFIX) and n not in self.claimed]
        has_meta = N.DCP_METADATA in self.present
        if not (has_meta or distcp):
            return
        self.lay.families.append(Family(DCP, distcp, index=N.DCP_METADATA if has_meta else None, container=DCP))
        self.claimed.update(distcp)
        self.claimed.add(N.DCP_METADATA)
        if not has_meta:
            _add(self.lay, "layout.dcp_without_metadata", ERROR, str(self.root), "*.distcp files without .metadata",
                 "the DCP save did not finish: save it again")

    def _native(self) -> None:
        """A model's native weights beside its Hugging Face safetensors family (Mistral's
        ``consolidated.safetensors`` + ``params.json``): a note, and kept out of every family."""
        if self.lay.family(SAFETENSORS) is None:
            return
        native = [n for n in NV.native_files(self.names) if n not in self.claimed and self.regular(self.root / n)]
        if not native:
            return
        self.lay.native = native
        self.claimed.update(native)
        _add(self.lay, "layout.native_weights", INFO, str(self.root),
             f"{', '.join(native)} with {NV.PARAMS_JSON}: the model's native weights beside its Hugging Face "
             "files (as Mistral's repositories ship them); transformers and huggingface_hub read only the files "
             "their index names")

    def _dcp_hf(self) -> None:
        """torch's DCP-HF shards (``shard-RRRRR-model-IIIII-of-NNNNN.safetensors``), in the directory
        or in its ``sharded/`` folder (a root torch's consolidation left without consolidated
        files), when the directory has no safetensors family of its own: one family (verify reads
        their sharding info; a ``sharded/`` folder beside a family is verify's finding)."""
        if self.lay.family(SAFETENSORS) is not None:
            return
        shards = [n for n in self.names if n not in self.claimed and SHARD_NAME.fullmatch(n)
                  and self.regular(self.root / n)]
        if not shards and SHARDED_DIR in self.names and self._is_dir(SHARDED_DIR):
            try:
                inner = sorted(os.listdir(self.root / SHARDED_DIR))
            except OSError:
                inner = []
            shards = [f"{SHARDED_DIR}/{n}" for n in inner if SHARD_NAME.fullmatch(n)
                      and self.regular(self.root / SHARDED_DIR / n)]
            if shards:
                self.claimed.add(SHARDED_DIR)
        if shards:
            self.lay.families.append(Family(DCP_HF, shards, container=DCP_HF))
            self.claimed.update(shards)

    def _strays(self) -> None:
        """Other weights: a lone non-standard .safetensors file, or a .pt file."""
        self._native()
        self._dcp_hf()
        lay = self.lay
        for n in self.names:
            if n in self.claimed or n in EXTRA_NAMES:
                continue
            if N.is_safetensors(n) and _regular(self.root / n):
                has_st = lay.family(SAFETENSORS) is not None
                _add(lay, "layout.unrecognised_weights", ERROR if has_st else WARNING, str(self.root / n),
                     f"{n} is a safetensors file outside the checkpoint's naming scheme",
                     "rename it, or remove it if it is stale: loaders that glob *.safetensors will pick it up")
                if not has_st:
                    lay.families.append(Family(SAFETENSORS, [n]))
                    self.claimed.add(n)
            elif (n.endswith(N.TORCH_SAVE_SUFFIXES) and _regular(self.root / n) and not lay.families
                  and not NV.TRAINER_STATE.fullmatch(n)):  # an optimizer state is not a model
                lay.families.append(Family(PYTORCH, [n], container=PYTORCH))
                self.claimed.add(n)

    def _conflicts(self) -> None:
        lay, shown = self.lay, str(self.root)
        by_slot: dict[tuple[str, str | None], set[str]] = {}
        for f in lay.families:
            by_slot.setdefault(f.slot, set()).add(f.container)
        for (slot, variant), containers in sorted(by_slot.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            if {SAFETENSORS, PYTORCH} <= containers:
                if slot != "adapter_model" and self._twins(slot, variant):
                    continue
                if slot == "adapter_model":
                    _add(lay, "layout.two_adapters", ERROR, shown,
                         "both adapter_model.safetensors and adapter_model.bin", "remove the stale one")
                else:
                    what = f"{slot}.{variant}" if variant else slot
                    _add(lay, "layout.two_families", ERROR, shown,
                         f"both safetensors and pickle ({what}*.bin) weights are present",
                         "keep one with `ckptctl resave --repair --prefer safetensors` (an upload would push both)")
        kinds = {f.kind for f in lay.families}
        if PEFT in kinds and kinds - {PEFT}:
            _add(lay, "layout.adapter_beside_model", INFO, shown, "a PEFT adapter sits beside full model weights")

    def _twins(self, slot: str, variant: str | None) -> bool:
        """The one pickle family of a slot holds exactly the tensors of its one safetensors family
        (the conversion bot's layout): marked, with a note. Two families of a container (an index
        and a single file) are not compared here."""
        fams = [f for f in self.lay.families if f.slot == (slot, variant)]
        st = [f for f in fams if f.container == SAFETENSORS]
        pt = [f for f in fams if f.container == PYTORCH]
        if len(st) != 1 or len(pt) != 1 or not NV.same_tensors(self.root, st[0], pt[0], self.reading):
            return False
        pt[0].twin_of = label(st[0])
        _add(self.lay, "layout.converted_pickle", INFO, str(self.root),
             f"{pt[0].describe()} holds the same tensors (names, dtypes, shapes) as {st[0].describe()}, as the "
             "safetensors conversion leaves a repository: transformers and huggingface_hub load the safetensors "
             "files; `ckptctl verify --deep` compares the bytes")
        return True
