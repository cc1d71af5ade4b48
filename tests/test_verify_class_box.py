"""The model-class check's box (issue 44): every hostile config of the issue run through
``ckptctl verify --json`` as a real process, with a recorder of socket connections and imports
in verify and in the box's child (a ``sitecustomize`` audit hook, tests/box_fuzz.py): a parsable
document, no error the box caused, a note naming the bound, no connection tried, nothing imported
on a file's word; the bounds themselves (time, memory, a child that dies or exits), the cheap
bounds on config.json, and a seeded fuzz of hostile values over the installed libraries' types."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from box_fuzz import SITECUSTOMIZE, build, judge, recorder, run
from ecosystem import fresh_copy

from ckptctl.verify.classes import bounds, child
from ckptctl.verify.classes.box import ClassBox, child_environment
from ckptctl.verify.classes.outcome import NotChecked

pytest_plugins = ["ecosystem.fixtures"]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
MODEL_DUMP = "torch.utils.model_dump.__main__.Tanh"
# what the recorder logs beyond connections: every process started, and imports of the module the ST activation names
WATCH = '''
import sys as _sys
def _more(event, args):
    if _path and event == "import" and str(args[0]).startswith("torch.utils.model_dump"):
        with open(_path, "a") as f:
            f.write(f"import {args[0]}\\n")
_sys.addaudithook(_more)
if _path:
    with open(_path + ".starts", "a") as f:
        f.write(" ".join(_sys.orig_argv) + "\\n")
'''


def _recorder(folder: Path) -> dict[str, str]:
    env = recorder(folder)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE + WATCH)
    return env


def _verify(paths: list[Path], env: dict[str, str], *extra: str) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "ckptctl", "verify", "--json", *extra, *map(str, paths)],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=600)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _edit(src: Path, dst: Path, name: str = "config.json", **changes) -> Path:
    if src != dst:
        fresh_copy(src, dst)
    cfg = json.loads((dst / name).read_text())
    cfg.update(changes)
    (dst / name).unlink()
    (dst / name).write_text(json.dumps(cfg))
    return dst


def _class_findings(doc: dict, path: Path) -> list[dict]:
    res = next(r for r in doc["results"] if Path(r["path"]) == path)
    return [f for f in res["findings"] if f["code"].startswith(("config.class", "config.st_"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Small real checkpoints of the issue's model kinds, saved by their libraries."""
    import diffusers

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tiny")
    rn = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                                   out_features=["stage4"])
    models = {
        "detr": transformers.DetrForObjectDetection(transformers.DetrConfig(
            use_timm_backbone=False, backbone_config=rn, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
            num_queries=4, num_labels=3)),
        "swin": transformers.SwinModel(transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1],
                                                               num_heads=[1, 1], window_size=2)),
        "albert": transformers.AlbertModel(transformers.AlbertConfig(vocab_size=50, embedding_size=8, hidden_size=16,
                                                                     num_hidden_layers=2, num_attention_heads=2,
                                                                     intermediate_size=16)),
        "pixart": diffusers.PixArtTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=8,
                                                     num_layers=1, num_attention_heads=2, attention_head_dim=8,
                                                     cross_attention_dim=16, caption_channels=16,
                                                     norm_type="ada_norm_single"),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
    return {name: root / name for name in models}


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory) -> Path:
    from ecosystem.transformers_models import make_model

    d = tmp_path_factory.mktemp("lora-base") / "base"
    make_model("llama").save_pretrained(d)
    return d


def test_the_issues_hostile_configs_through_the_cli(build_one, tiny, lora_base: Path, tmp_path: Path) -> None:
    """Each example of the issue, in one verify process: the document parses, the run ends, no
    connection is tried and nothing is imported on a file's word (recorded in verify and in the
    box's child), each is a note naming its bound (or, where the box removes the hazard, the
    check runs), and one child served them all."""
    llama = build_one("transformers/llama")
    h = tmp_path / "hostile"
    cases = {
        "labels": _edit(llama, h / "labels", num_labels=100_000_000),
        "attn": _edit(llama, h / "attn", attn_implementation="kernels-community/flash-attn3"),
        "swin": _edit(tiny["swin"], h / "swin", depths=[10_000_000, 2, 2, 2]),
        "albert": _edit(tiny["albert"], h / "albert", num_hidden_groups=10_000_000),
        "pixart": _edit(tiny["pixart"], h / "pixart", sample_size=1024, patch_size=1),
        "detr": _edit(tiny["detr"], h / "detr", backbone="microsoft/resnet-50", use_pretrained_backbone=True,
                      backbone_config=None, use_timm_backbone=False),
        "peft": _edit(build_one("peft/lora"), h / "peft", name="adapter_config.json", r=10_000_000),
    }
    st = fresh_copy(build_one("sentence-transformers/root"), h / "st")
    dense = next(p for p in st.iterdir() if p.name.endswith("_Dense"))
    _edit(dense, dense, activation_function=MODEL_DUMP)
    cases["st"] = st
    env = _recorder(tmp_path / "site")
    code, doc, err = _verify(list(cases.values()), env, "--base", str(lora_base))
    assert code in (0, 1), err
    log = Path(env["BOX_NETLOG"])
    assert not log.exists() or log.read_text() == ""  # no connection tried, model_dump never imported
    starts = Path(env["BOX_NETLOG"] + ".starts").read_text().splitlines()
    assert len([s for s in starts if "ckptctl.verify.classes.child" in s]) == 1, starts

    def note(name: str) -> dict:
        found = _class_findings(doc, cases[name])
        assert [f["code"] for f in found] == ["config.class_not_checked"], found
        return found[0]

    assert "label map of more than 262,144" in note("labels")["message"]
    assert "depths sums to 10,000,006" in note("swin")["message"]
    assert "num_hidden_groups is 10,000,000" in note("albert")["message"]
    assert "r is 10,000,000, larger than every dimension" in note("peft")["message"]
    detr = note("detr")
    assert detr["details"]["bound"] == "network" and "needs the network" in detr["message"]
    assert _class_findings(doc, cases["attn"]) == []  # built with eager attention: nothing fetched, nothing wrong
    pixart = _class_findings(doc, cases["pixart"])  # buffers on the meta device: built, and patch_size 1 is judged
    assert {f["code"] for f in pixart} == {"config.class_shape"}
    assert "pos_embed.proj.weight" in {f["tensor"] for f in pixart}
    act = _class_findings(doc, st)
    assert [(f["code"], f["severity"]) for f in act] == [("config.st_activation", "error")]
    assert "torch.utils.model_dump.__main__" in act[0]["message"]


def test_time_and_memory_bounds_are_notes(build_one, tmp_path: Path) -> None:
    """A check past the time limit or the address-space limit is a note naming the bound's
    variable; verify exits 0 with its document."""
    llama = build_one("transformers/llama")
    env = _recorder(tmp_path / "site")
    for var, value, bound in (("CKPTCTL_CLASS_TIMEOUT", "0.001", "time"), ("CKPTCTL_CLASS_MEMORY", "64MiB", "memory")):
        code, doc, err = _verify([llama], {**env, var: value})
        assert code == 0, err
        found = _class_findings(doc, llama)
        assert [f["code"] for f in found] == ["config.class_not_checked"]
        assert found[0]["details"]["bound"] == bound and var in found[0]["message"]
        assert "model-class" in doc["results"][0]["checks"]["skipped"]


@pytest.mark.parametrize("var, value", [("CKPTCTL_CLASS_TIMEOUT", "soon"), ("CKPTCTL_CLASS_TIMEOUT", "-1"),
                                        ("CKPTCTL_CLASS_MEMORY", "lots")])
def test_a_bad_bound_is_a_usage_error(build_one, var: str, value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "ckptctl", "verify", str(build_one("transformers/llama"))],
                          capture_output=True, text=True, env={**os.environ, var: value}, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and var in proc.stderr.splitlines()[0]


def test_a_child_that_dies_or_exits_is_an_answer(monkeypatch) -> None:
    """A killed child is an answer (``died``), the next check gets a new one; whatever the build
    raises, SystemExit included, is an answer, never an exit of verify."""
    with ClassBox(timeout=120) as box:
        ask = {"op": "no-such-oracle", "cfg": {}, "tensors": []}
        assert box.ask(ask) == {"kind": "not_checked", "reason": "unknown class-check request 'no-such-oracle'"}
        died = box._exchange(b"not a request\n", time.monotonic() + 120)  # the child exits in the middle of it
        assert died == {"kind": "died", "reason": "the process building the class exited with status 2"}
        box._stop(kill=False)
        assert box.ask(ask)["kind"] == "not_checked" and box.started == 2
        os.kill(box._proc.pid, signal.SIGKILL)  # killed between checks: the next check gets a new child
        os.waitid(os.P_PID, box._proc.pid, os.WEXITED | os.WNOWAIT)
        assert box.ask(ask)["kind"] == "not_checked" and box.started == 3

    def exits(req):
        raise SystemExit(2)

    monkeypatch.setattr(child, "build", exits)
    assert child.serve({}, []) == {"kind": "failed", "reason": "SystemExit: 2"}
    tried: list[str] = []
    monkeypatch.setattr(child, "build", lambda req: tried.append("socket.connect ('1.2.3.4', 443)") or
                        child.Outcome("transformers", "X"))
    reached = child.serve({}, tried)  # an outcome made after trying the network is not one
    assert reached["kind"] == "bound" and reached["which"] == "network" and "1.2.3.4" in reached["reason"]
    monkeypatch.setattr(child, "build", lambda req: child.Outcome("transformers", "X"))
    assert child.serve({}, tried)["kind"] == "outcome"  # what an earlier request tried is forgotten


def test_the_child_has_no_network_and_no_download_setting(tmp_path: Path) -> None:
    """The guard refuses a connection (and records it) in a process like the child; the child's
    environment is offline, without the kernels package, a token, or the user's caches. The
    recorder itself sees a connection (so its silence above means something)."""
    code = ("import socket, sys\n"
            "from ckptctl.verify.classes import guard\n"
            "tried = []\n"
            "guard.refuse_network(tried)\n"
            "for call in (lambda: socket.socket().connect(('127.0.0.1', 9)), lambda: socket.getaddrinfo('hf.co', 443)):\n"
            "    try:\n"
            "        call()\n"
            "    except guard.NetworkBlocked:\n"
            "        print('refused', tried[-1])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["refused socket.connect ('127.0.0.1', 9)", "refused socket.getaddrinfo ('hf.co',)"]
    env = _recorder(tmp_path / "site")
    subprocess.run([sys.executable, "-c", "import socket\ntry: socket.create_connection(('127.0.0.1', 9), 1)\n"
                    "except OSError: pass"], env={**os.environ, **env}, timeout=120)
    assert "socket.connect" in Path(env["BOX_NETLOG"]).read_text()
    child_env = child_environment(str(tmp_path / "home"), {"HF_TOKEN": "x", "HF_HOME": "/home/u/.cache/hf", "PATH": "/bin"})
    assert child_env["HF_HUB_OFFLINE"] == "1" and child_env["TRANSFORMERS_OFFLINE"] == "1"
    assert child_env["USE_HUB_KERNELS"] == "NO" and "HF_TOKEN" not in child_env and child_env["PATH"] == "/bin"
    assert child_env["HF_HOME"].startswith(str(tmp_path / "home"))


def test_cheap_bounds_before_the_box() -> None:
    """Label maps, summed list counts, unknown count-like fields and adapter ranks: a note before
    any build; sizes that are not counts of modules pass."""
    from ckptctl.format.tensor import TensorSpec

    for cfg, words in [({"num_labels": 10**8}, "num_labels"), ({"id2label": {str(i): "x" for i in range(300_000)}},
                                                                 "id2label holds 300,000"),
                       ({"depths": [10**7, 2]}, "sums to"), ({"num_hidden_groups": 10**7}, "num_hidden_groups"),
                       ({"text_config": {"n_layer": 10**6}}, "n_layer"), ({"encoder_layers": 70_000}, "encoder_layers")]:
        with pytest.raises(NotChecked, match=words):
            bounds.check_config(cfg)
    bounds.check_config({"vocab_size": 10**7, "max_position_embeddings": 10**7, "num_embeddings": 10**6,
                         "num_hash_buckets": 10**6, "depths": [2, 2, 18, 2], "num_labels": 21_843})
    specs = {"a.lora_A.weight": TensorSpec("a.lora_A.weight", "F32", (8, 64))}
    bounds.check_adapter({"r": 64, "rank_pattern": {"q": 16}}, specs)
    with pytest.raises(NotChecked, match=r"rank_pattern\['q'\] is 65"):
        bounds.check_adapter({"r": 8, "rank_pattern": {"q": 65}}, specs)


def test_no_default_config_trips_the_cheap_bounds() -> None:
    """Every model type the installed transformers registers, at its default config: built, not
    a note (the bounds must not turn clean checkpoints into notes)."""
    from box_fuzz import transformers_types
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    tripped = []
    for mt in transformers_types():
        try:
            cfg = CONFIG_MAPPING[mt]().to_dict()
        except Exception:  # noqa: BLE001 -- a config class without defaults
            continue
        try:
            bounds.check_config(cfg)
        except NotChecked as exc:
            tripped.append((mt, exc.reason))
    assert tripped == []


def test_a_seeded_fuzz_of_hostile_values(tmp_path: Path) -> None:
    """A sample of the installed transformers' model types and diffusers classes with a config,
    each with one hostile value (BOX_FUZZ_SEED picks another sample; bench case model-class-fuzz
    runs every type): one verify run ends within its deadline with a document, no error the box
    caused, and no connection tried."""
    seed = int(os.environ.get("BOX_FUZZ_SEED", "44"))
    cases = build(tmp_path / "cases", seed, 6, 2)
    env = recorder(tmp_path / "site")
    code, doc, err, _ = run(tmp_path / "cases", env, deadline=600)
    assert judge(code, doc, err, tmp_path / "site" / "net.log") == [], (seed, cases)
    assert len(doc["results"]) == len(cases)
    shutil.rmtree(tmp_path / "cases")
