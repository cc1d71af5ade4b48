"""What `ckptctl verify` pays before and after its checks (issue 16): a command line that names
a command imports that command's module alone; a plain verify imports neither the deep step nor
the manifest module (hashing threads, logging), nor rich's table when -q prints nothing; and the
garbage collector verify pauses is running again afterwards.

The model-class check (issue 30) imports torch and the model's library when it runs; with
``--static``, or where transformers and diffusers cannot be imported, verify of safetensors stays
torch-free (static rules, plus a note saying the class check did not run)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, clean_env, invoke, write_tiny_checkpoint

COMMAND_MODULES = {"ckptctl.cli.export_cmd", "ckptctl.cli.gc_cmd", "ckptctl.cli.inspect_cmd",
                   "ckptctl.cli.resave_cmd", "ckptctl.cli.verify_cmd"}
DEEP_ONLY = {"ckptctl.verify.deep", "ckptctl.threads", "ckptctl.manifest", "concurrent.futures"}
WRITER = {"ckptctl.write.inputs", "ckptctl.write.job", "ckptctl.plan", "ckptctl.sources.base"}
STAGING = {"ckptctl.staging.actions", "ckptctl.staging.liveness", "ckptctl.staging.state"}


# the CLI's entry point with an exit hook that lists every module the process imported
LIST_MODULES = ("import atexit, json, sys\n"
                "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + json.dumps(sorted(k for k, v in sys.modules.items() if v is not None)) + '\\n'))\n"
                "{prelude}"
                "sys.argv[0] = 'ckptctl'\n"
                "from ckptctl.cli import main\n"
                "main()\n")


# Python refuses to import a module whose sys.modules entry is None: as if it were not installed
NO_MODEL_LIBRARIES = "sys.modules['transformers'] = sys.modules['diffusers'] = None\n"


def run_listing(args: list[object], prelude: str = "") -> tuple[subprocess.CompletedProcess, set[str]]:
    """``ckptctl ARGS`` in a fresh interpreter (``prelude`` run first): the process and every module
    it imported."""
    proc = subprocess.run([sys.executable, "-c", LIST_MODULES.format(prelude=prelude), *map(str, args)],
                          capture_output=True, text=True, env=clean_env(), timeout=300, cwd=REPO)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("MODULES ")]
    assert lines, proc.stderr[-2000:]
    return proc, set(json.loads(lines[-1][len("MODULES "):]))


def modules(args: list[object], prelude: str = "") -> tuple[int, set[str]]:
    """``ckptctl ARGS`` in a fresh interpreter: its exit code and every module it imported."""
    proc, loaded = run_listing(args, prelude)
    return proc.returncode, loaded


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("startup") / "ckpt")


def test_a_plain_verify_imports_its_command_alone_and_no_deep_machinery(st_dir: Path) -> None:
    code, loaded = modules(["verify", st_dir, "-q", "--static"])
    assert code == 0
    assert loaded & COMMAND_MODULES == {"ckptctl.cli.verify_cmd"}
    assert not loaded & DEEP_ONLY
    assert "rich.table" not in loaded  # -q on a clean checkpoint prints nothing
    assert not {m for m in loaded if m.startswith("ckptctl.verify.classes")}  # --static: not the class check's


def test_deep_verify_and_help_load_what_they_need(st_dir: Path) -> None:
    """The probe is not blind: --deep brings the deep step, a table is rendered without -q when
    notes are shown, and --help builds every command."""
    code, loaded = modules(["verify", st_dir, "--deep", "-v", "--static"])
    assert code == 0 and {"ckptctl.verify.deep", "ckptctl.threads", "rich.table"} <= loaded
    code, loaded = modules(["--help"])
    assert code == 0 and COMMAND_MODULES <= loaded


def test_verify_restores_the_garbage_collector(st_dir: Path) -> None:
    assert gc.isenabled()
    result = invoke("verify", st_dir, "-q")
    assert result.exit_code == 0, result.stderr
    assert gc.isenabled()
    gc.disable()
    try:  # and leaves it off when it was off
        assert invoke("verify", st_dir, "-q").exit_code == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A checkpoint the model-class check runs on: the corpus's tiny Llama (LlamaForCausalLM)."""
    import corpus

    d = tmp_path_factory.mktemp("startup-llama") / "llama"
    corpus.make_clean_single(d)
    return d


def _model_class(doc: dict) -> tuple[list[str], dict[str, str], set[str]]:
    r = doc["results"][0]
    return r["checks"]["ran"], r["checks"]["skipped"], {f["code"] for f in r["findings"]}


def test_the_class_check_imports_its_library_and_static_does_not(llama_dir: Path) -> None:
    """By default the class check runs (torch and transformers imported by its box's child process,
    issue 44: verify's own process stays torch-free); --static runs the static rules alone."""
    proc, loaded = run_listing(["verify", llama_dir, "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    ran, _, _ = _model_class(json.loads(proc.stdout))
    assert "model-class" in ran and not loaded & {"torch", "transformers"}
    proc, loaded = run_listing(["verify", llama_dir, "--json", "--static"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    ran, skipped, _ = _model_class(json.loads(proc.stdout))
    assert "config" in ran and skipped["model-class"] == "--static: static rules only"
    assert not loaded & {"torch", "transformers", "diffusers"}


def test_without_transformers_and_diffusers_verify_stays_torch_free(llama_dir: Path, tmp_path: Path) -> None:
    """transformers and diffusers not importable: the static rules run (and still find a broken
    config), a note says the class check did not run and why, and torch is never imported."""
    import corpus

    broken = tmp_path / "broken"
    corpus.make_wrong_heads(broken)
    proc, loaded = run_listing(["verify", llama_dir, broken, "--json"], prelude=NO_MODEL_LIBRARIES)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert not loaded & {"torch", "transformers", "diffusers"}
    doc = json.loads(proc.stdout)
    for r in doc["results"]:
        assert "config" in r["checks"]["ran"]
        assert r["checks"]["skipped"]["model-class"] == "transformers is not installed"
        notes = [f for f in r["findings"] if f["code"] == "config.class_not_checked"]
        assert len(notes) == 1 and notes[0]["severity"] == "info"
        assert "transformers is not installed" in notes[0]["message"]
    assert doc["results"][0]["ok"] is True
    assert "config.attention_shape" in {f["code"] for f in doc["results"][1]["findings"]}


def test_resave_repair_static_verifies_without_the_class_check(llama_dir: Path, tmp_path: Path) -> None:
    """`resave --repair --static` (an operator's cron): the repair's verify runs the static rules,
    as `verify --static`, so neither torch nor transformers is imported; without --static the
    class check runs, as `verify` does. --static without --repair is a usage error."""
    import shutil

    d = tmp_path / "llama"
    shutil.copytree(llama_dir, d)
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    proc, loaded = run_listing(["resave", d, "--repair", "--static"])
    assert proc.returncode == 0 and "nothing to repair" in proc.stdout, proc.stderr[-2000:]
    assert not loaded & {"torch", "transformers", "diffusers"}
    assert not loaded & (WRITER | {"ckptctl.cli.export_cmd"})  # nothing to write: no writer, nothing of export's
    assert not loaded & STAGING  # no staging directory to recover: the staging machinery is not imported
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before
    proc, loaded = run_listing(["resave", d, "--repair"])  # the class check's libraries: in its box's child
    assert proc.returncode == 0 and not loaded & {"torch", "transformers"}, proc.stderr[-2000:]
    proc, _ = run_listing(["resave", d, "--static"])
    assert proc.returncode == 2 and "--static applies to --repair" in proc.stderr
    import corpus

    fixed = tmp_path / "fixed"
    corpus.make_wrong_total_size(fixed)  # a repair that writes: the staged version is verified
    proc, loaded = run_listing(["resave", fixed, "--repair", "--static"])
    assert proc.returncode == 0 and "fixed: " in proc.stdout, proc.stderr[-2000:]
    assert not loaded & {"torch", "transformers", "diffusers"}
    assert WRITER | {"ckptctl.cli.export_cmd"} | STAGING <= loaded  # the probe is not blind (export's renderer)
