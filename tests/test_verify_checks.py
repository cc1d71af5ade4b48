"""Which checks ran: every path's result lists the check groups that ran and those that did not,
with why (``results[i].checks`` in ``--json``, one line per path on stderr), on real library outputs.

The groups are the pipeline's step registry (``pipeline.DIRECTORY_STEPS``, ``FILE_STEPS``); the
last test spies on the registry's steps and fails if a step runs but its group is not listed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ckptctl.verify import VerifyOptions, verify_path
from ckptctl.verify import pipeline as P
from ecosystem import fresh_copy
from test_verify_cli import invoke, subprocess_verify
from tests.support import CKPTCTL, drop_dac_caps

pytest_plugins = ["ecosystem.fixtures"]

STATIC = "--static: static rules only"
NO_ADAPTER = "no adapter weights"
NOT_MULTI = "not a multi-component root: no model_index.json or modules.json"
NO_MANIFEST = "no ckptctl.manifest.json"
NOT_DEEP = "not asked: --deep"
NO_MODEL = "no model weights: no safetensors or .bin family"
FOR_FILE = "not run on a single weights file"
NO_BASE = "the adapter's base model is not available locally (--base DIR)"


def _checks(res) -> dict:
    return res.checks.to_dict()


def test_a_safetensors_directory_lists_its_checks(build_one) -> None:
    for name in ("transformers/llama", "transformers/llama-sharded"):
        assert _checks(verify_path(build_one(name))) == {
            "ran": ["screen", "layout", "weights", "model-class", "config", "consistency"],
            "skipped": {"adapter": NO_ADAPTER, "components": NOT_MULTI, "manifest": NO_MANIFEST, "deep": NOT_DEEP}}, name


def test_static_turns_the_model_class_check_off(build_one) -> None:
    """--static: the static rules only, and the reason in the checks."""
    got = _checks(verify_path(build_one("transformers/llama"), options=VerifyOptions(static=True)))
    assert got == {"ran": ["screen", "layout", "weights", "config", "consistency"],
                   "skipped": {"model-class": STATIC, "adapter": NO_ADAPTER, "components": NOT_MULTI,
                               "manifest": NO_MANIFEST, "deep": NOT_DEEP}}


def test_a_directory_without_config_json_says_so(build_one, tmp_path: Path) -> None:
    d = fresh_copy(build_one("transformers/llama"), tmp_path / "llama")
    (d / "config.json").unlink()
    assert _checks(verify_path(d)) == {
        "ran": ["screen", "layout", "weights", "consistency"],
        "skipped": {"model-class": "no config.json", "config": "no config.json", "adapter": NO_ADAPTER,
                    "components": NOT_MULTI, "manifest": NO_MANIFEST, "deep": NOT_DEEP}}
    (d / "config.json").write_text("{not json")
    assert _checks(verify_path(d))["skipped"]["config"] == "config.json could not be read as JSON: see its finding"


def test_deep_is_listed_when_asked(build_one) -> None:
    assert _checks(verify_path(build_one("transformers/llama"), options=VerifyOptions(deep=True))) == {
        "ran": ["screen", "layout", "weights", "model-class", "config", "consistency", "deep"],
        "skipped": {"adapter": NO_ADAPTER, "components": NOT_MULTI, "manifest": NO_MANIFEST}}


def test_a_dcp_directory_lists_its_checks(build_one) -> None:
    assert _checks(verify_path(build_one("dcp/single"))) == {
        "ran": ["screen", "layout", "weights", "consistency"],
        "skipped": {"model-class": NO_MODEL, "config": NO_MODEL, "adapter": NO_ADAPTER, "components": NOT_MULTI,
                    "manifest": NO_MANIFEST, "deep": NOT_DEEP}}


def test_an_adapter_directory_lists_its_checks(build_one) -> None:
    assert _checks(verify_path(build_one("peft/lora"))) == {
        "ran": ["screen", "layout", "weights", "consistency", "adapter"],
        "skipped": {"model-class": NO_BASE, "config": NO_MODEL, "components": NOT_MULTI, "manifest": NO_MANIFEST,
                    "deep": NOT_DEEP}}


def test_a_pipeline_root_lists_what_ran_in_any_component(build_one, tmp_path: Path) -> None:
    """A group that ran in a component ran for the root (weights, and config on the text encoder);
    without a component transformers loads, config did not run, and the reason says why."""
    d = build_one("diffusers/pipeline")
    assert _checks(verify_path(d)) == {
        "ran": ["screen", "layout", "weights", "model-class", "config", "consistency", "components"],
        "skipped": {"adapter": NO_ADAPTER, "manifest": NO_MANIFEST, "deep": NOT_DEEP}}
    only_diffusers = fresh_copy(d, tmp_path / "pipe")
    shutil.rmtree(only_diffusers / "text_encoder")
    doc = json.loads((only_diffusers / "model_index.json").read_text())
    del doc["text_encoder"]
    (only_diffusers / "model_index.json").write_text(json.dumps(doc))
    got = _checks(verify_path(only_diffusers))
    assert got["ran"] == ["screen", "layout", "weights", "model-class", "consistency", "components"]
    assert got["skipped"]["config"] == "no component that transformers loads"


def test_a_single_file_and_an_unreadable_directory(build_one, tmp_path: Path) -> None:
    f = build_one("transformers/llama") / "model.safetensors"
    assert _checks(verify_path(f, options=VerifyOptions(deep=True))) == {
        "ran": ["layout", "weights", "deep"],
        "skipped": {g: FOR_FILE for g in ("screen", "model-class", "config", "consistency", "adapter", "components",
                                          "manifest")}}
    root = tmp_path / "tree"
    fresh_copy(build_one("transformers/llama"), root / "ok")
    (root / "locked").mkdir()
    (root / "locked").chmod(0)
    try:
        # --static: about the unreadable directory (a subprocess pays the class check's import)
        p = subprocess.run([*CKPTCTL, "verify", "--recursive", "--json", "--static", str(root)], capture_output=True,
                           text=True,
                           timeout=120, preexec_fn=drop_dac_caps if os.geteuid() == 0 else None,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    finally:
        (root / "locked").chmod(0o755)
    assert p.returncode == 3, p.stderr
    locked = [r for r in json.loads(p.stdout)["results"] if r["path"] == str(root / "locked")]
    assert [r["checks"] for r in locked] == [{
        "ran": [], "skipped": {g: "the path could not be read: io.error" for g in P.GROUPS}}]


def test_checks_in_json_and_on_stderr(build_one) -> None:
    d = build_one("transformers/llama")
    res = invoke("--json", d)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["results"][0]["checks"] == _checks(verify_path(d))
    proc = subprocess_verify(d)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    line = (f"checks of {d}: ran screen, layout, weights, model-class, config, consistency; not run: adapter "
            f"({NO_ADAPTER}), components ({NOT_MULTI}), manifest ({NO_MANIFEST}), deep ({NOT_DEEP})")
    assert line in proc.stderr.splitlines(), proc.stderr
    quiet = subprocess_verify("-q", "--static", d)  # about -q: the import of the class check is not
    assert quiet.returncode == 0 and "checks of" not in quiet.stderr, quiet.stderr


def test_every_step_that_runs_is_listed(build_one, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spy on every step of the registry (directories, components, single files): the groups whose
    step ran are exactly ``checks.ran``; every other group is in ``skipped``, with the first reason
    its step gave."""
    calls: dict[str, str | None] = {}

    def spy(check: P.Check) -> P.Check:
        def run(ctx):
            why = check.run(ctx)
            if why is None:
                calls[check.group] = None
            else:
                calls.setdefault(check.group, why)
            return why
        return P.Check(check.group, run)

    for reg in ("DIRECTORY_STEPS", "COMPONENT_STEPS", "FILE_STEPS"):
        monkeypatch.setattr(P, reg, tuple(spy(c) for c in getattr(P, reg)))
    registered = {c.group for c in P.DIRECTORY_STEPS + P.FILE_STEPS}
    assert set(P.GROUPS) == registered and P.MODEL_CLASS in registered
    targets = [build_one(n) for n in ("transformers/llama-sharded", "dcp/single", "diffusers/pipeline",
                                      "sentence-transformers/root", "peft/lora", "transformers/llama-bin")]
    targets.append(targets[0] / "model-00001-of-00007.safetensors")
    for deep in (False, True):
        for t in targets:
            calls.clear()
            got = verify_path(t, options=VerifyOptions(deep=deep)).checks
            assert calls, t
            ran = [g for g in P.GROUPS if g in calls and calls[g] is None]
            assert got.ran == ran, (t, deep)
            assert set(got.ran) | set(got.skipped) == set(P.GROUPS) and not set(got.ran) & set(got.skipped)
            for g, why in calls.items():
                if why is not None and g not in ran:
                    assert got.skipped[g] == why, (t, g)
