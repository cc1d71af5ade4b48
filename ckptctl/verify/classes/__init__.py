"""The model-class check: the library that owns a checkpoint builds its class on the meta device
and its own loader's key matching judges the checkpoint's header entries (design I13).

Which library and which class: a component of a pipeline or sentence-transformers root uses the
class its manifest (``model_index.json``, ``modules.json``) names; otherwise a config.json with
``_class_name``/``_diffusers_version`` is diffusers', any other is transformers'; a PEFT adapter
is applied by peft to its base model's class when the base is local (``--base``). The weights
compared are the family that library loads (``model.safetensors`` first, then the index, then
the pickles). An fp8 block-quantized transformers checkpoint is built with its quantizer
(:mod:`.quantized`). A library that is not installed, a class it lacks, remote code (never run),
any other quantized checkpoint, or any failure while building is a note
(``config.class_not_checked``) that names the check that did not run and why; the static rules
then stand alone.

The build runs in a box (issue 44, :mod:`.box`): a child process with a wall-clock limit, an
address-space limit and no network, one per verify run, fed plain data (config.json as parsed,
the tensors' names, dtypes and shapes) and answering plain data (an :class:`~.outcome.Outcome`
or why not). What config.json alone shows to be absurd never reaches it (:mod:`.bounds`); a
bound hit, a child that dies and a build that needs the network are notes naming the bound.
Nothing here imports torch or a library: the child imports the oracle of the library it needs
(:mod:`.transformers_class`, :mod:`.diffusers_class`, :mod:`.peft_class`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from ckptctl import layout as L
from ckptctl.findings import ERROR, INFO, WARNING
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.verify.classes.bounds import check_adapter, check_config
from ckptctl.verify.classes.outcome import NotChecked, Outcome
from ckptctl.verify.classes.quantized import method_name, not_built, quantization
from ckptctl.verify.context import MAX_JSON_BYTES, Context, FamilyTensors
from ckptctl.verify.weights import transformers_rank

DIFFUSERS_KEYS = ("_class_name", "_diffusers_version")
IMPORT_NAMES = {"transformers": "transformers", "diffusers": "diffusers",
                "sentence-transformers": "sentence_transformers"}
MAX_LISTED = 50  # keys listed in a finding's details
MAX_SHAPE_FINDINGS = 100  # one finding per mismatched tensor, up to this many


def importable(name: str) -> bool:
    """Whether ``import name`` would find the package, without importing it (a module set to
    None in ``sys.modules`` is one Python refuses to import)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def loaded_family(ctx: Context) -> FamilyTensors | None:
    """The weights family a transformers/diffusers/sentence-transformers loader reads from this
    directory (its main family, in transformers' order of precedence; a variant when it is the
    only one)."""
    models = [t for t in ctx.tables if t.family.kind in (L.SAFETENSORS, L.PYTORCH)]
    main = [t for t in models if t.family.variant is None]
    if not main and len({t.family.variant for t in models}) == 1:
        main = models  # a variant alone: what from_pretrained(variant=...) loads
    return min(main, key=lambda t: transformers_rank(t.family)) if main else None


def _library(ctx: Context, cfg: dict[str, Any]) -> tuple[str, str | None]:
    """(library, class named by the root's manifest or None)."""
    declared = ctx.declared_class
    if declared is not None:
        lib, cls = declared
        if lib == "sentence_transformers":
            return "sentence-transformers", cls
        if lib in ("diffusers", "transformers"):
            return lib, cls
    if any(k in cfg for k in DIFFUSERS_KEYS):
        return "diffusers", None
    return "transformers", None


def _request(library: str, doc: dict[str, Any], fam: FamilyTensors, cls: str | None, where: str) -> dict[str, Any]:
    """What the box's child builds (:mod:`.child`): plain data."""
    from ckptctl.verify.classes.box import rows

    if library == "sentence-transformers" and cls is None:
        raise NotChecked("modules.json names no module class")
    op = {"transformers": "transformers", "diffusers": "diffusers"}.get(library, "st")
    return {"op": op, "cfg": doc, "tensors": rows(fam.tensors), "cls": cls, "where": os.path.abspath(where),
            "single_file": not fam.family.index}


def precheck(library: str, cfg: dict[str, Any], cls: str | None, *, quantized: bool = False) -> None:
    """Raise :class:`NotChecked` for what config.json alone rules out, before any import. A count
    of layers or experts, or a label map, past the bounds of :mod:`.bounds` (config.json is
    untrusted input: the class would be built with that many modules) is one; so is a quantized
    checkpoint, unless ``quantized`` (the
    caller builds a transformers class with its quantizer) and it is one that :mod:`.quantized`
    builds (fp8 block-quantized)."""
    check_config(cfg)
    q = quantization(cfg)
    if q is not None:
        why = not_built(cfg)
        if why is None and not (quantized and library == "transformers"):
            why = (f"a checkpoint quantized with {method_name(q)}: its layers exist only once a quantizer replaces "
                   "them; the class check builds quantized layers only for a transformers model's own weights (not "
                   "for another library, nor under a PEFT adapter)")
        if why is not None:
            raise NotChecked(why)
    if library != "transformers" or cls is not None:
        return
    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise NotChecked("config.json names no architectures: which class a user loads is unknown")
    if not isinstance(cfg.get("model_type"), str):
        raise NotChecked("config.json has no model_type: transformers cannot pick a config class")


def activation_finding(ctx: Context, shown: str, cfg: dict[str, Any]) -> None:
    """A sentence-transformers module's ``activation_function`` that is not a ``torch.nn`` class
    path: sentence-transformers imports a ``torch.*`` path to load it (that module's code runs),
    and ignores any other without trust_remote_code. verify imports neither (issue 44): the class
    is built with the module's default activation."""
    from ckptctl.verify.classes.diffusers_class import torch_nn_class

    act = cfg.get("activation_function")
    if not isinstance(act, str) or torch_nn_class(act) is not None:
        return
    fix = "set activation_function to a torch.nn class (torch.nn.modules.activation.Tanh, torch.nn.Identity)"
    if act.startswith("torch."):
        ctx.add("config.st_activation", ERROR, shown,
                f"activation_function {act[:200]!r} is not a torch.nn class: sentence-transformers imports "
                f"{act.rpartition('.')[0][:200]!r} to load it (that module's code runs, and its loader raises unless "
                "it is a torch.nn.Module class); verify imports nothing a file names", fix, None, value=act[:200])
    else:
        ctx.add("config.st_activation", WARNING, shown,
                f"activation_function {act[:200]!r} is not a torch.nn class: sentence-transformers replaces it with "
                "Tanh (with a warning), or imports and runs it with trust_remote_code; verify imports nothing a "
                "file names", fix, None, value=act[:200])


def _note(ctx: Context, shown: str, library: str, why: str, **details: Any) -> str:
    ctx.add("config.class_not_checked", INFO, shown, f"the model-class check ({library}) did not run: {why}; "
            "the static config rules stand alone", None, library=library, reason=why, **details)
    return why


def model_class_step(ctx: Context) -> str | None:
    """Build the class the checkpoint's library loads and report its loader's differences; why it
    did not run, or None (``--static`` is the pipeline's step's to turn it off)."""
    fam = loaded_family(ctx)
    if fam is None:
        adapter = next((t for t in ctx.tables if t.family.kind == L.PEFT), None)
        if adapter is not None:
            return adapter_class_step(ctx, adapter)
        return "no model weights: no safetensors or .bin family"
    if N.CONFIG not in ctx.names:
        return "no config.json"
    present, cfg = ctx.open_json(N.CONFIG, "config", "config.bad_json")
    if not present or not isinstance(cfg, dict):
        return "config.json could not be read as a JSON object: see its finding"
    if not fam.complete:
        return "some weights files are missing or unreadable"
    shown = ctx.disp(N.CONFIG)
    library, cls = _library(ctx, cfg)
    try:
        precheck(library, cfg, cls, quantized=True)
    except NotChecked as exc:
        return _note(ctx, shown, library, exc.reason)
    if not importable(IMPORT_NAMES[library]):
        return _note(ctx, shown, library, f"{library} is not installed")
    if not importable("torch"):
        return _note(ctx, shown, library, "torch is not installed")
    if library == "sentence-transformers":
        activation_finding(ctx, shown, cfg)
    try:
        request = _request(library, cfg, fam, cls, str(ctx.root))
    except NotChecked as exc:
        return _note(ctx, shown, library, exc.reason)
    box = _box(ctx)
    answer = box.ask(request)
    return _answered(ctx, shown, fam, library, answer, box)


def _box(ctx: Context) -> Any:
    """The box the check runs in: the process's shared one (:func:`.box.shared_box`)."""
    from ckptctl.verify.classes.box import shared_box

    return shared_box()


def _bound_reason(answer: dict[str, Any], box: Any) -> str:
    which, detail = answer.get("which"), answer.get("reason", "")
    if which == "time":
        return f"building the class ran past the box's time limit of {box.timeout:g} s (CKPTCTL_CLASS_TIMEOUT)"
    if which == "memory":
        return (f"building the class needs more than the box's {box.memory / (1 << 30):.3g} GiB of address space "
                f"(CKPTCTL_CLASS_MEMORY): {detail}")
    return (f"building the class needs the network, which the box never has ({detail}): config.json names "
            "something to download (a Hub repository, a kernel, a pretrained backbone)")


def _answered(ctx: Context, shown: str, fam: FamilyTensors, library: str, answer: dict[str, Any],
              box: Any) -> str | None:
    """The findings of the box's answer to one class check; why it did not run, or None."""
    kind = answer.get("kind")
    if kind == "outcome":
        try:
            outcome = outcome_of(answer["outcome"])
        except (KeyError, TypeError, ValueError):
            return _note(ctx, shown, library, "the process building the class answered something that is not an "
                         "outcome", bound="died")
        report_outcome(ctx, shown, fam, outcome)
        if library != "peft":
            ctx.class_checked = True
        return None
    if kind == "refused" and library == "peft":
        return _note(ctx, shown, library, f"building the adapted class failed: Refused: {answer['reason']}")
    if kind == "refused":  # the loader raises the same: the static rules still run (class_checked stays False)
        ctx.add("config.class_refused", ERROR, shown, f"{library} cannot build the model from config.json: "
                f"{answer['reason']}; its from_pretrained raises the same", "fix config.json to the model that was saved",
                None, library=library, reason=answer["reason"])
        return None
    if kind == "not_checked":
        return _note(ctx, shown, library, answer["reason"])
    if kind == "bound":
        return _note(ctx, shown, library, _bound_reason(answer, box), bound=answer.get("which"))
    if kind == "died":
        return _note(ctx, shown, library, f"{answer.get('reason')} under the box's bounds ({box.bounds()})",
                     bound="died")
    what = "building the adapted class failed" if library == "peft" else "building the class failed"
    return _note(ctx, shown, library, f"{what}: {answer.get('reason')}")


def outcome_of(doc: dict[str, Any]) -> Outcome:
    """An :class:`Outcome` from the dict the child sent."""
    out = Outcome(**doc)
    out.mismatched = [(k, tuple(got), tuple(want)) for k, got, want in out.mismatched]
    return out


def _adapter_precheck(acfg: dict[str, Any]) -> None:
    """What the adapter rules refuse to hand to ``re`` (a malformed field, a pattern that can take
    exponential time): peft would hang or fail on it too, and its findings say so."""
    from ckptctl.verify.peft import (
        _backtracking_risk,
        _config_field_problem,
        _user_patterns,
    )

    if not isinstance(acfg.get("peft_type"), str):
        raise NotChecked("adapter_config.json names no peft_type")
    problem = _config_field_problem(acfg)
    if problem:
        raise NotChecked(f"adapter_config.json cannot be used as peft uses it ({problem})")
    if any(_backtracking_risk(p) for p in _user_patterns(acfg)):
        raise NotChecked("a pattern of adapter_config.json nests quantifiers: peft's matching could take "
                         "exponential time")


def adapter_class_step(ctx: Context, fam: FamilyTensors) -> str | None:
    """A PEFT adapter: peft applies it to its base model's class (built from the base's
    config.json) and loads its keys; why it did not run, or None."""
    from ckptctl.verify.peft import find_base

    present, acfg = ctx.open_json(N.ADAPTER_CONFIG, "config", "adapter.bad_config")
    if not present or not isinstance(acfg, dict):
        return f"no readable {N.ADAPTER_CONFIG}: see its finding"
    root = ctx.base_root
    if root is None and isinstance(acfg.get("base_model_name_or_path"), str):
        root = find_base(acfg["base_model_name_or_path"])
    if root is None:  # adapter.base_unavailable says so
        return "the adapter's base model is not available locally (--base DIR)"
    shown = ctx.disp(N.ADAPTER_CONFIG)
    try:
        base_cfg = small.loads(small.read_small(root / N.CONFIG, limit=MAX_JSON_BYTES, follow=True).decode())
    except (OSError, ValueError) as exc:
        return _note(ctx, shown, "peft", f"the base model's config.json cannot be read ({type(exc).__name__})")
    if not fam.complete:
        return "some weights files are missing or unreadable"
    try:
        if not isinstance(base_cfg, dict):
            raise NotChecked("the base model's config.json is not a JSON object")
        precheck("transformers", base_cfg, None)
        _adapter_precheck(acfg)
        check_adapter(acfg, fam.tensors)
        for lib in ("peft", "transformers", "torch"):
            if not importable(lib):
                raise NotChecked(f"{lib} is not installed")
    except NotChecked as exc:
        return _note(ctx, shown, "peft", exc.reason)
    from ckptctl.verify.classes.box import rows

    request = {"op": "peft", "cfg": base_cfg, "acfg": acfg, "tensors": rows(fam.tensors)}
    box = _box(ctx)
    answer = box.ask(request)
    return _answered(ctx, shown, fam, "peft", answer, box)


def _listed(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")


def report_outcome(ctx: Context, shown: str, fam: FamilyTensors, o: Outcome) -> None:
    """The findings of one class check."""
    lib, cls = o.library, o.cls
    weights = ctx.disp(fam.family.files[0]) if len(fam.family.files) == 1 else shown
    if o.missing:
        ctx.add("config.class_missing", ERROR, weights,
                f"{len(o.missing)} tensors that {cls} needs are not stored ({_listed(o.missing)}): {lib} "
                f"{o.on_missing}", "export the checkpoint again with every tensor, or fix config.json to the "
                "model that was saved", tensor=o.missing[0], cls=cls, keys=o.missing[:MAX_LISTED],
                count=len(o.missing))
    for key, got, want in o.mismatched[:MAX_SHAPE_FINDINGS]:
        ctx.add("config.class_shape", ERROR, weights,
                f"{key!r} is stored as {list(got)} but {cls} built from config.json has {list(want)}: {lib} "
                f"{o.on_mismatch}", "fix config.json to the model that was saved (or export the weights again)",
                tensor=key, cls=cls, stored=list(got), expected=list(want))
    if len(o.mismatched) > MAX_SHAPE_FINDINGS:
        ctx.add("config.class_shape", ERROR, weights, f"... and {len(o.mismatched) - MAX_SHAPE_FINDINGS} more "
                f"tensors whose shape differs from {cls}'s", None, count=len(o.mismatched))
    for key, msg in sorted(o.conversion.items())[:MAX_LISTED]:
        ctx.add("config.class_shape", ERROR, weights,
                f"{lib} cannot convert {key!r} into {cls}'s layout ({msg}): its loader raises",
                "export the checkpoint again, or fix config.json to the model that was saved", tensor=key, cls=cls)
    disagree = set(o.disagrees)
    if o.disagrees:
        ctx.add("config.class_disagrees", ERROR, weights,
                f"{len(o.disagrees)} stored tensors sit in modules {cls} builds without them ({_listed(o.disagrees)}): "
                f"config.json disagrees with its weights (a layer past the config's count, a bias or norm the config "
                f"turns off); {lib} {o.on_unexpected}", "fix config.json to the model that was saved",
                tensor=o.disagrees[0], cls=cls, keys=o.disagrees[:MAX_LISTED], count=len(o.disagrees))
    unused = [k for k in o.unexpected if k not in disagree]
    if unused:
        ctx.add("config.class_unused", ERROR if o.unexpected_raises else WARNING, weights,
                f"{len(unused)} stored tensors have no place in {cls} ({_listed(unused)}): {lib} {o.on_unexpected}",
                "drop them (ckptctl resave), or fix architectures in config.json if they belong to another head",
                tensor=unused[0], cls=cls, keys=unused[:MAX_LISTED], count=len(unused))
