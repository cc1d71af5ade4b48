"""The layout model: kinds, families, components and the layout of a directory (data only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckptctl.findings import Finding
from ckptctl.format import names as N
from ckptctl.format.index import Index
from ckptctl.layout.reading import MetadataReading

MODEL = "model"  # a directory with one model's weights
PIPELINE = "diffusers-pipeline"  # model_index.json + component folders
SENTENCE_TRANSFORMERS = "sentence-transformers"  # modules.json + module folders
ROOTS = (PIPELINE, SENTENCE_TRANSFORMERS)  # multi-component roots: written (resave, export) as a whole
MODEL_INDEX = "model_index.json"
MODULES_JSON = "modules.json"

SAFETENSORS = "safetensors"
PYTORCH = "pytorch"
PEFT = "peft"
DCP = "dcp"
DCP_HF = "dcp-hf"  # torch's HuggingFaceStorageWriter sharded output (each file one rank's part of its tensors)

ST_INDEX = N.index_name("model", N.SAFETENSORS_EXT)
PT_INDEX = N.index_name("pytorch_model", N.BIN_EXT)

EXTRA_NAMES = frozenset({
    N.CONFIG, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json", "spiece.model", "sentencepiece.bpe.model", "adapter_config.json",
    "README.md",
})
# Extras copied by export from a source directory (README is the user's, not the model's).
COPIED_EXTRAS = EXTRA_NAMES - {"README.md"}

# Stems whose safetensors and pickle families hold the same model (they compete).
_SLOT = {"model": "model", "pytorch_model": "model", "diffusion_pytorch_model": "diffusion_pytorch_model",
         "adapter_model": "adapter_model"}


def slot_of(stem: str | None, variant: str | None = None) -> tuple[str, str | None]:
    """The slot (see :attr:`Family.slot`) a family named after ``stem`` and ``variant`` fills."""
    return _SLOT.get(stem or "model", "model"), variant


def named_slot(name: str) -> tuple[str, str | None] | None:
    """The slot a library-named weights or index file belongs to, or None for any other name."""
    w = N.parse_weights_name(name)
    if w is not None:
        return slot_of(w.stem, w.variant)
    ix = N.parse_index_name(name)
    return slot_of(ix[0], ix[2]) if ix is not None else None


def safetensors_stem(stem: str | None) -> str | None:
    """The stem a family's weights get in safetensors: the pickle stem ``pytorch_model`` is
    transformers' ``model``; every other library stem is kept (None for unnamed families)."""
    return _SLOT.get(stem) if stem else None


def is_leftover(name: str, *, is_dir: bool | None = None) -> str | None:
    """The leftover kind a directory entry's name is (see ``names.LEFTOVERS``), or None. Without
    ``is_dir`` the name is tried as a file and as a directory."""
    kinds = (False, True) if is_dir is None else (is_dir,)
    for d in kinds:
        kind = N.leftover_kind(name, is_dir=d)
        if kind:
            return kind
    return None


@dataclass
class Family:
    """One set of weight files that together form a checkpoint."""

    kind: str  # safetensors | pytorch | peft | dcp
    files: list[str]  # data files, relative to the layout root (a file source: its own name)
    index: str | None = None
    container: str = SAFETENSORS  # safetensors | pytorch | dcp
    stem: str | None = None  # the library's name (names.STEMS); None for DCP and stray files
    variant: str | None = None  # model.<variant>.safetensors
    index_doc: Index | None = field(default=None, repr=False)  # the parsed index, read once by scan
    # a pickle family holding exactly the tensors of the safetensors family named here (the
    # conversion bot's layout, ``layout.native``): no command reads it unless asked by kind
    twin_of: str | None = None

    @property
    def all_files(self) -> list[str]:
        return self.files + ([self.index] if self.index else [])

    @property
    def sharded(self) -> bool:
        return self.index is not None or len(self.files) > 1

    @property
    def slot(self) -> tuple[str, str | None]:
        """Families in the same slot hold the same model: at most one may be live."""
        if self.stem:
            return slot_of(self.stem, self.variant)
        return ("model" if self.kind in (SAFETENSORS, PYTORCH) else self.kind), self.variant

    def describe(self) -> str:
        if self.index:
            return f"{self.index} ({len(self.files)} shards)"
        return ", ".join(self.files) if len(self.files) <= 3 else f"{len(self.files)} files"


@dataclass
class Component:
    """One component of a multi-component root, as its manifest (``model_index.json`` or
    ``modules.json``) names it."""

    name: str  # diffusers: the pipeline attribute ("unet"); sentence-transformers: the module name
    path: str  # folder relative to the root ("" for a sentence-transformers root module)
    library: str | None  # diffusers | transformers | sentence_transformers | ...
    cls: str | None  # the class the library instantiates
    layout: Layout | None = None  # None when the folder is missing or unsafe (a finding says so)

    @property
    def has_weights(self) -> bool:
        return self.layout is not None and bool(self.layout.families)


@dataclass
class Layout:
    """What a directory holds, by kind: weights families, extras, other files, leftovers, and findings."""

    root: Path  # the directory (for a single file: its parent)
    single_file: str | None = None  # the file, when the path given was a file
    families: list[Family] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    # A multi-component root (diffusers pipeline, sentence-transformers model): ``kind`` says
    # which, ``components`` lists each component with its own layout.
    kind: str = MODEL
    components: list[Component] = field(default_factory=list)
    # a model's native weights beside its Hugging Face families (Mistral's consolidated.safetensors
    # with params.json): kept, read by no command, their headers checked by verify
    native: list[str] = field(default_factory=list)
    # the command's metadata reading that scanned it, for the reads that follow
    reading: MetadataReading = field(default_factory=MetadataReading, repr=False, compare=False)

    def family(self, kind: str) -> Family | None:
        """The first family of ``kind`` that is not a variant."""
        return next((f for f in self.families if f.kind == kind and f.variant is None), None)

    @property
    def variants(self) -> list[Family]:
        return [f for f in self.families if f.variant is not None]

    @property
    def weight_files(self) -> set[str]:
        return {name for fam in self.families for name in fam.all_files}
