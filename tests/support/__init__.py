"""Test support: one place for running the CLI (:mod:`.cli`, :mod:`.zygote`), building real
checkpoints (:mod:`.builders`), loading them back and comparing them (:mod:`.loaders`), and
looking at trees (:mod:`.fs`).

Importable as ``tests.support`` from the repository root, by pytest (``pythonpath = ["."]``) and
by ``python -m bench.…``: no ``sys.path`` manipulation anywhere. ``tests`` itself stays a
namespace package, so pytest keeps putting ``tests/`` on ``sys.path`` for ``import corpus``.
"""

from tests.support.builders import (INDEX, SINGLE, TINY_LLAMA, exported_old_version, nbytes, state, tiny_llama,
                                    write_config, write_new_version, write_pickle, write_raw_safetensors, write_sharded,
                                    write_single, write_tiny_checkpoint)
from tests.support.cli import (CKPTCTL, REPO, RUN_TIMEOUT, ExecRunner, Result, clean_env, communicate,
                               drop_dac_caps, invoke, popen_ckptctl, process_state, run_ckptctl,
                               run_cli_subprocess, wait_stopped)
from tests.support.fs import MANIFEST, file_digest, fill_filesystem, sha256, snapshot, staging_dirs
from tests.support.loaders import (LOADERS, LoadError, differences, load_glob, load_hub, load_single_first,
                                   load_with_transformers, same)

__all__ = [
    "CKPTCTL", "INDEX", "LOADERS", "MANIFEST", "REPO", "RUN_TIMEOUT", "SINGLE", "TINY_LLAMA", "ExecRunner",
    "LoadError", "Result", "clean_env", "communicate", "differences", "drop_dac_caps", "exported_old_version",
    "file_digest",
    "fill_filesystem", "invoke",
    "load_glob", "load_hub", "load_single_first", "load_with_transformers", "nbytes", "popen_ckptctl",
    "process_state", "run_ckptctl", "run_cli_subprocess", "same", "sha256", "snapshot", "staging_dirs", "state",
    "tiny_llama", "wait_stopped", "write_config", "write_new_version", "write_pickle", "write_raw_safetensors", "write_sharded", "write_single",
    "write_tiny_checkpoint",
]
