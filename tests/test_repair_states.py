"""``resave --repair`` on the states re-saves really leave (issue 14), each built the way the real
tools leave it: transformers ``save_pretrained``, safetensors, huggingface_hub, accelerate, and a
streaming saver (``tests/streaming_saver.py``) run as a real process and killed with SIGKILL.

What is certain is repaired to the newest complete save; two complete saves are refused with each
listed and the exact ``--prefer`` values; a repair whose result would still fail verify is refused;
nothing is written to a clean checkpoint; a symlinked checkpoint stays a link."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import REPO, differences, load_glob, load_hub, run_ckptctl, staging_dirs, tiny_llama

SAVER = Path(__file__).with_name("streaming_saver.py")
INDEX = "model.safetensors.index.json"


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _tree(d: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry of ``d``: (inode, bytes); links as (inode, target)."""
    out = {}
    for n in sorted(os.listdir(d)):
        p = d / n
        out[n] = (os.lstat(p).st_ino, os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
    return out


def _stream(model, d: Path, per_shard: int, stop_at: str | None, tmp: Path) -> None:
    """Re-save ``model`` into ``d`` with the streaming saver, killed (SIGKILL) at ``stop_at``."""
    model.config.save_pretrained(d)  # the saver writes the new config first
    src = tmp / f"src-{os.getpid()}-{len(os.listdir(tmp))}.safetensors"
    save_file(_state(model), str(src), metadata={"format": "pt"})
    argv = [sys.executable, str(SAVER), str(src), str(d), "--per-shard", str(per_shard)]
    proc = subprocess.Popen(argv + (["--stop-at", stop_at] if stop_at else []), stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        line = proc.stdout.readline().strip()
        assert line == (f"STOPPED {stop_at}" if stop_at else "DONE"), line
        if stop_at:
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()
    if stop_at:
        assert proc.returncode == -signal.SIGKILL


def _shards(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("model-"))


def _repaired(d: Path, want: dict[str, torch.Tensor], *extra: str) -> dict:
    """``resave --repair`` succeeds and every loader sees ``want``; the result verifies clean."""
    p = run_ckptctl("resave", "--repair", "--json", d, *extra)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["fixes"] and doc["unchanged"] is False
    assert differences(load_glob(d), want) == [] and differences(load_hub(d), want) == []
    assert staging_dirs(d.parent) == []
    from ckptctl.verify import verify_paths

    report = verify_paths([str(d)])
    assert not report.failed(), [(f.code, f.message) for f in report.findings]
    return doc


def _refused(d: Path, code: int, *extra: str) -> subprocess.CompletedProcess:
    before = _tree(d)
    p = run_ckptctl("resave", "--repair", d, *extra)
    assert p.returncode == code, p.stderr
    assert "nothing was changed" in p.stderr and "Traceback" not in p.stderr
    assert _tree(d) == before and staging_dirs(d.parent) == []
    return p


# --- the seed report's state: a new single file beside a larger earlier sharded save ------------

def test_save_pretrained_sharded_then_single_leaves_a_stale_index(tmp_path):
    d = tmp_path / "c"
    tiny_llama(seed=1, num_hidden_layers=3).save_pretrained(d, max_shard_size="40KB")
    assert len(_shards(d)) >= 3
    new = tiny_llama(seed=2)
    new.save_pretrained(d)  # transformers removes the old shards, not the old index
    assert (d / INDEX).exists() and (d / "model.safetensors").exists() and not _shards(d)
    doc = _repaired(d, _state(new))
    assert "dropped the stale index model.safetensors.index.json (none of its shards exist)" in doc["fixes"]
    assert sorted(os.listdir(d)) == ["config.json", "generation_config.json", "model.safetensors"]


def _seed_state(d: Path, tmp: Path, *, layers: int = 2, stop_at: str = "cleanup-1") -> dict[str, torch.Tensor]:
    """save_pretrained of a larger model, sharded; then the streaming saver re-saves a new model as
    one model.safetensors in place and is killed while it removes the old files: the new complete
    single file, the stale index and the surplus shards."""
    tiny_llama(seed=1, num_hidden_layers=3).save_pretrained(d, max_shard_size="40KB")
    new = tiny_llama(seed=2, num_hidden_layers=layers)
    _stream(new, d, per_shard=10_000, stop_at=stop_at, tmp=tmp)
    return _state(new)


def test_seed_state_is_repaired_to_the_new_single_file(tmp_path):
    d = tmp_path / "c"
    want = _seed_state(d, tmp_path)
    old = json.loads((d / INDEX).read_text())["weight_map"]
    assert 0 < len(_shards(d)) < len(set(old.values())) and (d / "model.safetensors").exists()
    # resave without --repair, and export, both send the user to --repair ...
    for argv in (("resave", d), ("export", d, tmp_path / "o")):
        p = run_ckptctl(*argv)
        assert p.returncode == 2 and "resave --repair" in p.stderr, p.stderr
    # ... which repairs it (no dead end): the old save is incomplete, the single file is the one
    # complete save, so keeping it is certain
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    doc = _repaired(d, want)
    assert any(f.startswith("kept model.safetensors") and "(incomplete)" in f for f in doc["fixes"]), doc["fixes"]
    assert sorted(os.listdir(d)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert doc["bytes_streamed"] == 0 and doc["bytes_copied_by_kernel"] == 0  # the single file is linked
    _repaired(copy, want, "--prefer", "single")
    out = tmp_path / "out"
    assert run_ckptctl("export", d, out).returncode == 0
    assert differences(load_glob(out), want) == []


def test_seed_state_with_every_old_shard_left_uses_config(tmp_path):
    """Killed before it removed anything: two complete saves; config.json (written by the new
    save) has 2 layers, the old save 3: only the new one agrees, so keeping it is certain."""
    d = tmp_path / "c"
    want = _seed_state(d, tmp_path, stop_at="renamed")
    doc = _repaired(d, want)
    assert any("(disagrees with config.json)" in f for f in doc["fixes"]), doc["fixes"]


def test_two_complete_saves_that_agree_are_refused_with_the_prefer_values(tmp_path):
    d = tmp_path / "c"
    want = _seed_state(d, tmp_path, layers=3, stop_at="renamed")
    old = {k: v for k, v in load_hub(d).items()}
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    p = _refused(d, 2)
    for text in ("model.safetensors.index.json: ", "model.safetensors: model.safetensors, ",
                 f"{len(want)} tensors", "agrees with config.json", "--prefer model.safetensors.index.json",
                 "--prefer model.safetensors"):
        assert text in p.stderr, (text, p.stderr)
    assert p.stderr.count(", written 20") == 2  # each family's mtime
    doc = json.loads(run_ckptctl("resave", "--repair", "--json", d).stdout)
    assert doc["ok"] is False and doc["error"]["code"] == "input" and doc["error"]["exit_code"] == 2
    fams = {f["prefer"]: f for f in doc["error"]["families"]}
    assert set(fams) == {INDEX, "model.safetensors"}
    assert all(f["complete"] and f["agrees_with_config"] and f["tensors"] == len(want) and f["mtime"] > 0
               for f in fams.values())
    _repaired(d, want, "--prefer", "model.safetensors")
    _repaired(copy, old, "--prefer", INDEX)
    assert sorted(os.listdir(copy)) == sorted(["config.json", "generation_config.json", INDEX, *_shards(copy)])


# --- a crashed streaming re-save: complete new shards, no new index -----------------------------

def _crashed_resave(d: Path, tmp: Path, stop_at: str = "renamed") -> tuple[dict, dict]:
    old = tiny_llama(seed=1)
    old.save_pretrained(d, max_shard_size="30KB")
    assert len(_shards(d)) not in (0, 2)
    new = tiny_llama(seed=2)
    _stream(new, d, per_shard=11, stop_at=stop_at, tmp=tmp)  # 21 tensors: two shards
    return _state(old), _state(new)


def test_crashed_streaming_resave_is_never_resolved_silently(tmp_path):
    d = tmp_path / "c"
    old, new = _crashed_resave(d, tmp_path)
    assert "model-00002-of-00002.safetensors" in os.listdir(d)
    copies = [tmp_path / "a", tmp_path / "b"]
    for c in copies:
        shutil.copytree(d, c)
    p = _refused(d, 2)
    assert "model-00001-of-00002.safetensors: model-00001-of-00002.safetensors, model-00002-of-00002." in p.stderr
    assert "--prefer model-00001-of-00002.safetensors" in p.stderr and "--prefer " + INDEX in p.stderr
    # the newer save: a new index is built for its shards; its tensors are the new model's
    doc = _repaired(d, new, "--prefer", "model-00001-of-00002.safetensors")
    assert sorted(os.listdir(d)) == ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                                     "model-00002-of-00002.safetensors", INDEX]
    assert doc["bytes_streamed"] == 0 and doc["bytes_copied_by_kernel"] == 0
    assert json.loads((d / INDEX).read_text())["weight_map"] == {
        k: f for f in _shards(d) for k in load_file(str(d / f))}
    # any file of a family names it; the old save is still there to choose
    _repaired(copies[0], new, "--prefer", "model-00002-of-00002.safetensors")
    _repaired(copies[1], old, "--prefer", INDEX)


def test_temp_shards_of_a_killed_streaming_save_repair_to_the_newest_complete_save(tmp_path):
    d = tmp_path / "c"
    old, _ = _crashed_resave(d, tmp_path, stop_at="written")
    temps = [n for n in os.listdir(d) if n.endswith("-of-?????.safetensors")]
    assert len(temps) == 2
    p = run_ckptctl("verify", d)
    assert "leftover" in p.stdout + p.stderr
    doc = _repaired(d, old)
    assert any(f.startswith("removed leftovers: ") for f in doc["fixes"])
    assert not set(temps) & set(os.listdir(d))
    # killed between its renames: its first shard has its final name, the second is still a temp
    # shard; the new save is incomplete, the old one is the newest complete save
    d = tmp_path / "c2"
    old, _ = _crashed_resave(d, tmp_path, stop_at="renamed-1")
    assert "model-00001-of-00002.safetensors" in os.listdir(d) and "model-00002-of-?????.safetensors" in os.listdir(d)
    doc = _repaired(d, old)
    assert any("dropped model-00001-of-00002.safetensors (incomplete)" in f for f in doc["fixes"]), doc["fixes"]


def test_prefer_must_name_a_family_of_the_directory(tmp_path):
    d = tmp_path / "c"
    _crashed_resave(d, tmp_path)
    for bad in ("../model.safetensors", "whatever"):
        p = run_ckptctl("resave", "--repair", d, "--prefer", bad)
        assert p.returncode == 2 and "unknown --prefer" in p.stderr, p.stderr
    before = _tree(d)
    p = run_ckptctl("resave", "--repair", d, "--prefer", "model-00001-of-00009.safetensors")
    assert p.returncode == 2 and "unknown preference" in p.stderr, p.stderr
    assert "a family: model-00001-of-00002.safetensors, model.safetensors.index.json" in p.stderr
    assert _tree(d) == before


# --- a repair ends with verify ------------------------------------------------------------------

def test_a_repair_that_would_rebuild_the_index_around_a_loss_is_refused(tmp_path):
    """An untied model whose lm_head is gone from its shard (the index still names it): rebuilding
    the index around the loss would publish a checkpoint transformers fills with a random head."""
    d = tmp_path / "c"
    tiny_llama(seed=3, tie=False).save_pretrained(d, max_shard_size="30KB")
    shard = json.loads((d / INDEX).read_text())["weight_map"]["lm_head.weight"]
    kept = {k: v for k, v in load_file(str(d / shard)).items() if k != "lm_head.weight"}
    save_file(kept, str(d / shard), metadata={"format": "pt"})
    p = _refused(d, 1)
    assert "1 tensor(s) the index names are in no file: lm_head.weight" in p.stderr, p.stderr


def test_a_repair_whose_result_fails_verify_is_refused(tmp_path):
    """Nothing names the lost head any more (a single file saved without it); the repair's own fix
    (a leftover removed) is certain, but its result would still fail verify: refused, and the
    staged version is never published."""
    d = tmp_path / "c"
    model = tiny_llama(seed=3, tie=False)
    model.config.save_pretrained(d)
    save_file({k: v for k, v in _state(model).items() if k != "lm_head.weight"}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    (d / "model.safetensors.incomplete").write_bytes(b"")  # huggingface_hub's partial download
    p = _refused(d, 1)
    assert "would still fail verify with 1 error(s)" in p.stderr and "'lm_head.weight'" in p.stderr, p.stderr
    assert "(phase: verify)" in p.stderr


# --- a symlinked checkpoint ---------------------------------------------------------------------

def test_a_symlinked_checkpoint_is_repaired_where_it_points(tmp_path):
    real, link = tmp_path / "store" / "real", tmp_path / "link"
    real.parent.mkdir()
    tiny_llama(seed=1).save_pretrained(real, max_shard_size="40KB")
    new = tiny_llama(seed=2)
    new.save_pretrained(real)
    link.symlink_to(real)
    _repaired(link, _state(new))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(os.listdir(real)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert staging_dirs(tmp_path) == [] and staging_dirs(real.parent) == []
    # a plain resave of the link too: the link stays, the target is re-sharded
    run_ckptctl("resave", link, "--max-shard-size", "40KB", check=True)
    assert link.is_symlink() and os.readlink(link) == str(real) and len(_shards(real)) > 1
    assert differences(load_hub(link), _state(new)) == []


# --- clean checkpoints written by other libraries: nothing written ---------------------------------

def _hub_bin(d: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(_state(tiny_llama(seed=4)), d, safe_serialization=False)


def _hub_bin_sharded(d: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(_state(tiny_llama(seed=4)), d, safe_serialization=False, max_shard_size="40KB")


def _accelerate_bin(d: Path) -> None:
    from accelerate import Accelerator

    Accelerator(cpu=True).save_model(tiny_llama(seed=5), d, safe_serialization=False)


def _accelerate_bin_sharded(d: Path) -> None:
    from accelerate import Accelerator

    Accelerator(cpu=True).save_model(tiny_llama(seed=5), d, max_shard_size="40KB", safe_serialization=False)


@pytest.mark.parametrize("build", [_hub_bin, _hub_bin_sharded, _accelerate_bin, _accelerate_bin_sharded])
def test_a_clean_pickle_checkpoint_is_not_converted(build, tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    build(d)
    assert any(n.endswith(".bin") for n in os.listdir(d)) and not any(n.endswith(".safetensors")
                                                                        for n in os.listdir(d))
    before = _tree(d)
    p = run_ckptctl("resave", "--repair", "--json", d)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["unchanged"] is True and doc["fixes"] == [] and doc["publish"] is None
    assert _tree(d) == before


def test_a_sharded_bart_index_is_left_as_transformers_wrote_it(tmp_path):
    """transformers' total_parameters of BART does not count its final_logits_bias buffer; a
    repair that rewrote the index would change it. Nothing is wrong, so nothing is written."""
    import transformers

    cfg = transformers.BartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64)
    torch.manual_seed(0)
    d = tmp_path / "c"
    transformers.BartForConditionalGeneration(cfg).save_pretrained(d, max_shard_size="40KB")
    meta = json.loads((d / INDEX).read_text())["metadata"]
    assert len(_shards(d)) > 1 and "total_parameters" in meta
    before = _tree(d)
    p = run_ckptctl("resave", "--repair", d)
    assert p.returncode == 0 and "nothing to repair" in p.stdout, p.stderr
    assert _tree(d) == before


# --- what resave does not rewrite says what does ----------------------------------------------------

def _peft(d: Path) -> None:
    from peft import LoraConfig, get_peft_model

    get_peft_model(tiny_llama(seed=6), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(d)


def _dcp(d: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(tiny_llama(seed=7)), checkpoint_id=str(d), no_dist=True)


@pytest.mark.parametrize("build,what", [(_peft, "holds a PEFT adapter"), (_dcp, "is a torch DCP checkpoint")])
def test_resave_refuses_adapters_and_dcp_with_the_command_to_use(build, what, tmp_path):
    d = tmp_path / "c"
    build(d)
    before = _tree(d)
    for extra in ([], ["--repair"]):
        p = run_ckptctl("resave", d, *extra)
        assert p.returncode == 2 and what in p.stderr and f"hint: use `ckptctl export {d} OUT`" in p.stderr, p.stderr
    assert _tree(d) == before


def test_shard_sets_without_an_index(tmp_path):
    """No index: each -of-N count is a save. One complete set beside an incomplete one is kept
    (an index written for it); two complete sets are refused with both listed; an index alone (no
    weights file of it left) is refused as a loss."""
    a, b = _state(tiny_llama(seed=1)), _state(tiny_llama(seed=2))
    names = sorted(a)

    def shards(d: Path, sd: dict, n: int, only: int | None = None) -> None:
        d.mkdir(exist_ok=True)
        per = -(-len(names) // n)
        for k in range(n):
            if only is None or k + 1 == only:
                save_file({t: sd[t] for t in names[k * per:(k + 1) * per]},
                          str(d / f"model-{k + 1:05d}-of-{n:05d}.safetensors"), metadata={"format": "pt"})

    d = tmp_path / "one"
    shards(d, a, 3)
    shards(d, b, 2, only=1)
    doc = _repaired(d, a)
    assert f"wrote an index for {', '.join(f'model-0000{k}-of-00003.safetensors' for k in (1, 2, 3))} from their " \
           "headers" in doc["fixes"], doc["fixes"]
    d = tmp_path / "two"
    shards(d, a, 3)
    shards(d, b, 2)
    p = _refused(d, 2)
    assert "--prefer model-00001-of-00002.safetensors" in p.stderr and "--prefer model-00001-of-00003" in p.stderr
    _repaired(d, b, "--prefer", "model-00002-of-00002.safetensors")
    d = tmp_path / "index-only"
    tiny_llama(seed=1).save_pretrained(d, max_shard_size="40KB")
    for n in _shards(d):
        (d / n).unlink()
    p = _refused(d, 1)
    assert "model.safetensors.index.json cannot be made whole: missing model-00001-of-" in p.stderr, p.stderr


def test_a_writer_killed_while_renaming_in_place_is_refused_not_mixed(tmp_path):
    """The streaming saver re-saves with the same shard count, so its renames replace the old
    shards by name; killed after the first rename, the family looks complete but its first shard
    is the new save's and the others the old one's (the temp shards left say so). Refused."""
    d = tmp_path / "c"
    tiny_llama(seed=1).save_pretrained(d, max_shard_size="30KB")
    count = len(_shards(d))
    per = -(-21 // count)
    assert -(-21 // per) == count  # the new save has the same -of-N names
    _stream(tiny_llama(seed=2), d, per_shard=per, stop_at="renamed-1", tmp=tmp_path)
    assert len([n for n in os.listdir(d) if n.endswith("-of-?????.safetensors")]) == count - 1
    p = _refused(d, 1)
    assert f"model-00001-of-{count:05d}.safetensors were written after the index" in p.stderr, p.stderr
    assert "mix two saves" in p.stderr
    # killed after every rename (before the index): every shard is the new save's, the old index
    # maps their tensors (same names, same split): the repair keeps them, as the newest complete save
    d2 = tmp_path / "c2"
    tiny_llama(seed=1).save_pretrained(d2, max_shard_size="30KB")
    new = tiny_llama(seed=2)
    _stream(new, d2, per_shard=per, stop_at="renamed", tmp=tmp_path)
    p = run_ckptctl("resave", "--repair", d2)
    assert p.returncode == 0, p.stderr
    assert differences(load_hub(d2), _state(new)) == [] and differences(load_glob(d2), _state(new)) == []
