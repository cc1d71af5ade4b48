"""Layouts the Hub serves that hold a model twice, and are clean:

- a model's native files beside its Hugging Face shards (Mistral's repositories ship
  ``consolidated.safetensors`` + ``params.json`` for ``mistral-inference`` beside the
  transformers shards): transformers and huggingface_hub read only the files their index names;
- ``pytorch_model*.bin`` beside ``model*.safetensors`` holding the same tensors (what the
  safetensors conversion bot leaves: it adds the safetensors files and keeps the pickles):
  transformers reads the safetensors family (``use_safetensors`` defaults to it when present), and
  ``use_safetensors=False`` reads the same tensors; compared here by names, dtypes and shapes from
  the headers and the pickle records (no torch; ``verify --deep`` compares the bytes);

and the file names of torch's DCP-HF ``sharded/`` output (``HuggingFaceStorageWriter`` with
``save_distributed=True``), each file one rank's part of its tensors.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckptctl.layout.model import Family
from ckptctl.layout.reading import MetadataReading

PARAMS_JSON = "params.json"  # the native config mistral-inference reads
# mistral-inference's weights: consolidated.safetensors, consolidated.NN.safetensors, shards and their index
NATIVE = re.compile(r"consolidated(?:\.\d+|-\d{5}-of-\d{5})?\.safetensors(?:\.index\.json)?")
# what the HF Trainer and accelerate save beside the model in a checkpoint-N/ folder: never a model
TRAINER_STATE = re.compile(r"(?:optimizer|scheduler|scaler)\.(?:pt|bin)|rng_state(?:_\d+)?\.pth|training_args\.bin"
                           r"|random_states_\d+\.pkl")


def native_files(names: list[str]) -> list[str]:
    """The files of ``names`` that are a model's native weights beside ``params.json``."""
    if PARAMS_JSON not in names:
        return []
    return [n for n in names if NATIVE.fullmatch(n)]


def same_tensors(root: Path, st: Family, pt: Family, reading: MetadataReading) -> bool:
    """Whether the pickle family ``pt`` holds exactly the tensors of the safetensors family ``st``
    (names, dtypes, shapes). Tied weights the pickle stores as one view under several names are
    one tensor, stored under any one of those names in safetensors. False whenever a file cannot
    be read exactly (a damaged or legacy pickle, a header with errors)."""
    from ckptctl.format.pickle_specs import state_dict_specs  # the pickle reader: only for a twin asked about

    stored = {}
    for n in st.files:
        hdr = reading.header(root / n, display=str(root / n))
        if not hdr.ok:
            return False
        stored.update(hdr.tensors.specs())
    seen: set[str] = set()
    for n in pt.files:
        try:
            ps = state_dict_specs(root / n)
        except OSError:
            return False
        if ps is None:
            return False
        for group in ps.groups:
            held = [g for g in group if g in stored]
            if len(held) != 1 or held[0] in seen:
                return False
            seen.add(held[0])
            spec, want = ps.specs[held[0]], stored[held[0]]
            if (spec.dtype, tuple(spec.shape)) != (want.dtype, tuple(want.shape)):
                return False
    return seen == set(stored)
