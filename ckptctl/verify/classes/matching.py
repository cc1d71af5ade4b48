"""The fast path of the transformers class check (design I14): transformers' own key matching
(``convert_and_load_state_dict_in_model``) over meta tensors, step for step, without what only
moving bytes needs. ``check_transformers(fast=False)`` runs the library's function instead, and
tests/test_verify_model_class.py compares both on every corpus checkpoint and on breakages."""

from __future__ import annotations

from typing import Any


def natural_order(names: Any, part_key: Any) -> list[str]:
    """``sorted(names, key=dot_natural_key)``, the loader's order, with the key of each dotted part
    computed once (a checkpoint's 92,000 names repeat a few hundred parts): ``part_key`` is
    transformers' ``dot_natural_key``, applied to one part."""
    seen: dict[str, Any] = {}

    def key(name: str) -> tuple[Any, ...]:
        out = []
        for part in name.split("."):
            k = seen.get(part)
            if k is None:
                k = seen[part] = part_key(part)[0]
            out.append(k)
        return tuple(out)

    return sorted(names, key=key)


def match_keys(model: Any, state_dict: dict[str, Any], weight_mapping: list[Any]) -> Any:
    """``convert_and_load_state_dict_in_model``'s key matching over meta tensors, step for step
    (its rename, its converters run on the meta tensors, its ``set_param_for_module``), without
    what only moving bytes needs (thread pool, device map, dtype casts, quantizer) and without its
    deep copy of a converter for every key (it keeps only the first per target: 44,000 copies
    thrown away on DeepSeek-V3). The seam of I14: ``check_transformers(fast=False)`` runs the
    library's function instead, and the tests compare both."""
    from copy import deepcopy

    from transformers.core_model_loading import (
        SkipParameters,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
        set_param_for_module,
    )
    from transformers.utils.loading_report import LoadStateDictInfo

    prefix = model.base_model_prefix
    meta = model.state_dict()
    info = LoadStateDictInfo(missing_keys=set(meta), unexpected_keys=set(), mismatched_keys=set(),
                             conversion_errors={}, error_msgs=[], skipped_pp_keys=set())
    renamings = [e for e in weight_mapping if isinstance(e, WeightRenaming)]
    converters = [e for e in weight_mapping if isinstance(e, WeightConverter)]
    by_pattern = {k: c for c in converters for k in c.source_patterns}
    to_load: dict[str, Any] = {}
    for original in natural_order(state_dict, dot_natural_key):
        tensor = state_dict[original]
        renamed, pattern = rename_source_key(original, renamings, converters, prefix, meta)
        if renamed not in meta and original in meta:
            renamed, pattern = rename_source_key(original, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if renamed in meta:
            mapping = to_load.get(renamed)
            if pattern is not None:
                if mapping is None:
                    mapping = to_load[renamed] = deepcopy(by_pattern[pattern])
            else:
                if mapping is None:
                    mapping = to_load[renamed] = WeightRenaming(original, renamed)
                pattern = original
            mapping.add_tensor(renamed, original, pattern, tensor)  # a tensor: what the loader materialises
        elif pattern is not None:
            targets = by_pattern[pattern].target_patterns
            info.unexpected_keys.update(renamed.replace(targets[0], k) for k in targets)
        else:
            info.unexpected_keys.add(renamed)
    for first, mapping in to_load.items():
        try:
            realized = mapping.convert(first, model=model, config=model.config, hf_quantizer=None, loading_info=info)
        except SkipParameters:
            continue
        for target, param in realized.items():
            set_param_for_module(model, target, param[0] if isinstance(param, list) else param, info, None)
    return info
