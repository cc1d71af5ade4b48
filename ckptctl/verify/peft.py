"""adapter_config.json against a PEFT adapter's tensors (and its base model's, when it is
available locally): the rules, and the step that runs them.

The rules follow peft's own matching (``check_target_module_exists``, ``get_pattern_key``,
``get_peft_model_state_dict``): ``target_modules`` as a string is a regex fullmatch, as a list an
exact name or a ``.name`` suffix, with ``exclude_modules``, ``layers_to_transform`` and
``layers_pattern``; ``rank_pattern`` keys match ``(.*\\.)?key$``. The base model is ``--base``, else
``base_model_name_or_path`` when it is a local directory or a repo in the local Hugging Face cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptctl import layout as L
from ckptctl.config_fields import as_int
from ckptctl.errors import CkptctlError
from ckptctl.findings import ERROR, INFO, WARNING, Finding, PathFindings
from ckptctl.format import names as N
from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.context import Context, VerifyOptions
from ckptctl.verify.index import family_tensors
from ckptctl.verify.model import Tensors
from ckptctl.verify.report import PathResult
from ckptctl.verify.screen import scan_directory
from ckptctl.verify.weights import transformers_rank

_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$")
_LORA_PARAM = re.compile(r"^(?P<module>.+)\.(?P<part>lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                         r"(?:\.(?P<adapter>[^.]+))?$")
EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")
_FIX_ADAPTER = "fix adapter_config.json, or save the adapter again with peft"


def _valid_match(key: str, target: str) -> bool:
    return key == target or key.endswith("." + target)


def _user_patterns(acfg: dict[str, Any]) -> list[str]:
    """Every regex adapter_config.json hands to ``re``, as peft builds them."""
    out: list[str] = []
    for k in ("target_modules", "exclude_modules"):
        if isinstance(acfg.get(k), str):
            out.append(acfg[k])
    lp = acfg.get("layers_pattern")
    for p in [lp] if isinstance(lp, str) else lp if isinstance(lp, list) else []:
        out.append(rf".*\.{p}\.(\d+)\.")
    for k in ("rank_pattern", "alpha_pattern"):
        if isinstance(acfg.get(k), dict):
            out.extend(rf"(.*\.)?({p})$" for p in acfg[k])
    return out


def _config_field_problem(acfg: dict[str, Any]) -> str | None:
    """Why adapter_config.json's matching fields cannot be used as peft uses them, or None."""
    def str_or_strs(v: Any) -> bool:
        return v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))

    for k in ("exclude_modules", "layers_pattern", "modules_to_save"):
        if not str_or_strs(acfg.get(k)):
            return f"{k!r} is {acfg.get(k)!r}, not a string or a list of strings"
    layers = acfg.get("layers_to_transform")
    if not (layers is None or (isinstance(layers, int) and not isinstance(layers, bool))
            or (isinstance(layers, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in layers))):
        return f"'layers_to_transform' is {layers!r}, not an integer or a list of integers"
    for k in ("rank_pattern", "alpha_pattern"):
        v = acfg.get(k)
        if v is not None and not (isinstance(v, dict) and all(isinstance(x, str) for x in v)):
            return f"{k!r} is {v!r}, not an object with pattern keys"
    for p in _user_patterns(acfg):
        try:
            re.compile(p)
        except re.error as exc:
            return f"invalid regex {p!r} ({exc})"
    return None


# Repetition a backtracking matcher can take exponential (or high polynomial) time over: a repeated
# body that holds another repeat ((a+)+, (\w+\.?\w*)*) or an alternation ((.|.)*z, (a|ab)*c), or
# more unbounded repeats in one pattern than _MAX_REPEATS (.*a.*b.*c.*d.*e).
_MAX_REPEATS = 4


def _backtracking_risk(pattern: str) -> str | None:
    """Why ``pattern`` may take ``re`` exponential time on a module name (None when it cannot):
    read from ``re``'s own parse of it, never by running it."""
    from re import _constants as C, _parser as P

    repeats = 0

    def walk(items: Any, repeated: bool) -> str | None:
        nonlocal repeats
        for op, av in items:
            if op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
                lo, hi, body = av
                many = hi is C.MAXREPEAT or hi > 1
                if many and op is not C.POSSESSIVE_REPEAT:
                    if repeated:
                        return "it nests quantifiers"
                    repeats += 1
                    if repeats > _MAX_REPEATS:
                        return f"it has more than {_MAX_REPEATS} unbounded repeats"
                why = walk(body, repeated or (many and op is not C.POSSESSIVE_REPEAT))
            elif op is C.BRANCH:
                if repeated:
                    return "it repeats an alternation"
                why = next((w for b in av[1] if (w := walk(b, repeated))), None)
            elif op is C.SUBPATTERN:
                why = walk(av[3], repeated)
            elif op in (C.ASSERT, C.ASSERT_NOT):
                why = walk(av[1], repeated)
            elif op is C.ATOMIC_GROUP:
                why = walk(av, False)
            elif op is C.GROUPREF_EXISTS:
                why = walk(av[1], repeated) or (walk(av[2], repeated) if av[2] else None)
            elif op is C.GROUPREF and repeated:
                why = "it repeats a back reference"
            else:
                why = None
            if why:
                return why
        return None

    try:
        return walk(P.parse(pattern), False)
    except (re.error, RecursionError, OverflowError, ValueError):
        return "it cannot be parsed"


def peft_target_match(acfg: dict[str, Any], key: str) -> bool:
    """peft's ``check_target_module_exists`` for a module name of the base model."""
    excl = acfg.get("exclude_modules")
    if excl:
        if isinstance(excl, str):
            if re.fullmatch(excl, key):
                return False
        elif key in excl or any(key.endswith(f".{e}") for e in excl):
            return False
    tm = acfg.get("target_modules")
    if isinstance(tm, str):
        return tm == "all-linear" or re.fullmatch(tm, key) is not None
    if not isinstance(tm, list):
        return False
    if key in tm:
        return True
    found = any(key.endswith(f".{t}") for t in tm if isinstance(t, str))
    layers = acfg.get("layers_to_transform")
    pattern = acfg.get("layers_pattern")
    using = layers is not None and (len(layers) != 0 if isinstance(layers, list) else True)
    if using and found:
        idx = None
        if not pattern:
            idx = re.match(r".*\.[^.]*\.(\d+)\.", key)
        else:
            for p in [pattern] if isinstance(pattern, str) else pattern:
                idx = re.match(rf".*\.{p}\.(\d+)\.", key)
                if idx is not None:
                    break
        if idx is None:
            return False
        i = int(idx.group(1))
        return i == layers if isinstance(layers, int) else i in layers
    return found


def peft_rank(acfg: dict[str, Any], key: str) -> int | None:
    """The rank peft gives a module: ``rank_pattern`` (``(.*\\.)?pattern$``) else ``r``."""
    rp = acfg.get("rank_pattern") or {}
    if isinstance(rp, dict):
        for pattern, r in rp.items():
            if re.match(rf"(.*\.)?({pattern})$", key):
                return as_int(r)
    return as_int(acfg.get("r"))


@dataclass
class _Module:
    """The LoRA tensors of one adapted module, by part."""

    parts: dict[str, TensorSpec] = field(default_factory=dict)  # lora_A, lora_B, lora_embedding_A, ...


def check_adapter(display: str, acfg: Any, tensors: Tensors, *,
                  base: Tensors | None = None, base_label: str | None = None) -> list[Finding]:
    """Findings about adapter_config.json against the adapter's tensors (and the base model's, if known)."""
    ctx = PathFindings(display)
    if not isinstance(acfg, dict):
        ctx.add("adapter.bad_config", ERROR, f"{display}: top level is not a JSON object", _FIX_ADAPTER)
        return ctx.findings
    peft_type = acfg.get("peft_type")
    if not isinstance(peft_type, str):
        ctx.add("adapter.missing_field", ERROR, f"{display}: no 'peft_type' (peft cannot load the adapter)",
                _FIX_ADAPTER, field="peft_type")
        return ctx.findings
    if not tensors:
        ctx.add("adapter.empty", ERROR, f"{display}: the adapter weights file holds no tensors",
                "save the adapter again with peft")
        return ctx.findings
    if peft_type != "LORA":
        ctx.add("adapter.not_checked", INFO, f"{display}: peft_type {peft_type!r}: only LoRA adapters are "
                "checked in depth")
        return ctx.findings
    if "lora_alpha" in acfg and acfg["lora_alpha"] is None:
        # peft's default applies only to an absent key: LoraConfig(lora_alpha=None) divides by it on load
        ctx.add("adapter.missing_optional", ERROR, f"{display}: 'lora_alpha' is null: peft passes it on and "
                "raises TypeError when it loads the adapter (only an absent key falls back to the default)",
                "set lora_alpha to the value used in training (or remove the key for peft's default)",
                field="lora_alpha")
    for key in ("lora_alpha", "base_model_name_or_path"):
        if key not in acfg or (acfg[key] is None and key != "lora_alpha"):
            ctx.add("adapter.missing_optional", WARNING, f"{display}: no {key!r} (peft falls back to a default)",
                    _FIX_ADAPTER, field=key)
    r = as_int(acfg.get("r"))
    if r is None or r <= 0:
        ctx.add("adapter.missing_field", ERROR, f"{display}: 'r' is {acfg.get('r')!r}, not a positive integer",
                _FIX_ADAPTER, field="r")
        return ctx.findings
    tm = acfg.get("target_modules")
    if tm is None and acfg.get("target_parameters"):
        ctx.add("adapter.not_checked", INFO, f"{display}: adapter uses target_parameters; module matching skipped")
        return ctx.findings
    if not isinstance(tm, (str, list)):
        ctx.add("adapter.missing_field", ERROR, f"{display}: 'target_modules' is {tm!r}, not a list or regex",
                _FIX_ADAPTER, field="target_modules")
        return ctx.findings
    problem = _config_field_problem(acfg)
    if problem:
        ctx.add("adapter.bad_config", ERROR, f"{display}: {problem}", _FIX_ADAPTER)
        return ctx.findings
    risky = [(p, why) for p in _user_patterns(acfg) if (why := _backtracking_risk(p))]
    if risky:
        ctx.add("adapter.regex_not_checked", INFO,
                f"{display}: pattern {risky[0][0]!r} was not run: {risky[0][1]}, which can take exponential "
                "time; module matching was skipped",
                "peft may hang on it too: write the pattern without repetition over a quantifier or an "
                "alternation (a list of module names, or one alternation not repeated)")
        return ctx.findings

    modules: dict[str, _Module] = {}
    bad_prefix: list[str] = []
    named: list[str] = []
    unexpected: list[str] = []
    mts = acfg.get("modules_to_save") or []
    bias_mode = acfg.get("bias", "none")
    for name, t in tensors.items():
        if not name.startswith(_PREFIX):
            bad_prefix.append(name)
            continue
        rel = name[len(_PREFIX):]
        m = _LORA_KEY.match(rel) or _LORA_PARAM.match(rel)
        if m:
            adapter = m.group("adapter")
            part = m.group("part")
            if adapter == "weight" and part == "lora_magnitude_vector":
                adapter = None
            if adapter is not None:
                named.append(name)
                continue
            if m.re is _LORA_KEY and m.group("param") == "bias":
                if part == "lora_B" and acfg.get("lora_bias"):
                    continue
                unexpected.append(name)
                continue
            modules.setdefault(m.group("module"), _Module()).parts[part] = t
            continue
        module = rel.rsplit(".", 1)[0] if "." in rel else rel
        if any(_valid_match(module, x) for x in mts if isinstance(x, str)):
            continue
        if rel.endswith(".bias") and bias_mode in ("all", "lora_only"):
            continue
        if module.split(".")[-1] in EMBEDDING_LAYER_NAMES:
            continue  # save_embedding_layers: resized embeddings are saved whole
        unexpected.append(name)
    if bad_prefix:
        ctx.add("adapter.bad_prefix", ERROR,
                f"{len(bad_prefix)} adapter keys do not start with {_PREFIX!r} ({bad_prefix[0]!r}, ...): peft will "
                "not find them", "save the adapter with peft's save_pretrained (it adds the prefix)",
                tensor=bad_prefix[0], keys=bad_prefix[:50])
    if named:
        ctx.add("adapter.adapter_name_in_key", ERROR,
                f"{len(named)} adapter keys still contain the adapter name ({named[0]!r}, ...): peft inserts it on "
                "load, so these keys never match", "save with peft's save_pretrained (it removes the adapter name)",
                tensor=named[0], keys=named[:50])
    if unexpected:
        ctx.add("adapter.unexpected_key", WARNING,
                f"{len(unexpected)} keys are neither LoRA weights nor modules_to_save ({unexpected[0]!r}, ...); peft "
                "ignores them", "list the module in modules_to_save, or drop the keys", tensor=unexpected[0],
                keys=unexpected[:50])

    by_parameter = _parameter_targeted(acfg, modules)
    if by_parameter:  # peft's ParamWrapper: rows r x experts, nested base_layer names, no .weight in the base
        ctx.add("adapter.not_checked", INFO,
                f"{display}: {len(by_parameter)} LoRA modules target parameters (target_parameters: "
                f"{_first_of(acfg.get('target_parameters'))}): only generic checks ran on them",
                None, modules=sorted(by_parameter)[:50])
        modules = {m: info for m, info in modules.items() if m not in by_parameter}
    untargeted = [mod for mod in modules if not peft_target_match(acfg, mod)]
    if untargeted:
        first = untargeted[0]
        ctx.add("adapter.untargeted_key", ERROR,
                f"{len(untargeted)} LoRA modules are not matched by target_modules={tm!r} ({first!r}, ...): peft "
                "creates no LoRA layer there and drops their weights",
                "add the modules to target_modules (peft matches list entries by exact name or '.name' suffix, "
                "a string as a full regex)", tensor=_PREFIX + first, modules=untargeted[:50])
    _check_lora_shapes(ctx, acfg, modules, r)
    if base is not None:
        _check_against_base(ctx, acfg, modules, base, base_label or "base model")
    return ctx.findings


def _first_of(value: Any) -> str:
    items = value if isinstance(value, list) else [value]
    return ", ".join(repr(x) for x in items[:3]) + (" ..." if len(items) > 3 else "")


def _parameter_targeted(acfg: dict[str, Any], modules: dict[str, "_Module"]) -> set[str]:
    """The LoRA modules peft made for ``target_parameters`` (a LoRA on a parameter, such as an MoE
    expert tensor, not on a module): the module of an entry (the entry without its parameter
    name) ends the module's name once peft's nested ``.base_layer`` wrappers are taken off."""
    targets = acfg.get("target_parameters")
    if not isinstance(targets, list):
        return set()
    owners = {t.rsplit(".", 1)[0] for t in targets if isinstance(t, str) and "." in t}
    out = set()
    for mod in modules:
        plain = mod
        while plain.endswith(".base_layer"):
            plain = plain[: -len(".base_layer")]
        if any(_valid_match(plain, o) for o in owners):
            out.add(mod)
    return out


def _check_lora_shapes(ctx: PathFindings, acfg: dict[str, Any], modules: dict[str, _Module], r: int) -> None:
    unpaired: list[str] = []
    rank_bad: list[tuple[str, int, int | None]] = []
    dora_missing: list[str] = []
    use_dora = bool(acfg.get("use_dora"))
    for mod, info in modules.items():
        p = info.parts
        if "lora_A" in p or "lora_B" in p:
            a_key, b_key, emb = "lora_A", "lora_B", False
        elif "lora_embedding_A" in p or "lora_embedding_B" in p:
            a_key, b_key, emb = "lora_embedding_A", "lora_embedding_B", True
        else:
            continue  # only a magnitude vector: reported as unpaired below
        if a_key not in p or b_key not in p:
            unpaired.append(_PREFIX + mod)
            continue
        want = peft_rank(acfg, mod) or r
        a, b = p[a_key], p[b_key]
        got_a = a.shape[0] if a.shape else None
        got_b = b.shape[1] if len(b.shape) >= 2 else None
        if got_a != want or got_b != want:
            rank_bad.append((a.name, want, got_a if got_a != want else got_b))
        if use_dora and not emb and "lora_magnitude_vector" not in p:
            dora_missing.append(_PREFIX + mod)
    for mod, info in modules.items():
        if set(info.parts) == {"lora_magnitude_vector"}:
            unpaired.append(_PREFIX + mod)
    if unpaired:
        ctx.add("adapter.pair_missing", ERROR,
                f"{len(unpaired)} LoRA modules lack their A or B matrix ({unpaired[0]!r}, ...); peft reports them as "
                "missing adapter keys and leaves them at their initial values",
                "save the adapter again; the file is incomplete", tensor=unpaired[0], modules=unpaired[:50])
    if rank_bad:
        name, want, got = rank_bad[0]
        ctx.add("adapter.rank_mismatch", ERROR,
                f"{len(rank_bad)} LoRA modules have rank {got} but adapter_config.json gives r={want} "
                f"({name!r}, ...); peft fails with a size mismatch",
                "set r (or rank_pattern) to the rank the tensors were trained with", tensor=name,
                expected=want, actual=got, count=len(rank_bad))
    if dora_missing:
        ctx.add("adapter.dora_magnitude_missing", ERROR,
                f"use_dora is true but {len(dora_missing)} LoRA modules have no lora_magnitude_vector "
                f"({dora_missing[0]!r}, ...)", "save the DoRA adapter again with peft, or set use_dora to false",
                tensor=dora_missing[0], modules=dora_missing[:50])


def _check_against_base(ctx: PathFindings, acfg: dict[str, Any], modules: dict[str, _Module],
                        base: Tensors, label: str) -> None:
    absent: list[str] = []
    shape_bad: list[tuple[str, str]] = []
    fan_in_fan_out = bool(acfg.get("fan_in_fan_out"))
    for mod, info in modules.items():
        w = base.get(mod + ".weight")
        if w is None:
            absent.append(mod)
            continue
        p = info.parts
        if "lora_A" in p and "lora_B" in p and len(w.shape) >= 2:
            out_f, in_f = (w.shape[1], w.shape[0]) if fan_in_fan_out else (w.shape[0], w.shape[1])
            a, b = p["lora_A"], p["lora_B"]
            if len(a.shape) < 2 or a.shape[1] != in_f or not b.shape or b.shape[0] != out_f:
                shape_bad.append((a.name, f"lora_A {list(a.shape)} / lora_B {list(b.shape)} vs base {list(w.shape)}"))
        elif "lora_embedding_A" in p and "lora_embedding_B" in p and len(w.shape) == 2:
            a, b = p["lora_embedding_A"], p["lora_embedding_B"]
            if len(a.shape) != 2 or a.shape[1] != w.shape[0] or not b.shape or b.shape[0] != w.shape[1]:
                shape_bad.append((a.name, f"lora_embedding_A {list(a.shape)} / lora_embedding_B {list(b.shape)} "
                                  f"vs base {list(w.shape)}"))
    if absent:
        ctx.add("adapter.module_not_in_base", ERROR,
                f"{len(absent)} LoRA modules do not exist in the {label} ({absent[0]!r}, ...)",
                "check base_model_name_or_path: the adapter was trained on another model", tensor=_PREFIX + absent[0],
                modules=absent[:50])
    if shape_bad:
        ctx.add("adapter.shape_mismatch", ERROR,
                f"{len(shape_bad)} LoRA modules do not fit the {label}: {shape_bad[0][1]} ({shape_bad[0][0]!r}, ...)",
                "check base_model_name_or_path (and fan_in_fan_out): the adapter was trained on another model",
                tensor=shape_bad[0][0], count=len(shape_bad))
    tm = acfg.get("target_modules")
    if tm == "all-linear" or tm is None:
        return
    wanted = sorted({n[: -len(".weight")] for n, t in base.items() if n.endswith(".weight") and len(t.shape) >= 2
                     and peft_target_match(acfg, n[: -len(".weight")])})
    missing = [m for m in wanted if m not in modules]
    if missing:
        ctx.add("adapter.missing_keys", ERROR,
                f"target_modules matches {len(wanted)} modules of the {label} but the adapter has no weights for "
                f"{len(missing)} of them ({missing[0]!r}, ...); peft warns 'Found missing adapter keys' and leaves "
                "them untrained", "save the adapter again (the file is incomplete), or narrow target_modules",
                tensor=_PREFIX + missing[0], modules=missing[:50], count=len(missing))


def find_base(spec: str) -> Path | None:
    """The adapter's base model, if it is available without network: a local directory or a repo
    in the local Hugging Face cache."""
    p = Path(spec)
    if p.is_dir():
        return p
    from ckptctl.resolve import resolve_path

    try:
        r = resolve_path(spec)
    except CkptctlError:
        return None
    return r if r.is_dir() else None


def base_tensors(root: Path) -> dict[str, TensorSpec] | None:
    """The tensors of a base model's safetensors weights (headers only), read with the same
    screening as a checkpoint (what it finds wrong is not this adapter's business), or None."""
    ctx = Context(root, PathResult(str(root), str(root)), VerifyOptions())
    scan_directory(ctx)
    fams = [f for f in (ctx.layout.families if ctx.layout else []) if f.kind == L.SAFETENSORS and f.variant is None]
    if not fams:
        return None
    return family_tensors(ctx, min(fams, key=transformers_rank)).tensors or None


def adapter_step(ctx: Context) -> str | None:
    """adapter_config.json against the first PEFT family, and against its base model when that
    is available locally; why it did not run, or None."""
    fam = next((t for t in ctx.tables if t.family.kind == L.PEFT), None)
    if fam is None:
        return "no adapter weights"
    present, acfg = ctx.open_json(N.ADAPTER_CONFIG, "config", "adapter.bad_config")
    if not present:
        return f"no readable {N.ADAPTER_CONFIG}: see its finding"
    shown = ctx.disp(N.ADAPTER_CONFIG)
    base, label = None, None
    root = ctx.base_root
    if root is None and isinstance(acfg, dict) and isinstance(acfg.get("base_model_name_or_path"), str):
        root = find_base(acfg["base_model_name_or_path"])
    if root is not None:
        base, label = base_tensors(root), f"base model {root}"
    if base is None and isinstance(acfg, dict) and acfg.get("peft_type") == "LORA":
        ctx.add("adapter.base_unavailable", INFO, shown,
                "the base model is not available locally; shapes and missing keys are not checked against it",
                "pass --base DIR (or download the base model) for the full check")
    ctx.extend(check_adapter(shown, acfg, fam.tensors, base=base, base_label=label))
    return None
