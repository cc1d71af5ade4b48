"""transformers as the oracle: the class ``from_pretrained`` would build, on the meta device, and
the loader's own key matching run over the checkpoint's header entries as meta tensors.

The steps are ``PreTrainedModel.from_pretrained``'s (transformers 5):

* the config: ``AutoConfig``'s choice from the local config.json alone, ``CONFIG_MAPPING[model_type]
  .from_dict`` (with its mistral/``layer_types`` heuristic); an ``auto_map`` the installed library
  cannot satisfy is remote code, never run;
* the class: ``architectures[0]`` when its config class is the config's; otherwise the class the
  same auto mapping gives the config's ``model_type`` (what ``AutoModelFor...`` loads);
* built under ``cls.get_init_context`` (meta device, no weight memory, no tying); an fp8
  block-quantized config.json with the quantizer ``get_hf_quantizer`` makes, whose
  ``preprocess_model`` replaces the Linear layers and whose conversions join the mapping
  (:mod:`.quantized`);
* ``convert_and_load_state_dict_in_model`` with ``get_model_conversion_mapping`` (key renames,
  fused-expert and legacy-name conversions, ``base_model_prefix`` added or stripped) and a
  ``{"": "meta"}`` device map, then ``tie_weights(missing_keys=...)`` and
  ``_adjust_missing_and_unexpected_keys`` (tied keys, ``_keys_to_ignore_on_load_*``, stale
  ``inv_freq``/``position_ids`` buffers). Non-persistent buffers are not in the state dict.

Nothing is downloaded, no remote code runs, no tensor byte is read.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.classes.guard import BoundHit, bound_hit
from ckptctl.verify.classes.matching import match_keys
from ckptctl.verify.classes.outcome import NotChecked, Outcome, Refused, split_unexpected
from ckptctl.verify.classes.quantized import (
    make_quantizer,
    not_built,
    quantization,
    quantize_meta,
    scale_words,
)
from ckptctl.verify.classes.quiet import meta_state_dict, silenced


def _config(cfg: dict[str, Any]) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from transformers import PretrainedConfig

    # {"__float__": "Infinity"}: how transformers writes inf and NaN (Mamba2's time_step_limit), decoded
    # as its from_pretrained decodes config.json
    decode = getattr(PretrainedConfig, "_decode_special_floats", None)
    doc = offline(dict(decode(cfg) if callable(decode) else cfg))
    mt = doc.get("model_type")
    remote = isinstance(doc.get("auto_map"), dict) and "AutoConfig" in doc["auto_map"]
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
        if remote:
            raise NotChecked(f"config.json's auto_map names remote code ({doc['auto_map']['AutoConfig']!r}) for "
                             f"model_type {mt!r}; verify never runs trust_remote_code code")
        if not isinstance(mt, str):
            raise NotChecked("config.json has no model_type: transformers cannot pick a config class")
        raise NotChecked(f"the installed transformers does not know model_type {mt!r}")
    if mt == "mistral" and "layer_types" in doc:  # AutoConfig's own heuristic
        doc["model_type"] = mt = "ministral"
    config = CONFIG_MAPPING[mt].from_dict(doc)
    config._attn_implementation = EAGER  # sets every sub-config's too: no kernel is fetched or run
    return config


ATTN_KEYS = ("attn_implementation", "_attn_implementation")
EAGER = "eager"


def offline(doc: Any, depth: int = 0) -> Any:
    """config.json as the class check builds it (issue 44): no attention implementation of its own
    (a kernel repository's name makes transformers fetch it; the class is built with ``eager``,
    whose modules are the same) and no pretrained backbone (``use_pretrained_backbone`` false:
    its weights would be downloaded, and the checkpoint's own replace them on load), in every
    sub-config. The shapes of the class do not depend on either."""
    if depth > 8 or not isinstance(doc, dict):
        return doc
    out = {k: offline(v, depth + 1) for k, v in doc.items() if k not in ATTN_KEYS}
    if "use_pretrained_backbone" in out:
        out["use_pretrained_backbone"] = False
    return out


def _auto_alternative(arch: str, model_type: str) -> str | None:
    """The class the auto mapping that holds ``arch`` gives ``model_type`` (AutoModelForCausalLM's
    choice for a config of another type), or None."""
    from transformers.models.auto import modeling_auto

    for name in dir(modeling_auto):
        if not (name.startswith("MODEL") and name.endswith("_MAPPING_NAMES")):
            continue
        table = getattr(modeling_auto, name)
        if isinstance(table, Mapping) and arch in table.values():
            other = table.get(model_type)
            if isinstance(other, str):
                return other
    return None


def _model_class(cfg: dict[str, Any], config: Any) -> Any:
    import transformers
    from transformers import PreTrainedModel

    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch is None:
        raise NotChecked("config.json names no architectures: which class a user loads is unknown")
    cls = getattr(transformers, arch, None) if arch.isidentifier() else None
    if cls is None:
        if isinstance(cfg.get("auto_map"), dict):
            raise NotChecked(f"architecture {arch!r} is remote code (config.json's auto_map); verify never runs "
                             "trust_remote_code code")
        raise NotChecked(f"the installed transformers {transformers.__version__} has no class {arch!r}")
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise NotChecked(f"{arch!r} is not a transformers model class")
    if not isinstance(config, cls.config_class):
        other = _auto_alternative(arch, config.model_type)
        alt = getattr(transformers, other, None) if other else None
        if alt is None:
            raise NotChecked(f"{arch!r} is built from {cls.config_class.__name__}, but model_type "
                             f"{config.model_type!r} gives {type(config).__name__}")
        cls = alt
    return cls


def _original(key: str, stored: set[str], prefix: str) -> str:
    """The checkpoint name of a key the loader reports after adding or stripping its prefix."""
    if key in stored or not prefix:
        return key
    if f"{prefix}.{key}" in stored:
        return f"{prefix}.{key}"
    short = key.removeprefix(prefix + ".")
    return short if short in stored else key


def stored_names(keys: set[str], stored: set[str], model: Any, weight_mapping: list[Any]) -> dict[str, list[str]]:
    """The loader's name of each key -> the stored names it came from: the name itself or with the
    prefix added or stripped, else the names its renames and converters turn into it (Swin's legacy
    ``attention.self.key`` reported as ``attention.k_proj``), else the loader's name. A finding names
    the tensors the file holds: what a user looks for, or drops with resave."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    prefix = getattr(model, "base_model_prefix", "") or ""
    out: dict[str, list[str]] = {}
    todo: set[str] = set()
    for k in keys:
        o = _original(k, stored, prefix)
        if o in stored:
            out[k] = [o]
        else:
            todo.add(k)
    if todo:  # the loader renamed them: run its renames over the stored names (only here: a broken checkpoint)
        renamings = [e for e in weight_mapping if isinstance(e, WeightRenaming)]
        converters = [e for e in weight_mapping if isinstance(e, WeightConverter)]
        by_pattern = {k: c for c in converters for k in c.source_patterns}
        meta = model.state_dict()
        for name in sorted(stored):
            renamed, pattern = rename_source_key(name, renamings, converters, prefix, meta)
            targets = by_pattern[pattern].target_patterns if pattern is not None else [None]
            for t in targets:  # a converter's source: reported under each of its targets (see match_keys)
                loader_name = renamed if t is None else renamed.replace(targets[0], t)
                if loader_name in todo:
                    out.setdefault(loader_name, []).append(name)
    for k in todo:
        out.setdefault(k, [k])
    return out


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _mtp_layer(key: str, cfg: dict[str, Any]) -> bool:
    """A multi-token-prediction layer the config declares after the decoder layers
    (``num_nextn_predict_layers``, DeepSeek-V3/GLM): stored on purpose, unused by the class (which
    ignores it only at the full model's own index, ``model.layers.61``)."""
    n, extra = cfg.get("num_hidden_layers"), cfg.get("num_nextn_predict_layers")
    if not (isinstance(n, int) and isinstance(extra, int) and extra > 0):
        return False
    m = _LAYER_INDEX.search(key)
    return m is not None and n <= int(m.group(1)) < n + extra


def build_meta(cfg: dict[str, Any], class_name: str | None = None) -> tuple[Any, Any]:
    """(the model from_pretrained builds for config.json, on the meta device; its dtype), for a
    config without quantization (a PEFT adapter's base). Call it inside
    :func:`~ckptctl.verify.classes.quiet.silenced`."""
    if quantization(cfg) is not None:
        raise NotChecked("a quantized checkpoint: its layers exist only once a quantizer replaces them")
    model, dtype, _ = build_loaded(cfg, class_name)
    return model, dtype


def build_loaded(cfg: dict[str, Any], class_name: str | None = None) -> tuple[Any, Any, Any]:
    """(the model from_pretrained builds for config.json, on the meta device; its dtype; the
    quantizer that replaced its layers, or None): an fp8 block-quantized config.json is built with
    its quantizer (:mod:`.quantized`), any other quantized one is a note. Call it inside
    :func:`~ckptctl.verify.classes.quiet.silenced`."""
    import torch
    import transformers
    from transformers.utils.generic import ContextManagers

    reason = not_built(cfg)
    if reason is not None:
        raise NotChecked(reason)
    with refusing("its config class"):
        config = _config(cfg)
    if class_name is not None:
        cls = getattr(transformers, class_name, None) if class_name.isidentifier() else None
        if cls is None:
            raise NotChecked(f"the installed transformers {transformers.__version__} has no class {class_name!r}")
    else:
        cls = _model_class(cfg, config)
    with refusing("its quantizer's config"):
        quantizer = make_quantizer(config) if quantization(cfg) is not None else None
    dtype = torch.float32  # shapes do not depend on it; every floating tensor is cast on load
    if quantizer is not None:
        dtype = quantizer.update_dtype(dtype)
    with refusing(f"{cls.__name__}'s constructor"), \
            ContextManagers(cls.get_init_context(dtype, quantizer is not None, False, None)):
        model = cls(config)
        if quantizer is not None:
            quantize_meta(quantizer, model, dtype)
    return model, dtype, quantizer


@contextlib.contextmanager
def refusing(step: str) -> Iterator[None]:
    """A step ``from_pretrained`` runs the same way: the library's own error there is
    :class:`Refused` (its loader raises it too). What says "not here" passes on: NotChecked, and
    a missing package or exhausted memory or recursion (a fact of this machine: a note), and what
    hit a bound of the box (:func:`~.guard.bound_hit`: memory, the network) as :class:`BoundHit`."""
    try:
        yield
    except (NotChecked, ImportError, MemoryError, RecursionError, BoundHit):
        raise
    except Exception as exc:  # noqa: BLE001 -- the library's refusal, whatever its type
        which = bound_hit(exc)  # not the library's judgement: a bound of the box (memory, network)
        if which is not None:
            raise BoundHit(which, exc) from None
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise Refused(f"{step} raises {type(exc).__name__}: {first}") from None


def check_transformers(cfg: dict[str, Any], tensors: Mapping[str, TensorSpec], where: str,
                       class_name: str | None = None, *, fast: bool | None = None) -> Outcome:
    """The loader's missing, unexpected and mismatched keys for the class config.json names
    (``class_name``: the class a pipeline's model_index.json names instead); ``fast``: the
    matching of :func:`match_keys` rather than the library's function (unset: the
    ``class-match`` fast path's switch, ``ckptctl.fastpaths``)."""
    from ckptctl.fastpaths import enabled

    if fast is None:
        fast = enabled("class-match")
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    with silenced("transformers"):
        model, dtype, quantizer = build_loaded(cfg, class_name)
        load_config = LoadStateDictConfig(pretrained_model_name_or_path=where, ignore_mismatched_sizes=False,
                                          device_map={"": "meta"}, dtype=dtype, dtype_plan=model._get_dtype_plan(dtype),
                                          hf_quantizer=quantizer,
                                          weight_mapping=get_model_conversion_mapping(model, None, quantizer))
        if fast:
            info = match_keys(model, meta_state_dict(tensors), load_config.weight_mapping or [], quantizer)
        else:  # the library's own function, which the fast path equals (tests/test_verify_model_class.py)
            info, _ = convert_and_load_state_dict_in_model(model=model, state_dict=meta_state_dict(tensors),
                                                           load_config=load_config)
        model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
        model._adjust_missing_and_unexpected_keys(info)
        modules = {n for n, _ in model.named_modules() if n}
    prefix = getattr(model, "base_model_prefix", "") or ""
    info.unexpected_keys = {k for k in info.unexpected_keys if not _mtp_layer(k, cfg)}
    names = stored_names(info.unexpected_keys | {k for k, _, _ in info.mismatched_keys}, set(tensors), model,
                         load_config.weight_mapping or [])
    roots = {"", prefix} if prefix in modules else {""}
    bad = set(split_unexpected(sorted(info.unexpected_keys), modules, roots))
    out = Outcome(
        library="transformers", cls=type(model).__name__, missing=sorted(info.missing_keys),
        unexpected=sorted({n for k in info.unexpected_keys for n in names[k]}),
        disagrees=sorted({n for k in bad for n in names[k]}),
        # a fused target's shape is not any one stored tensor's: named as the loader names it
        mismatched=sorted((names[k][0] if len(names[k]) == 1 else k, tuple(got), tuple(want))
                          for k, got, want in info.mismatched_keys),
        conversion={str(k): str(v).splitlines()[0][:300] for k, v in (info.conversion_errors or {}).items()},
        on_missing="initialises them with random values and warns (its LOAD REPORT lists them as MISSING)",
        on_mismatch="raises (\"ignore_mismatched_sizes\" is False by default)",
        on_unexpected="drops them (its LOAD REPORT lists them as UNEXPECTED)")
    if quantizer is not None:
        scale_words(out)
    return out
