"""A seeded fuzz of hostile config values for verify's model-class box (issue 44), shared by
tests/test_verify_class_box.py (a sample per run) and the bench case ``model-class-fuzz`` (every
model type: ``python -m tests.box_fuzz --all``).

Each case is a checkpoint directory: the default config of one model type the installed
transformers registers (``CONFIG_MAPPING``; its base class from ``MODEL_MAPPING_NAMES`` as
``architectures``) or one diffusers model class with a config (``_class_name``), with one hostile
value put in (a huge count or resolution, a huge list, a huge label count, a kernel repository as
``attn_implementation``, a Hub backbone to download), beside a one-tensor ``model.safetensors``.
All cases go through one ``ckptctl verify --json`` process with a socket recorder
(:func:`recorder`) on its and its children's path; :func:`judge` says what went wrong: a hang
(the run's deadline), a document that does not parse, an error finding the box caused, a
connection attempt.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HUGE = (10**7, 10**8, 2**31 - 1, 10**9)
SITECUSTOMIZE = '''import os, sys
_path = os.environ.get("BOX_NETLOG")
_events = {"socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
           "socket.sendto", "socket.sendmsg"}
def _hook(event, args):
    if _path and event in _events:
        with open(_path, "a") as f:
            f.write(f"{os.getpid()} {event} {args[1:2]!r}\\n")
sys.addaudithook(_hook)
'''
# words of a library error the box would cause (a bound taken for the library's refusal of config.json):
# config.class_refused is the one class-check error that carries a library's message; the others name keys
BOX_WORDS = ("offline", "huggingface.co", "network", "allocate", "memoryerror", "out of memory", "connection",
             "timed out", "cannot reach")


def recorder(folder: Path) -> dict[str, str]:
    """Environment additions that make every Python process started with them (verify and the
    box's child) append each socket connection, lookup or datagram it tries to ``folder/net.log``
    (an audit hook in a ``sitecustomize`` on PYTHONPATH, added before any other hook)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "BOX_NETLOG": str(folder / "net.log")}


def write_weights(d: Path) -> None:
    header = json.dumps({"dummy.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)


def _hostile(rng: random.Random, cfg: dict[str, Any]) -> str:
    """Put one hostile value into ``cfg``; what was done."""
    ints = sorted(k for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool) and not k.startswith("_"))
    lists = sorted(k for k, v in cfg.items() if isinstance(v, list) and v and all(isinstance(x, int) for x in v))
    kinds = ["labels", "attn", "backbone"] + ["int"] * 3 * bool(ints) + ["list"] * 2 * bool(lists)
    kind = rng.choice(kinds)
    if kind == "int":
        k = rng.choice(ints)
        cfg[k] = rng.choice(HUGE)
        return f"{k}={cfg[k]}"
    if kind == "list":
        k = rng.choice(lists)
        cfg[k] = [rng.choice(HUGE)] + cfg[k][1:]
        return f"{k}={cfg[k]}"
    if kind == "labels":
        cfg["num_labels"] = rng.choice(HUGE)
        return f"num_labels={cfg['num_labels']}"
    if kind == "attn":
        cfg["attn_implementation"] = rng.choice(["kernels-community/flash-attn3", "someone/evil-kernel"])
        return f"attn_implementation={cfg['attn_implementation']}"
    cfg.update(backbone="microsoft/resnet-50", use_pretrained_backbone=True, use_timm_backbone=False,
               backbone_config=None)
    return "backbone=microsoft/resnet-50"


def transformers_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return sorted(t for t in CONFIG_MAPPING.keys() if isinstance(MODEL_MAPPING_NAMES.get(t), str))


def diffusers_classes() -> list[str]:
    import diffusers
    from diffusers.models.modeling_utils import ModelMixin

    out = []
    for name in sorted(getattr(diffusers, "_import_structure", {}).get("models", [])):
        try:
            cls = getattr(diffusers, name)
        except Exception:  # noqa: BLE001 -- a class whose optional dependency is missing
            continue
        if isinstance(cls, type) and issubclass(cls, ModelMixin) and getattr(cls, "config_name", None):
            out.append(name)
    return out


def make_transformers(root: Path, mt: str, rng: random.Random) -> str | None:
    import warnings

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from transformers.utils import logging as tlog

    tlog.set_verbosity_error()  # a default config's own complaints (token ids outside its vocabulary)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = CONFIG_MAPPING[mt]().to_dict()
        except Exception:  # noqa: BLE001 -- a config class without defaults: not a case
            return None
    cfg = json.loads(json.dumps(cfg, default=str))
    cfg["architectures"] = [MODEL_MAPPING_NAMES[mt]]
    what = _hostile(rng, cfg)
    d = root / f"tf-{mt}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    write_weights(d)
    return f"{mt}: {what}"


def make_diffusers(root: Path, name: str, rng: random.Random) -> str | None:
    import diffusers

    cls = getattr(diffusers, name)
    params = inspect.signature(cls.__init__).parameters.values()
    ints = sorted(p.name for p in params if isinstance(p.default, int) and not isinstance(p.default, bool))
    cfg: dict[str, Any] = {"_class_name": name, "_diffusers_version": diffusers.__version__}
    sizes = [k for k in ints if k in ("sample_size", "patch_size", "num_layers", "layers_per_block")]
    if "sample_size" in ints and "patch_size" in ints and rng.random() < 0.5:
        cfg.update(sample_size=rng.choice((1024, 4096, 10**5)), patch_size=1)
        what = f"sample_size={cfg['sample_size']}, patch_size=1"
    elif ints:
        k = rng.choice(sizes or ints)
        cfg[k] = rng.choice(HUGE)
        what = f"{k}={cfg[k]}"
    else:
        return None
    d = root / f"df-{name}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    write_weights(d)
    return f"{name}: {what}"


def build(root: Path, seed: int, n_transformers: int | None, n_diffusers: int | None) -> list[str]:
    """The cases under ``root``: a seeded sample (None: every type / class)."""
    rng = random.Random(seed)
    types, classes = transformers_types(), diffusers_classes()
    if n_transformers is not None:
        types = rng.sample(types, min(n_transformers, len(types)))
    if n_diffusers is not None:
        classes = rng.sample(classes, min(n_diffusers, len(classes)))
    made = [make_transformers(root, t, rng) for t in types] + [make_diffusers(root, c, rng) for c in classes]
    return [m for m in made if m]


def run(root: Path, env: dict[str, str], deadline: float) -> tuple[int, dict[str, Any] | None, str, float]:
    """``ckptctl verify --json`` over every case under ``root``: (exit code, document or None,
    stderr, seconds)."""
    paths = sorted(str(p) for p in root.iterdir() if p.is_dir() and (p / "config.json").is_file())
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ckptctl", "verify", "--json", *paths], capture_output=True,
                          env={**os.environ, **env}, timeout=deadline, text=True)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = None
    return proc.returncode, doc, proc.stderr, time.monotonic() - t0


def judge(code: int, doc: dict[str, Any] | None, stderr: str, netlog: Path) -> list[str]:
    """What went wrong, or []."""
    problems = []
    if code not in (0, 1) or doc is None:
        problems.append(f"exit {code}, document {'parsed' if doc else 'unparsable'}: {stderr[-500:]}")
    if netlog.exists() and netlog.read_text().strip():
        problems.append(f"connections tried: {netlog.read_text()[:500]}")
    for res in (doc or {}).get("results", []):
        for f in res["findings"]:
            text = f["message"].lower()
            if f["severity"] == "error" and f["code"] == "config.class_refused" and any(w in text for w in BOX_WORDS):
                problems.append(f"{res['path']}: an error the box caused: {f['code']}: {f['message'][:300]}")
            bound = (f.get("details") or {}).get("bound")
            if bound is not None and bound not in ("time", "memory", "network", "died"):
                problems.append(f"{res['path']}: unknown bound {bound!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="an empty folder for the cases")
    ap.add_argument("--seed", type=int, default=44)
    ap.add_argument("--all", action="store_true", help="every model type and diffusers class (the full sweep)")
    ap.add_argument("--transformers", type=int, default=8)
    ap.add_argument("--diffusers", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=3600.0, help="seconds the verify run may take")
    a = ap.parse_args(argv)
    cases = build(a.root / "cases", a.seed, None if a.all else a.transformers, None if a.all else a.diffusers)
    env = recorder(a.root / "site")
    code, doc, stderr, seconds = run(a.root / "cases", env, a.deadline)
    problems = judge(code, doc, stderr, a.root / "site" / "net.log")
    notes = [f for r in (doc or {}).get("results", []) for f in r["findings"] if (f.get("details") or {}).get("bound")]
    print(f"{len(cases)} cases (seed {a.seed}) in {seconds:.1f} s, exit {code}; {len(notes)} bound notes "
          f"({', '.join(sorted({n['details']['bound'] for n in notes}))}); {len(problems)} problems")
    for p in problems:
        print(" ", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
