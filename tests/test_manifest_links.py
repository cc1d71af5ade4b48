"""``--manifest`` on a Hugging Face cache snapshot, whose files are relative links into
``../../blobs``: carried as links into the staging directory, they resolve only once published,
so the manifest hashes what they will point at (issue 15: it failed with "check the path")."""

from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors.torch import save_file

from ckptctl.manifest import MANIFEST_NAME
from tests.support import run_ckptctl


def _snapshot(root):
    blobs, snap = root / "blobs", root / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    save_file({"model.embed.weight": torch.arange(32.0).reshape(8, 4)}, str(blobs / "w"), metadata={"format": "pt"})
    (blobs / "c").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    digests = {}
    for blob, name in (("w", "model.safetensors"), ("c", "config.json")):
        data = (blobs / blob).read_bytes()
        digests[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        os.symlink(f"../../blobs/{blob}", snap / name)
    return snap, digests


def test_resave_manifest_in_a_cache_snapshot(tmp_path):
    snap, digests = _snapshot(tmp_path)
    run_ckptctl("resave", str(snap), "--manifest", "-q", check=True)
    assert os.readlink(snap / "config.json") == "../../blobs/c"  # still the cache's link
    doc = json.loads((snap / MANIFEST_NAME).read_text())
    assert doc["files"]["config.json"] == digests["config.json"]
    assert doc["files"]["model.safetensors"] == digests["model.safetensors"]
    assert set(doc["files"]) == {"config.json", "model.safetensors"}
    run_ckptctl("verify", str(snap), check=True)


def test_export_manifest_from_a_cache_snapshot(tmp_path):
    snap, digests = _snapshot(tmp_path)
    out = tmp_path / "out"
    run_ckptctl("export", str(snap), str(out), "--manifest", "-q", check=True)
    doc = json.loads((out / MANIFEST_NAME).read_text())
    assert doc["files"]["model.safetensors"] == digests["model.safetensors"]
    assert doc["files"]["config.json"] == digests["config.json"]
    run_ckptctl("verify", str(out), check=True)
