"""transformers as the oracle: the class ``from_pretrained`` would build, on the meta device, and
the loader's own key matching run over the checkpoint's header entries as meta tensors.

The steps are ``PreTrainedModel.from_pretrained``'s (transformers 5):

* the config: ``AutoConfig``'s choice from the local config.json alone, ``CONFIG_MAPPING[model_type]
  .from_dict`` (with its mistral/``layer_types`` heuristic); an ``auto_map`` the installed library
  cannot satisfy is remote code, never run;
* the class: ``architectures[0]`` when its config class is the config's; otherwise the class the
  same auto mapping gives the config's ``model_type`` (what ``AutoModelFor...`` loads);
* built under ``cls.get_init_context`` (meta device, no weight memory, no tying);
* ``convert_and_load_state_dict_in_model`` with ``get_model_conversion_mapping`` (key renames,
  fused-expert and legacy-name conversions, ``base_model_prefix`` added or stripped) and a
  ``{"": "meta"}`` device map, then ``tie_weights(missing_keys=...)`` and
  ``_adjust_missing_and_unexpected_keys`` (tied keys, ``_keys_to_ignore_on_load_*``, stale
  ``inv_freq``/``position_ids`` buffers). Non-persistent buffers are not in the state dict.

Nothing is downloaded, no remote code runs, no tensor byte is read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.classes.matching import match_keys
from ckptctl.verify.classes.outcome import NotChecked, Outcome, split_unexpected
from ckptctl.verify.classes.quiet import meta_state_dict, silenced


def _config(cfg: dict[str, Any]) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    doc = dict(cfg)
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
    return CONFIG_MAPPING[mt].from_dict(doc)


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
    """(the model from_pretrained builds for config.json, on the meta device; its dtype). Call it
    inside :func:`~ckptctl.verify.classes.quiet.silenced`."""
    import torch
    import transformers
    from transformers.utils.generic import ContextManagers

    if isinstance(cfg.get("quantization_config"), dict) or isinstance(cfg.get("compression_config"), dict):
        raise NotChecked("a quantized checkpoint: its layers exist only once a quantizer replaces them")
    config = _config(cfg)
    if class_name is not None:
        cls = getattr(transformers, class_name, None) if class_name.isidentifier() else None
        if cls is None:
            raise NotChecked(f"the installed transformers {transformers.__version__} has no class {class_name!r}")
    else:
        cls = _model_class(cfg, config)
    dtype = torch.float32  # shapes do not depend on it; every floating tensor is cast on load
    with ContextManagers(cls.get_init_context(dtype, False, False, None)):
        return cls(config), dtype


def check_transformers(cfg: dict[str, Any], tensors: Mapping[str, TensorSpec], where: str,
                       class_name: str | None = None, *, fast: bool = True) -> Outcome:
    """The loader's missing, unexpected and mismatched keys for the class config.json names
    (``class_name``: the class a pipeline's model_index.json names instead); ``fast``: the
    matching of :func:`match_keys` rather than the library's function."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    with silenced("transformers"):
        model, dtype = build_meta(cfg, class_name)
        load_config = LoadStateDictConfig(pretrained_model_name_or_path=where, ignore_mismatched_sizes=False,
                                          device_map={"": "meta"}, dtype=dtype, dtype_plan=model._get_dtype_plan(dtype),
                                          weight_mapping=get_model_conversion_mapping(model, None, None))
        if fast:
            info = match_keys(model, meta_state_dict(tensors), load_config.weight_mapping or [])
        else:  # the library's own function, which the fast path equals (tests/test_verify_model_class.py)
            info, _ = convert_and_load_state_dict_in_model(model=model, state_dict=meta_state_dict(tensors),
                                                           load_config=load_config)
        model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
        model._adjust_missing_and_unexpected_keys(info)
        modules = {n for n, _ in model.named_modules() if n}
    stored = set(tensors)
    prefix = getattr(model, "base_model_prefix", "") or ""
    info.unexpected_keys = {k for k in info.unexpected_keys if not _mtp_layer(k, cfg)}
    unexpected = sorted(_original(k, stored, prefix) for k in info.unexpected_keys)
    roots = {"", prefix} if prefix in modules else {""}
    bad = set(split_unexpected(sorted(info.unexpected_keys), modules, roots))
    return Outcome(
        library="transformers", cls=type(model).__name__, missing=sorted(info.missing_keys), unexpected=unexpected,
        disagrees=sorted(_original(k, stored, prefix) for k in bad),
        mismatched=sorted((_original(k, stored, prefix), tuple(got), tuple(want))
                          for k, got, want in info.mismatched_keys),
        conversion={str(k): str(v).splitlines()[0][:300] for k, v in (info.conversion_errors or {}).items()},
        on_missing="initialises them with random values and warns (its LOAD REPORT lists them as MISSING)",
        on_mismatch="raises (\"ignore_mismatched_sizes\" is False by default)",
        on_unexpected="drops them (its LOAD REPORT lists them as UNEXPECTED)")
