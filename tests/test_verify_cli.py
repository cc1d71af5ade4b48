"""verify as a command: exit codes, output streams, --json, --recursive, repo ids, and the safety
promises (no torch import for safetensors, pickles never executed, escaping paths never opened)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import corpus
from ckptctl.cli.verify_cmd import verify

RUNNER = (
    "import sys, typer\n"
    "from ckptctl.cli.verify_cmd import verify\n"
    "{prelude}"
    "app = typer.Typer(); app.command()(verify)\n"
    "try:\n"
    "    app()\n"
    "except SystemExit as exc:\n"
    "    code = exc.code\n"
    "{epilogue}"
    "print('TORCH-IMPORTED' if 'torch' in sys.modules else 'TORCH-FREE', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def subprocess_verify(*args: object, env: dict[str, str] | None = None, prelude: str = "",
                      epilogue: str = "") -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "CKPTCTL_DEBUG"}
    full.update(env or {})
    code = RUNNER.format(prelude=prelude, epilogue=epilogue)
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env=full, timeout=120)


def invoke(*args: object):
    app = typer.Typer()
    app.command("verify")(verify)
    return CliRunner().invoke(app, [str(a) for a in args])


# --------------------------------------------------------------------------------------------
# safety promises, in real processes


def test_safetensors_and_bin_verification_never_import_torch(tmp_path: Path) -> None:
    corpus.make_clean_sharded(tmp_path / "st")
    corpus.make_manifest_hash_mismatch(tmp_path / "st-manifest")
    corpus.make_bin_unsafe_pickle(tmp_path / "bin")
    corpus.make_clean_adapter(tmp_path / "adapter")
    proc = subprocess_verify(tmp_path / "st", tmp_path / "st-manifest", tmp_path / "bin", tmp_path / "adapter",
                             "--static", "--deep", "--json")
    assert "TORCH-FREE" in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1
    found = {r["path"]: {f["code"] for f in r["findings"]} for r in doc["results"]}
    assert "manifest.hash_mismatch" in found[str(tmp_path / "st-manifest")]
    assert "pickle.unsafe_global" in found[str(tmp_path / "bin")]
    assert all(r["ok"] for r in doc["results"] if r["path"] in (str(tmp_path / "st"), str(tmp_path / "adapter")))


def test_dcp_directories_do_not_import_torch(tmp_path: Path) -> None:
    """DCP metadata is read by our own allow-list reader (format/dcp_metadata)."""
    corpus.make_clean_dcp(tmp_path / "dcp")
    proc = subprocess_verify(tmp_path / "dcp", "--fail-on", "warning")
    assert proc.returncode == 0, proc.stderr
    assert "TORCH-FREE" in proc.stderr


def test_dcp_result_counts_the_tensors_of_the_metadata(tmp_path: Path) -> None:
    """The tensor count of a DCP directory is the metadata's (it was reset to 0 once)."""
    from ckptctl.verify import verify_path

    corpus.make_clean_dcp(tmp_path / "dcp")
    res = verify_path(tmp_path / "dcp")
    assert res.kind == "dcp" and res.tensors == len(corpus.torch_state()) > 0
    assert not [f for f in res.findings if f.severity != "info"], res.findings


def test_oversized_dcp_metadata_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A 1 GiB .metadata (sparse: no disk used) is refused from its size; nothing near it is read."""
    import tracemalloc

    from ckptctl.format.dcp_metadata import MAX_METADATA_BYTES
    from ckptctl.verify import verify_path

    corpus.make_clean_dcp(tmp_path / "dcp")
    os.truncate(tmp_path / "dcp" / ".metadata", MAX_METADATA_BYTES + 1)
    tracemalloc.start()
    try:
        res = verify_path(tmp_path / "dcp")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bad = [f for f in res.findings if f.code == "dcp.bad_metadata"]
    assert bad and "too large" in bad[0].message and peak < 64 << 20


def test_malicious_pickles_are_reported_and_never_executed(tmp_path: Path) -> None:
    import torch

    bin_dir, legacy_dir, dcp_dir = tmp_path / "bin", tmp_path / "legacy", tmp_path / "dcp"
    assert corpus.make_bin_unsafe_pickle(bin_dir) == "pickle.unsafe_global"
    assert corpus.make_bin_legacy_unsafe_pickle(legacy_dir) == "pickle.unsafe_global"
    assert corpus.make_dcp_unsafe_global(dcp_dir) == "dcp.unsafe_global"
    for d, code in ((bin_dir, "pickle.unsafe_global"), (legacy_dir, "pickle.unsafe_global"),
                    (dcp_dir, "dcp.unsafe_global")):
        marker = corpus.pickle_marker(d)
        res = invoke(d, "--json")
        assert res.exit_code == 1
        findings = [f for r in json.loads(res.stdout)["results"] for f in r["findings"] if f["code"] == code]
        assert findings and "builtins.exec" in findings[0]["details"]["globals"]
        assert not marker.exists(), "verify executed the pickle"
    # Control: the payload is live. Loading the same files the unsafe way creates the markers.
    for d in (bin_dir, legacy_dir):
        torch.load(d / "pytorch_model.bin", weights_only=False)
        assert corpus.pickle_marker(d).read_text() == "pwned"
    import pickle

    pickle.loads((dcp_dir / ".metadata").read_bytes())
    assert corpus.pickle_marker(dcp_dir).exists()


def test_paths_that_escape_are_never_opened(tmp_path: Path) -> None:
    """An audit hook sees every open() of the process: the outside files are never among them."""
    cases = {}
    for make in (corpus.make_index_parent_path, corpus.make_index_absolute_path, corpus.make_symlink_escape,
                 corpus.make_config_symlink_escape):
        d = tmp_path / make.__name__
        cases[d] = make(d)
    outside = [p for d in cases for p in (d.parent / (d.name + ".outside")).iterdir()]
    prelude = ("opened = []\n"
               "def hook(event, args):\n"
               "    if event == 'open' and isinstance(args[0], (str, bytes)):\n"
               "        opened.append(str(args[0]))\n"
               "sys.addaudithook(hook)\n")
    epilogue = ("import os, json\n"
                "json.dump([os.path.realpath(p) for p in opened], open(os.environ['OPENED_LOG'], 'w'))\n")
    log = tmp_path / "opened.json"
    proc = subprocess_verify(*cases, "--json", env={"OPENED_LOG": str(log)}, prelude=prelude, epilogue=epilogue)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    for r, (d, code) in zip(doc["results"], cases.items()):
        assert code in {f["code"] for f in r["findings"]}
    opened = set(json.loads(log.read_text()))
    assert any(p.endswith("model-00001-of-00003.safetensors") for p in opened)  # the hook does see opens
    for p in outside:
        assert os.path.realpath(p) not in opened, f"{p} was opened"


# --------------------------------------------------------------------------------------------
# exit codes and streams


def test_clean_output_streams_and_exit_zero(tmp_path: Path) -> None:
    corpus.make_clean_sharded(tmp_path / "c")
    res = invoke(tmp_path / "c")
    assert res.exit_code == 0
    assert res.stdout == ""  # no findings: no table
    assert "verify: OK" in res.stderr
    res = invoke(tmp_path / "c", "--json")
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and doc["summary"]["paths"] == 1 and doc["results"][0]["kind"] == "safetensors-sharded"
    assert {f["name"] for f in doc["results"][0]["files"]} >= {"model.safetensors.index.json", corpus.shard(1)}


def test_findings_table_on_stdout_verdict_on_stderr(tmp_path: Path) -> None:
    corpus.make_shard_missing(tmp_path / "b")
    res = invoke(tmp_path / "b")
    assert res.exit_code == 1
    assert "layout.shard_missing" in res.stdout and "model-00002-of-00003.safetensors" in res.stdout
    assert "verify: FAIL" in res.stderr and "layout.shard_missing" not in res.stderr
    quiet = invoke(tmp_path / "b", "-q")
    assert quiet.exit_code == 1 and quiet.stderr == ""


@pytest.mark.parametrize("args,needle", [
    ([], "no path given"),
    (["{tmp}/nope"], "no such file or directory"),
    (["{tmp}/c", "--max-shard-size", "5 parsecs"], "--max-shard-size"),
    (["{tmp}/c/config.json", "--recursive"], "--recursive needs a directory"),
    (["{tmp}/empty", "--recursive"], "no checkpoints below"),
    (["{tmp}/c", "--base", "{tmp}/no-base"], "--base"),
    (["{tmp}/c", "--fail-on", "sometimes"], ""),
    (["{tmp}/c/config.json"], "not a checkpoint file"),
])
def test_usage_errors_exit_two(tmp_path: Path, args: list[str], needle: str) -> None:
    corpus.make_clean_sharded(tmp_path / "c")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    res = invoke(*[a.format(tmp=tmp_path) for a in args])
    assert res.exit_code == 2, res.stderr
    assert needle in res.stderr
    if needle:
        js = invoke(*[a.format(tmp=tmp_path) for a in args], "--json")
        doc = json.loads(js.stdout)
        assert doc["ok"] is False and doc["error"]["exit_code"] == 2


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux /proc")
def test_io_error_exits_three_even_with_other_findings(tmp_path: Path) -> None:
    """Reading /proc/self/mem at offset 0 fails with EIO: a real I/O error, reported as io.error."""
    corpus.make_shard_missing(tmp_path / "b")
    os.symlink("/proc/self/mem", tmp_path / "mem.safetensors")
    res = invoke(tmp_path / "b", tmp_path / "mem.safetensors", "--deep", "--json")
    assert res.exit_code == 3
    doc = json.loads(res.stdout)
    assert doc["ok"] is False
    io = [f for r in doc["results"] for f in r["findings"] if "Input/output error" in f["message"]]
    assert io and {f["code"] for f in io} == {"io.error"} and io[0]["path"] == str(tmp_path / "mem.safetensors")
    assert "I/O ERROR" in res.stderr


def test_single_files_can_be_verified(tmp_path: Path) -> None:
    corpus.make_clean_single(tmp_path / "s")
    corpus.make_bin_storage_truncated(tmp_path / "b")
    ok = invoke(tmp_path / "s" / "model.safetensors", "--deep", "--json")
    assert ok.exit_code == 0
    r = json.loads(ok.stdout)["results"][0]
    assert r["kind"] == "safetensors" and r["files"][0]["sha256"] == hashlib.sha256(
        (tmp_path / "s" / "model.safetensors").read_bytes()).hexdigest()
    bad = invoke(tmp_path / "b" / "pytorch_model.bin", "--json")
    assert bad.exit_code == 1
    assert "pickle.storage_truncated" in {f["code"] for f in json.loads(bad.stdout)["results"][0]["findings"]}


def test_recursive_verifies_every_checkpoint_below_a_root(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    corpus.make_clean_sharded(root / "step_100")
    corpus.make_clean_single(root / "step_200")
    corpus.make_truncated_shard(root / "step_300")
    corpus.make_clean_adapter(root / "runs" / "lora" / "step_50")
    corpus.make_clean_sharded(root / "_tmp_step_400.0000018a3b2c4d5e-1a2b3c4d" / "data")  # a writer's staging
    corpus.make_clean_single(root / ".cache" / "x")
    res = invoke(root, "--recursive", "--json")
    doc = json.loads(res.stdout)
    paths = [r["path"] for r in doc["results"]]
    lora = root / "runs" / "lora"
    assert paths == [str(lora / "step_50"), str(lora / "step_50.base"),  # the adapter's base model sits beside it
                     str(root / "step_100"), str(root / "step_200"), str(root / "step_300")]
    assert res.exit_code == 1 and doc["summary"]["failed"] == 1
    assert [r["ok"] for r in doc["results"]] == [True, True, True, True, False]
    table = invoke(root, "-r")
    assert "checkpoints" in table.stdout and "header.truncated" in table.stdout


def test_fail_on_warning(tmp_path: Path) -> None:
    corpus.make_dtype_mismatch(tmp_path / "w")
    assert invoke(tmp_path / "w").exit_code == 0
    assert invoke(tmp_path / "w", "--fail-on", "warning").exit_code == 1
    assert invoke(tmp_path / "w", "--fail-on", "WARNING").exit_code == 1


def test_max_shard_size(tmp_path: Path) -> None:
    corpus.make_clean_sharded(tmp_path / "c")
    res = invoke(tmp_path / "c", "--max-shard-size", "2KB", "--json")
    codes = [f["code"] for f in json.loads(res.stdout)["results"][0]["findings"]]
    assert "dir.shard_too_large" in codes and res.exit_code == 0
    assert invoke(tmp_path / "c", "--max-shard-size", "1MiB", "--fail-on", "warning").exit_code == 0


def test_adapter_base_option_and_unavailable_base(tmp_path: Path) -> None:
    d = tmp_path / "a"
    corpus.make_adapter_missing_keys(d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    base = Path(cfg["base_model_name_or_path"])
    cfg["base_model_name_or_path"] = "nobody/not-downloaded"
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    res = invoke(d, "--json", "-v")
    codes = {f["code"] for f in json.loads(res.stdout)["results"][0]["findings"]}
    assert "adapter.base_unavailable" in codes and "adapter.missing_keys" not in codes and res.exit_code == 0
    res = invoke(d, "--base", base, "--json")
    assert "adapter.missing_keys" in {f["code"] for f in json.loads(res.stdout)["results"][0]["findings"]}
    assert res.exit_code == 1


def _fake_hf_cache(cache: Path, repo: str, src: Path) -> Path:
    """The on-disk layout huggingface_hub's cache uses: blobs + refs/main + snapshot symlinks."""
    base = cache / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, base / "blobs" / digest)
        os.symlink(f"../../blobs/{digest}", snap / f.name)
    return snap


def test_repo_id_in_the_local_hf_cache(tmp_path: Path) -> None:
    corpus.make_clean_sharded(tmp_path / "src")
    cache = tmp_path / "hub"
    snap = _fake_hf_cache(cache, "tiny-org/tiny-llama", tmp_path / "src")
    corpus.make_clean_single(tmp_path / "elsewhere")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    ok = subprocess_verify("tiny-org/tiny-llama", "--deep", "--json", "--static", env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    r = json.loads(ok.stdout)["results"][0]
    assert r["path"] == "tiny-org/tiny-llama" and r["root"] == str(snap) and r["kind"] == "safetensors-sharded"
    assert "TORCH-FREE" in ok.stderr
    # a snapshot link that leaves the repo's cache folder is an escape
    (snap / "generation_config.json").unlink()
    os.symlink(tmp_path / "elsewhere" / "generation_config.json", snap / "generation_config.json")
    bad = subprocess_verify("tiny-org/tiny-llama", "--json", env=env)
    assert bad.returncode == 1
    assert "dir.symlink_escape" in {f["code"] for f in json.loads(bad.stdout)["results"][0]["findings"]}
    missing = subprocess_verify("tiny-org/other", env=env)
    assert missing.returncode == 2 and "local Hugging Face cache" in missing.stderr


def test_variant_family_beside_the_main_one_is_clean(tmp_path: Path) -> None:
    d = tmp_path / "v"
    corpus.make_clean_sharded(d)
    corpus.write_checkpoint(d, corpus.llama_tensors(seed=1), prefix="model.fp16")
    corpus.write_checkpoint(d, [{"x.weight": corpus.np.ones((2, 2), corpus.np.float32)}], prefix="model.ema")
    res = invoke(d, "--json", "--fail-on", "warning")
    assert res.exit_code == 0, res.stdout
