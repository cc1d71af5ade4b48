"""Issue 44: the rank files of one ZeRO checkpoint are of one save. A rank file of step 2 inside
``global_step3`` (a tag re-used after a save that died, a half-finished rsync) exported with
exit 0 and mixed the two steps in 11 of 21 tensors. Each optimizer-states file records its step
counters and the model states ``global_steps``: they must agree, or the export refuses naming the
rank and both steps (exit 2, nothing published). A flat master group that is not floating point
is refused too (DeepSpeed's always are).

Run as a script, this module is one rank of a 2-rank Gloo job (as ``tests/test_zero_build.py``):
one run per stage (2 and 3) saves ``global_step2`` and then ``global_step3`` into one root.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.cli import run_ckptctl
from tests.support.ranks import build_once
from tests.test_zero_build import NEEDS_DEEPSPEED, WORLD

pytestmark = NEEDS_DEEPSPEED
STAGES = (2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """``{stage: DeepSpeed root}`` holding ``global_step2/`` and ``global_step3/`` of one run."""
    out = tmp_path_factory.mktemp("zero-steps")
    build_once(out, [sys.executable, __file__, str(out)], world=WORLD,
               env=dict(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1"), timeout=600, what="DeepSpeed")
    return {stage: out / f"s{stage}" for stage in STAGES}


def _copy(root: Path, tmp: Path) -> Path:
    dst = tmp / "ckpt"
    shutil.copytree(root, dst)
    return dst


def _export(src: Path, out: Path) -> tuple[int, str]:
    r = run_ckptctl("export", src, out, "--no-fsync")
    return r.returncode, r.stderr


def _refused(rc: int, err: str, out: Path, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2 and lines[0].startswith("error:") and lines[1].startswith("hint:"), err
    for n in needles:
        assert n in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("stage", STAGES)
def test_both_saves_of_a_run_export(runs, tmp_path, stage):
    for tag in ("global_step2", "global_step3"):
        rc, err = _export(runs[stage] / tag, tmp_path / tag)
        assert rc == 0, err


@pytest.mark.parametrize("stage", STAGES)
def test_an_optimizer_file_of_step_2_in_global_step3_is_refused(runs, tmp_path, stage):
    root = _copy(runs[stage], tmp_path)
    (name,) = [p.name for p in (root / "global_step2").glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")]
    shutil.copy(root / "global_step2" / name, root / "global_step3" / name)
    rc, err = _export(root, tmp_path / "out")
    _refused(rc, err, tmp_path / "out", "rank 1's optimizer states are at step 2", "rank 0's at step 3")


def test_a_stage_3_model_states_file_of_step_2_is_refused(runs, tmp_path):
    root = _copy(runs[3], tmp_path)
    name = "zero_pp_rank_1_mp_rank_00_model_states.pt"
    shutil.copy(root / "global_step2" / name, root / "global_step3" / name)
    rc, err = _export(root / "global_step3", tmp_path / "out")
    _refused(rc, err, tmp_path / "out", "rank 1's model states say global step 2, rank 0's 3")


def test_stage_2_model_states_of_step_2_beside_optimizer_files_of_step_3_are_refused(runs, tmp_path):
    root = _copy(runs[2], tmp_path)
    name = "mp_rank_00_model_states.pt"
    shutil.copy(root / "global_step2" / name, root / "global_step3" / name)
    rc, err = _export(root, tmp_path / "out")
    _refused(rc, err, tmp_path / "out", "optimizer states are at step 3", "the model states at global step 2")


def test_a_flat_group_that_is_not_floating_point_is_refused(runs, tmp_path):
    """Rank 0's storages re-typed from FloatStorage to IntStorage (same width): its flat group
    reads as int32. Before: exported as int32 "master weights"."""
    root = _copy(runs[2], tmp_path)
    (path,) = (root / "global_step3").glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")
    src = zipfile.ZipFile(path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                assert data.count(b"ctorch\nFloatStorage\n") == 1
                data = data.replace(b"ctorch\nFloatStorage\n", b"ctorch\nIntStorage\n")
            z.writestr(info.filename, data)
    src.close()
    path.write_bytes(buf.getvalue())
    rc, err = _export(root, tmp_path / "out")
    _refused(rc, err, tmp_path / "out", "single_partition_of_fp32_groups[0] holds I32, not floating point")


# ---- the worker (one rank) -------------------------------------------------------------------

def _run(deepspeed, stage: int, out: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    root = out / f"s{stage}"
    for step in (1, 2, 3):
        x = torch.randint(0, 101, (2, 8), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        if step >= 2:
            engine.save_checkpoint(str(root), tag=f"global_step{step}")
    if torch.distributed.get_rank() == 0:
        model.config.save_pretrained(root)
        (root / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    torch.distributed.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__dict__["__compatible_ops__"] = {"deepspeed_shm_comm": False}  # see test_zero_build
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in STAGES:
        _run(deepspeed, stage, out)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see test_zero_build: no interpreter teardown after every file is written
