"""transformers layouts that are directories of directories: a Trainer output dir, an HF cache.

* ``transformers/trainer``: ``Trainer.train()`` of the tiny Llama on CPU, 2 steps, ``save_steps=2``:
  ``<dir>/checkpoint-2/`` with ``model.safetensors``, ``config.json``, ``generation_config.json``,
  ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``,
  ``training_args.bin``. Loaded with ``from_pretrained(<dir>/checkpoint-2)``; the reference is the same
  training without checkpoints.
* ``transformers/hf-cache``: a Hugging Face hub cache root holding ``ckptctl-test/tiny-llama`` laid out
  as huggingface_hub's ``hf_hub_download`` lays it out (file_download.py): ``CACHEDIR.TAG``,
  ``.locks/models--ckptctl-test--tiny-llama/<etag>.lock``, and in ``models--ckptctl-test--tiny-llama/``:
  ``blobs/<etag>`` (sha256 of LFS files, git blob sha1 of the others), ``refs/main`` (the commit, no
  newline), ``snapshots/<commit>/<file>`` relative symlinks ``../../blobs/<etag>``, and
  ``.no_exist/<commit>/model.safetensors`` (what a probe of the sharded repo leaves). An older snapshot
  holds a single-file model and the same config.json blob. Written with ``save_pretrained`` into a
  scratch directory whose files are then filed into the cache. Loaded with
  ``from_pretrained(REPO_ID, cache_dir=<dir>, local_files_only=True)`` (refs/main's snapshot).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from .entry import Recipe, count_parameters, module_tensors, seeded
from .transformers_models import PARAMETERS, SHARD, from_pretrained_strict, make_model, run_model, transformers_module

STEPS = 2
CHECKPOINT = f"checkpoint-{STEPS}"
REPO_ID = "ckptctl-test/tiny-llama"
REPO_FOLDER = "models--" + REPO_ID.replace("/", "--")
COMMIT = hashlib.sha1(b"ckptctl ecosystem: main").hexdigest()
OLD_COMMIT = hashlib.sha1(b"ckptctl ecosystem: first upload").hexdigest()
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl", ".ckpt", ".h5", ".msgpack")
CACHEDIR_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                "# This file is a cache directory tag created by huggingface_hub.\n"
                "# For information about cache directory tags, see:\n"
                "#\thttps://bford.info/cachedir/\n")


# -- Trainer --------------------------------------------------------------------------------------


def train(model: Any, output_dir: Path, *, save: bool) -> Any:
    """``Trainer.train()``: 2 steps of batch 2 on CPU, checkpoint at step 2 when ``save``."""
    import torch

    t = transformers_module()
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = t.TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
        save_strategy="steps" if save else "no", save_steps=STEPS, use_cpu=True, report_to="none",
        logging_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    with seeded(0):  # Trainer seeds the global RNGs itself
        trainer = t.Trainer(model=model, args=args, train_dataset=data)
        trainer.remove_callback(t.trainer_callback.PrinterCallback)  # it prints the metrics to stdout
        trainer.train()
    return model.eval()


def _trained() -> Any:
    with tempfile.TemporaryDirectory(prefix="ecosystem-trainer-") as scratch:
        return train(make_model("llama"), Path(scratch), save=False)


def _load_trainer(d: Path) -> Any:
    return from_pretrained_strict("LlamaForCausalLM", d / CHECKPOINT)


# -- HF cache -------------------------------------------------------------------------------------


def etag(name: str, data: bytes) -> str:
    """The hub's ETag a blob is filed under: sha256 for LFS files, the git blob sha1 otherwise."""
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def file_snapshot(cache: Path, commit: str, files: dict[str, bytes]) -> None:
    """File ``files`` (snapshot-relative name -> bytes) into ``cache`` as revision ``commit``."""
    storage = cache / REPO_FOLDER
    for name, data in sorted(files.items()):
        tag = etag(name, data)
        blob = storage / "blobs" / tag
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        pointer = storage / "snapshots" / commit / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
        lock = cache / ".locks" / REPO_FOLDER / f"{tag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
        lock.chmod(0o664)  # huggingface_hub's WeakFileLock creates them group-writable and leaves them


def saved_files(model: Any, **kwargs: Any) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory(prefix="ecosystem-cache-") as scratch:
        model.save_pretrained(scratch, **kwargs)
        return {p.name: p.read_bytes() for p in sorted(Path(scratch).iterdir())}


def save_cache(model: Any, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "CACHEDIR.TAG").write_text(CACHEDIR_TAG)
    file_snapshot(d, OLD_COMMIT, saved_files(make_model("llama", seed=5)))
    file_snapshot(d, COMMIT, saved_files(model, max_shard_size=SHARD))
    refs = d / REPO_FOLDER / "refs" / "main"
    refs.parent.mkdir(parents=True, exist_ok=True)
    refs.write_text(COMMIT)
    missing = d / REPO_FOLDER / ".no_exist" / COMMIT / "model.safetensors"
    missing.parent.mkdir(parents=True, exist_ok=True)
    missing.touch()


def _load_cache(d: Path) -> Any:
    return from_pretrained_strict("LlamaForCausalLM", REPO_ID, cache_dir=str(d), local_files_only=True)


def recipes() -> list[Recipe]:
    common = dict(library="transformers", parameters=PARAMETERS["llama"], tensors=module_tensors, run=run_model,
                  count=count_parameters, requires=("transformers", "accelerate"))
    return [
        Recipe(name="transformers/trainer", layout="trainer", make=lambda: make_model("llama"),
               save=lambda m, d: train(m, d, save=True) and None, expected=_trained, reload=_load_trainer,
               notes=f"Trainer output_dir with {CHECKPOINT}/ (model, optimizer.pt, scheduler.pt, rng_state.pth, "
                     "trainer_state.json, training_args.bin)", **common),
        Recipe(name="transformers/hf-cache", layout="hf-cache", make=lambda: make_model("llama"), save=save_cache,
               reload=_load_cache,
               notes=f"hub cache root: {REPO_FOLDER}/ with blobs/, refs/main, snapshots/<commit>/ symlinks "
                     "(sharded Llama at main, a single-file one at an older commit), .no_exist/; .locks/; "
                     "CACHEDIR.TAG. Repo id " + REPO_ID, **common),
    ]
