"""config.json against the tensors: the static model rules, and the step that runs them.

Where the model-class check ran (:mod:`ckptctl.verify.classes`, the library's own class and
loader), only the rules for what loaders let through run here; the others are the fallback for
``--static``, a library that is not installed, or a class it cannot build.

The rules are pure functions over tensor specs (name, dtype, shape); no file access, no torch.
The architecture is recognised from the tensor names (not from ``model_type``,
:mod:`ckptctl.verify.architectures`) and the prefix in front of the embedding (``model.``,
``model.language_model.``, none) is found, so bare base models and multimodal checkpoints work
too. Shapes are checked only where a tensor exists; quantized and encoder-decoder checkpoints are
skipped with an info finding. The step compares config.json with the family transformers would
load (``model.safetensors`` first, then the index, then ``pytorch_model*.bin``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import Any

from ckptctl import layout as L
from ckptctl.config_fields import CONFIG_DTYPES, ConfigFields, as_int, config_dtype
from ckptctl.findings import ERROR, INFO, WARNING, Finding, PathFindings
from ckptctl.format import names as N
from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.architectures import GENERATIVE, SPECS, Dims, Spec, unknown_family
from ckptctl.verify.context import Context
from ckptctl.verify.stacks import EXTRA_LAYER_FIELDS, check_experts, check_stacks, containers, count_findings, \
    expert_blocks
from ckptctl.tensor_names import RunPattern, TensorNames, dtypes, run_pattern
from ckptctl.verify.tied import tied_bytes_step
from ckptctl.verify.weights import transformers_rank

Tensors = Mapping[str, TensorSpec]

FLOATS = frozenset({"F16", "BF16", "F32", "F64"})
QUANT_DTYPES = frozenset({"F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4", "F6_E2M3",
                          "F6_E3M2"})
QUANT_SUFFIXES = (".qweight", ".qzeros", ".absmax", ".quant_map", ".quant_state", ".weight_scale",
                  ".weight_scale_inv", ".weight_packed", ".SCB", ".weight_zero_point", ".input_scale",
                  ".nested_absmax", ".g_idx")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer_config.json")

# keys diffusers writes into every config.json it saves (transformers never does)
DIFFUSERS_KEYS = ("_diffusers_version", "_class_name")

_FIX_CONFIG = "fix config.json (or re-export the checkpoint from the model that produced it)"
# (stored, config dtype) pairs transformers converts with a loss either way when it builds the
# model in the config's dtype (its default): float16 to bfloat16 drops 3 bits of every mantissa,
# bfloat16 to float16 drops 3 bits of exponent (values past 65504 become inf). A float32 checkpoint
# declared in half precision is the usual export of fp32 masters: a warning, not this.
LOSSY_DTYPES = frozenset({("F16", "BF16"), ("BF16", "F16")})


# Every name _detect matches ends with one of these (an embedding, a layer's first rule, or a
# newline that the layer pattern's '$' lets through): one pass picks the few candidates.
_DETECT_ENDS = tuple({s.embed for s in SPECS} | {"." + s.rules[0].suffix for s in SPECS} | {"\n"})


def _detect(tensors: "Tensors | TensorNames") -> tuple[Spec, str] | None:
    """The layout and the prefix in front of its embedding (e.g. ``model.``). Kept in the names'
    facts as (the layout's place in :data:`SPECS`, the prefix)."""
    names = TensorNames.of(tensors)
    if "detect" not in names.facts:
        found = _detect_in(names)
        names.facts["detect"] = None if found is None else (SPECS.index(found[0]), found[1])
    known = names.facts["detect"]
    return None if known is None else (SPECS[known[0]], known[1])


def name_facts(names: Iterable[str]) -> dict[str, Any] | None:
    """What the config rules work out from tensor names alone (expert blocks, layer stacks, the
    layout and its embedding and layer names), for ``names``: the facts a :class:`TensorNames` of the same set of names keeps, in
    plain values (a :class:`~ckptctl.layout.reading.MetadataReading`'s names work, run on an
    index's names by a worker beside the header decoding; :func:`check_config` takes them back
    through ``facts``, only for the very same names). None where a name holds a newline (the
    rules then read the names one by one)."""
    listed = list(names)
    text = "\n".join(["", *listed, ""])
    if text.count("\n") != len(listed) + 1:
        return None
    found = TensorNames.of_text(text)
    expert_blocks(found)
    containers(found)
    detected = _detect(found)
    if detected is not None:
        _layout_names(found, *detected)
    return found.facts


def _detect_in(names: TensorNames) -> tuple[Spec, str] | None:
    best: tuple[int, Spec, str] | None = None
    candidates = names.ending_any(_DETECT_ENDS)
    # every name ending with an embedding's name is a candidate: the look-up of one needs no table
    known = set(candidates)
    for spec in SPECS:
        embed, dot_embed = spec.embed, "." + spec.embed
        roots = {n[: len(n) - len(embed)] for n in candidates if n == embed or n.endswith(dot_embed)}
        first = spec.rules[0].suffix
        pat = re.compile(rf"^(.*?){spec.layer}\.\d+\.{re.escape(first)}$")
        roots.update(m.group(1) for n in candidates if (m := pat.match(n)))
        for root in sorted(roots):  # ties go to the first root in order, whatever the names' order
            hits = names.count_prefix(root + spec.layer + ".")
            has_embed = (root + spec.embed) in known
            score = hits + (1 << 40 if has_embed else 0)
            # an embedding name alone is no proof (BERT's embeddings.word_embeddings is not Falcon's)
            if hits and (best is None or score > best[0]):
                best = (score, spec, root)
    return (best[1], best[2]) if best else None


_SHAPE = attrgetter("shape")


def _fmt(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if x is None else str(x) for x in shape) + "]"


def _shape_ok(actual: tuple[int, ...], expected: tuple[int | None, ...] | None) -> bool:
    if expected is None or len(actual) != len(expected):
        return expected is None
    return all(e is None or a == e for a, e in zip(actual, expected))


def check_config(display: str, cfg: Any, tensors: Tensors, *, check_dtype: bool = True,
                 tokenizer_size: int | None = None, tokenizer_display: str | None = None,
                 class_checked: bool = False, facts: dict[str, Any] | None = None) -> list[Finding]:
    """Findings about config.json (already parsed) against the checkpoint's tensors.

    ``class_checked``: the model-class check judged these tensors (:mod:`ckptctl.verify.classes`),
    so the rules it decides the same way do not run (layer counts, projection, embedding and
    position shapes, an untied lm_head missing); the rules for what loaders let through do
    (dtype, quantization, tokenizer ids, MoE counts, a tied head stored too). ``facts``: what
    :func:`name_facts` worked out from exactly these tensors' names (the caller proved the set the
    same), so the rules do not work it out again."""
    ctx = PathFindings(display)
    if not isinstance(cfg, dict):
        ctx.add("config.bad_json", ERROR, f"{display}: top level is a JSON {type(cfg).__name__}, not an object",
                _FIX_CONFIG)
        return ctx.findings
    if any(k in cfg for k in DIFFUSERS_KEYS):
        ctx.add("config.not_checked", INFO, f"{display}: a diffusers config ({cfg.get('_class_name')!r}); the "
                "transformers rules do not apply")
        return ctx.findings
    c = ConfigFields(cfg)
    for key in ("architectures", "model_type"):
        if key not in cfg:
            ctx.add("config.missing_field", WARNING, f"{display}: no {key!r} (transformers needs it to pick a class)",
                    _FIX_CONFIG, field=key)
    quantized = isinstance(cfg.get("quantization_config"), dict) or isinstance(cfg.get("compression_config"), dict)
    names = TensorNames(tensors)
    if facts:
        names.facts.update(facts)
    _check_quantization(ctx, names, quantized)
    if check_dtype and not quantized:
        _check_dtype(ctx, c, names.tensors)
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    vocab = as_int(c.get("vocab_size"))
    if tokenizer_size is not None and vocab is not None and tokenizer_size > vocab:
        ctx.add("config.tokenizer_vocab", ERROR,
                f"{tokenizer_display or 'tokenizer'} has token ids up to {tokenizer_size - 1}, but vocab_size is "
                f"{vocab}: those tokens index past the embedding",
                "resize the embeddings (model.resize_token_embeddings) and re-export, or fix vocab_size",
                tokenizer_size=tokenizer_size, vocab_size=vocab)
    check_experts(ctx, cfg, names)
    found = None if cfg.get("is_encoder_decoder") else _detect(names)
    if class_checked:
        if found is not None:
            spec, root = found
            assert spec.dims is not None
            _check_embeddings(ctx, spec, root, spec.dims(c), names, c, False, quantized, shapes=False)
        return ctx.findings
    skip = f"{found[1]}{found[0].layer}" if found else None
    stacked = check_stacks(ctx, cfg, names, skip=skip)
    if cfg.get("is_encoder_decoder"):
        ctx.add("config.not_checked", INFO, f"{display}: encoder-decoder model; layer counts checked per stack, "
                "projection shapes not checked")
        return ctx.findings
    if found is None:
        ctx.add("config.not_checked", INFO,
                f"{display}: tensor names not recognised (model_type {cfg.get('model_type')!r}); "
                f"{'layer counts checked, ' if stacked else ''}shape checks skipped", None)
        return ctx.findings
    spec, root = found
    assert spec.dims is not None
    dims = spec.dims(c)
    other = unknown_family(spec, cfg)
    if other is not None:  # the same names, another layout: counted, not shape-checked
        _check_layers(ctx, spec, root, dims, names, quantized, sum(as_int(c.get(f)) or 0 for f in EXTRA_LAYER_FIELDS),
                      shapes=False)
        ctx.add("config.not_checked", INFO,
                f"{display}: model_type {other!r} has {spec.name} tensor names, but its layout is not one the static "
                f"rules know; layer counts checked, shapes not checked (the model-class check decides them)",
                None, model_type=other)
        return ctx.findings
    generative = any(isinstance(a, str) and a.endswith(GENERATIVE) for a in archs) or not archs
    _check_embeddings(ctx, spec, root, dims, names, c, generative, quantized)
    _check_layers(ctx, spec, root, dims, names, quantized,
                  sum(as_int(c.get(f)) or 0 for f in EXTRA_LAYER_FIELDS))
    return ctx.findings


def _quant_signal(t: TensorSpec) -> bool:
    """A tensor that only a quantized checkpoint holds."""
    return ((t.dtype in QUANT_DTYPES and t.name.endswith(".weight"))
            or t.name.endswith(QUANT_SUFFIXES)
            or (t.dtype in ("I8", "U8") and t.name.endswith(".weight") and len(t.shape) == 2))


def _check_quantization(ctx: PathFindings, names: TensorNames, quantized: bool) -> None:
    tensors = names.tensors.values()
    if quantized:  # one signal is enough
        if not any(map(_quant_signal, tensors)):
            ctx.add("config.quantization_unused", ERROR,
                    f"{ctx.path}: quantization_config is set but no tensor is quantized",
                    "remove quantization_config (the weights are plain floats) or export the quantized weights")
        return
    # a signal needs a quantized dtype or a quantization suffix: both are cheap to rule out first
    if names.dtypes.isdisjoint(QUANT_DTYPES | {"I8", "U8"}) and not names.any_ending(QUANT_SUFFIXES):
        return
    signals = [t.name for t in tensors if _quant_signal(t)]
    if signals:
        ctx.add("config.quantization_missing", ERROR,
                f"{ctx.path}: {len(signals)} tensors look quantized ({signals[0]!r}, ...) but there is no "
                "quantization_config", "copy the quantization_config of the quantized model into config.json",
                tensor=signals[0], count=len(signals))


def _float_counts(tensors: Tensors) -> dict[str, int]:
    """Float dtype -> elements stored in it."""
    counts: dict[str, int] = {}
    for t in tensors.values():
        if t.dtype in FLOATS:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
    return counts


def _dominant_float(tensors: Tensors) -> str | None:
    """The float dtype that holds the most elements (None: no float tensor). Elements are counted
    only when the tensors use more than one float dtype."""
    floats = dtypes(tensors) & FLOATS
    if len(floats) <= 1:
        return next(iter(floats), None)
    counts = _float_counts(tensors)
    return max(sorted(counts), key=lambda k: counts[k])


def _check_dtype(ctx: PathFindings, c: ConfigFields, tensors: Tensors) -> None:
    raw = c.get("dtype")
    if not isinstance(raw, str) or raw == "auto":
        return
    want = CONFIG_DTYPES.get(raw.removeprefix("torch."))
    if want is None:
        return
    dominant = _dominant_float(tensors)
    if dominant is not None and dominant != want:
        counts = _float_counts(tensors)
        if (dominant, want) in LOSSY_DTYPES and len(counts) == 1:
            ctx.add("config.dtype_lossy", ERROR,
                    f"{ctx.path}: dtype is {raw!r} but every float tensor is stored in {dominant}: transformers builds "
                    f"the model in {raw} and converts each weight on load, with a loss ({dominant} and {want} each "
                    "hold values the other cannot), so the loaded model is not the stored one",
                    f"set \"dtype\" in config.json to the stored {dominant.lower()}, or convert the weights with "
                    "`ckptctl resave --dtype` if the model is meant to run in the config's dtype",
                    config=raw, tensors=dominant)
            return
        ctx.add("config.dtype_mismatch", WARNING,
                f"{ctx.path}: dtype is {raw!r} but most parameters are {dominant} "
                f"({counts[dominant]:,} of {sum(counts.values()):,})",
                "set \"dtype\" in config.json to the tensors' dtype, or convert with `ckptctl resave --dtype`",
                config=raw, tensors=dominant)


def _layout_names(names: TensorNames, spec: Spec, root: str) -> dict[str, Any]:
    """What the embedding and layer rules read of the names of a layout at ``root``: the layer
    indices that hold tensors, the names of each rule's suffix, the lm_heads outside the layers,
    the position embeddings; each list in name order (the same whichever order the names came
    in). Kept in the names' facts (read it, never change it)."""
    key = f"layout_names:{SPECS.index(spec)}:{root}"
    known = names.facts.get(key)
    if known is None:
        indices, rules = _layer_patterns(root, spec)
        by_suffix: dict[str, list[str]] = {}
        for n, m in names.matching(rules):
            by_suffix.setdefault(m.group("suffix"), []).append(n)
        layer_prefix = root + spec.layer + "."
        known = names.facts[key] = {
            "present": {int(i) for (i,) in names.runs(indices)},
            "by_suffix": {k: sorted(v) for k, v in by_suffix.items()},
            "heads": sorted(n for n in names.ending(spec.lm_head)
                            if (n == spec.lm_head or n.endswith("." + spec.lm_head)) and not n.startswith(layer_prefix)),
            "positions": sorted(names.ending("embeddings.position_embeddings.weight")),
        }
    return known  # type: ignore[no-any-return]


def _check_embeddings(ctx: PathFindings, spec: Spec, root: str, d: Dims, names: TensorNames, c: ConfigFields,
                      generative: bool, quantized: bool, *, shapes: bool = True) -> None:
    """Embedding, lm_head and position shapes and an untied head missing (``shapes``), and a tied
    head stored too."""
    tensors = names.tensors
    embed = tensors.get(root + spec.embed)
    known = _layout_names(names, spec, root)
    lm = tensors[known["heads"][0]] if known["heads"] else None  # the first by name
    if shapes and not quantized:
        for t, role in ((embed, "embedding"), (lm, "lm_head")):
            if t is None or len(t.shape) != 2:
                continue
            if d.vocab is not None and t.shape[0] != d.vocab:
                ctx.add("config.vocab_mismatch", ERROR,
                        f"{role} {t.name!r} has {t.shape[0]} rows but vocab_size is {d.vocab}",
                        "set vocab_size to the embedding rows, or resize the embeddings and re-export",
                        tensor=t.name, rows=t.shape[0], vocab_size=d.vocab)
            if d.hidden is not None and t.shape[1] != d.hidden:
                ctx.add("config.hidden_mismatch", ERROR,
                        f"{role} {t.name!r} has {t.shape[1]} columns but hidden_size is {d.hidden}",
                        _FIX_CONFIG, tensor=t.name, columns=t.shape[1], hidden_size=d.hidden)
        if spec.position:
            pos = tensors.get(root + spec.position)
            if pos is not None and len(pos.shape) == 2 and d.max_pos is not None and pos.shape[0] != d.max_pos:
                ctx.add("config.position_mismatch", ERROR,
                        f"position embedding {pos.name!r} has {pos.shape[0]} rows but the config allows "
                        f"{d.max_pos} positions", _FIX_CONFIG, tensor=pos.name, rows=pos.shape[0],
                        max_positions=d.max_pos)
    bert_pos = tensors[known["positions"][0]] if known["positions"] else None
    if shapes and bert_pos is not None and d.max_pos is not None and bert_pos.shape and bert_pos.shape[0] != d.max_pos:
        ctx.add("config.position_mismatch", ERROR,
                f"position embedding {bert_pos.name!r} has {bert_pos.shape[0]} rows but max_position_embeddings "
                f"is {d.max_pos}", _FIX_CONFIG, tensor=bert_pos.name)
    tie = c.get("tie_word_embeddings")
    if shapes and tie is False and lm is None and embed is not None and generative:
        ctx.add("config.lm_head_missing", ERROR,
                f"tie_word_embeddings is false but no {spec.lm_head!r} tensor exists: the output layer would be "
                "randomly initialised", "set tie_word_embeddings to true if the head is tied, or export the "
                "lm_head weights too", tensor=spec.lm_head)
    elif tie is True and lm is not None and embed is not None:
        ctx.add("config.lm_head_tied_present", WARNING,
                f"tie_word_embeddings is true but {lm.name!r} is stored too; transformers ignores it, other "
                "loaders (vLLM) may fail or use it", "set tie_word_embeddings to false if the head is trained "
                "separately, or drop the tensor with `ckptctl resave`", tensor=lm.name)


def _layer_patterns(root: str, spec: Spec) -> tuple[RunPattern, RunPattern]:
    """The layers of ``root``: (index of every name ``<root><layer>.<i>.<rest>``, and the names
    whose rest is one of the spec's rule suffixes, with that suffix)."""
    lp = re.escape(root) + spec.layer
    suffixes = "|".join(re.escape(r.suffix) for r in spec.rules)
    return (run_pattern(rf"(?P<s>{lp}\.(?P<idx>\d+)\.)", r".+$", r"(?:\n(?P=s)[^\n]+)*", ("idx",)),
            run_pattern(rf"{lp}\.\d+\.(?P<suffix>{suffixes})", "$", ""))


def _check_layers(ctx: PathFindings, spec: Spec, root: str, d: Dims, tensors: "Tensors | TensorNames",
                  quantized: bool, extra_layers: int, *, shapes: bool = True) -> None:
    names = TensorNames.of(tensors)
    known = _layout_names(names, spec, root)
    present = known["present"]
    if d.layers is not None:
        count_findings(ctx, f"{root}{spec.layer}", present, d.layers, "num_hidden_layers", extra_layers)
    if not shapes:
        return
    if quantized:
        ctx.add("config.not_checked", INFO, f"{ctx.path}: quantized checkpoint; projection shapes not checked")
        return
    by_rule = {suffix: [names.tensors[n] for n in listed] for suffix, listed in known["by_suffix"].items()}
    for rule in spec.rules:
        expected_shape = rule.shape(d)
        rows = by_rule.get(rule.suffix, [])
        # the few distinct shapes first; the tensors are listed only for a finding
        if expected_shape is None or all(_shape_ok(s, expected_shape) for s in set(map(_SHAPE, rows))):
            continue
        bad = [t for t in rows if not _shape_ok(t.shape, expected_shape)]
        shapes = sorted({_fmt(t.shape) for t in bad})
        ctx.add(rule.code, ERROR,
                f"{len(bad)} tensors {root}{spec.layer}.N.{rule.suffix} have shape {', '.join(shapes)}; the config "
                f"({rule.what}) says {_fmt(expected_shape)}", _FIX_CONFIG, tensor=bad[0].name,
                expected=list(expected_shape), actual=[list(t.shape) for t in bad[:5]], count=len(bad))


def tokenizer_size(doc: Any) -> int | None:
    """Highest token id + 1 in a tokenizer.json document."""
    if not isinstance(doc, dict):
        return None
    top = -1
    model = doc.get("model")
    if isinstance(model, dict):
        vocab = model.get("vocab")
        if isinstance(vocab, dict):
            top = max((v for v in vocab.values() if isinstance(v, int)), default=-1)
        elif isinstance(vocab, list):
            top = len(vocab) - 1
    for tok in doc.get("added_tokens") or []:
        if isinstance(tok, dict) and isinstance(tok.get("id"), int):
            top = max(top, tok["id"])
    return top + 1 if top >= 0 else None


def config_step(ctx: Context) -> str | None:
    """config.json against the model family transformers would load, and the files a generative
    model's users need beside it; why it did not run, or None."""
    models = [t for t in ctx.tables if t.family.kind in (L.SAFETENSORS, L.PYTORCH) and t.family.variant is None]
    if not models:
        if ctx.layout is not None and ctx.layout.components:
            return "no component that transformers loads"
        return "no model weights: no safetensors or .bin family"
    if N.CONFIG not in ctx.names:
        ctx.add("config.missing", INFO, ctx.disp(), f"{ctx.disp()} has no config.json; config checks skipped",
                "copy config.json from the source model (transformers needs it)")
        return "no config.json"
    present, cfg = ctx.open_json(N.CONFIG, "config", "config.bad_json")
    if not present:
        return "config.json could not be read as JSON: see its finding"
    shown = ctx.disp(N.CONFIG)
    loaded = min(models, key=lambda t: transformers_rank(t.family))
    tok, tok_shown = None, None
    ok, doc = ctx.open_json("tokenizer.json", "config", "config.bad_json")
    if ok:
        tok, tok_shown = tokenizer_size(doc), ctx.disp("tokenizer.json")
    if not loaded.complete:
        ctx.add("config.not_checked", INFO, shown,
                "config.json is not compared with the tensors: some weights files are missing or unreadable")
    else:
        # save_pretrained(variant=...) beside a main family rewrites the one shared config.json with the
        # variant's dtype: a dtype that one family of the directory has is not a mismatch
        want = config_dtype(cfg)
        variant_match = any(want is not None and _dominant_float(t.tensors) == want
                            for t in ctx.tables if t.family.variant is not None)
        ctx.extend(check_config(shown, cfg, loaded.tensors, check_dtype=not variant_match, tokenizer_size=tok,
                                tokenizer_display=tok_shown, class_checked=ctx.class_checked,
                                facts=loaded.facts() if loaded.facts is not None else None))
        if ctx.options.deep and isinstance(cfg, dict):
            tied_bytes_step(ctx, cfg, loaded)
    if not isinstance(cfg, dict):
        return None
    tw = cfg.get("transformers_weights")
    if tw is not None:
        target = ctx.resolve(tw, code="config.weights_file_outside", source=shown, what="transformers_weights")
        if target is not None and not os.path.lexists(target):
            ctx.add("config.weights_file_missing", ERROR, shown,
                    f"config.json names transformers_weights {tw!r}, which does not exist",
                    "fix transformers_weights or restore the file", name=tw)
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    if any(isinstance(a, str) and a.endswith(GENERATIVE) for a in archs):
        if "generation_config.json" not in ctx.names:
            ctx.add("config.generation_config_missing", INFO, ctx.disp(),
                    "no generation_config.json (transformers writes one for generative models)",
                    "copy it from the source model if generation defaults matter")
        if not any(n in ctx.names for n in TOKENIZER_FILES):
            ctx.add("config.tokenizer_missing", INFO, ctx.disp(),
                    "no tokenizer files; users of the uploaded model will need one",
                    "save the tokenizer into the directory (tokenizer.save_pretrained)")
    return None
