"""torch DCP as an export source: equals torch's dcp_to_torch_save; damaged input refused."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from tests.support import load_glob as load_dir, run_ckptctl, staging_dirs
from tests.dist_worker import full_state
from tests.test_distributed import _launch


# dist_worker's save, ended with os._exit like its other scenarios: a plain interpreter exit after
# destroy_process_group can abort in gloo's thread teardown (SIGABRT, "terminate called without an
# active exception") when the machine is loaded, after the checkpoint is complete.
_DCP_SAVE = ("import os, sys\n"
             "import torch.distributed as dist\n"
             "from tests.dist_worker import save_dcp_sharded\n"
             "dist.init_process_group('gloo')\n"
             "save_dcp_sharded(sys.argv[1])\n"
             "dist.destroy_process_group()\n"
             "os._exit(0)\n")


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcp") / "ckpt"
    outs = _launch(2, ["-c", _DCP_SAVE, str(d)])
    assert all(rc == 0 for rc, _, _ in outs), outs
    return d


def test_sharded_dcp_export_equals_dcp_to_torch_save(tmp_path, dcp_dir):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert len(list(dcp_dir.glob("*.distcp"))) == 2
    p = run_ckptctl("export", str(dcp_dir), str(tmp_path / "out"), "--key", "model", "--max-shard-size", "20KB")
    assert p.returncode == 0, p.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(dcp_dir, tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)["model"]
    got = load_dir(tmp_path / "out")
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert all(torch.equal(got[k], v) for k, v in full_state().items())


def test_dcp_without_key_names_the_top_level_keys(tmp_path, dcp_dir):
    """{"model": ..., "step": n} is not one model: refused (exit 2) with the keys to choose from,
    nothing written (it used to be flattened into model.model.* with exit 0)."""
    p = run_ckptctl("export", str(dcp_dir), str(tmp_path / "out"))
    assert p.returncode == 2 and "top-level keys: model, step" in p.stderr and "--key model" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists() and staging_dirs(tmp_path) == []
    p = run_ckptctl("export", str(dcp_dir), str(tmp_path / "out"), "--key", "model")
    assert p.returncode == 0 and "model.norm.weight" in load_dir(tmp_path / "out")


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_missing_and_truncated_distcp_are_refused(tmp_path, dcp_dir):
    broken = _copy(dcp_dir, tmp_path / "missing")
    sorted(broken.glob("*.distcp"))[1].unlink()
    p = run_ckptctl("export", str(broken), str(tmp_path / "o1"), "--key", "model")
    assert p.returncode == 2 and "is missing" in p.stderr and "Traceback" not in p.stderr
    broken = _copy(dcp_dir, tmp_path / "trunc")
    f = sorted(broken.glob("*.distcp"))[0]
    f.write_bytes(f.read_bytes()[:100])
    p = run_ckptctl("export", str(broken), str(tmp_path / "o2"), "--key", "model")
    assert p.returncode == 2 and "truncated" in p.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and staging_dirs(tmp_path) == []


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("touch /tmp/ckptctl-dcp-pwned",))


def test_metadata_pickle_that_runs_code_is_refused(tmp_path, dcp_dir):
    import os
    broken = _copy(dcp_dir, tmp_path / "evil")
    (broken / ".metadata").write_bytes(pickle.dumps(_Evil()))
    if os.path.exists("/tmp/ckptctl-dcp-pwned"):
        os.unlink("/tmp/ckptctl-dcp-pwned")
    p = run_ckptctl("export", str(broken), str(tmp_path / "o"))
    assert p.returncode == 2 and "refused to unpickle" in p.stderr
    assert not os.path.exists("/tmp/ckptctl-dcp-pwned")


def test_a_fifo_in_place_of_the_metadata_is_refused_without_blocking(tmp_path):
    """Opening a FIFO for reading waits for a writer: the metadata reader must not."""
    import os

    d = tmp_path / "dcp"
    d.mkdir()
    os.mkfifo(d / ".metadata")
    (d / "__0_0.distcp").write_bytes(b"x")
    p = run_ckptctl("export", str(d), str(tmp_path / "out"), timeout=60)
    assert p.returncode == 2 and "not a regular file" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "out").exists() and staging_dirs(tmp_path) == []
