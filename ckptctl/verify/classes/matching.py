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


def _stacked(tensors: Any, dim: int, cat: bool) -> Any:
    """``torch.stack`` (``cat``: ``torch.cat``) of meta tensors of one dtype as a new meta tensor of
    the result's shape, or None where the op itself must run (another device or dtype, shapes it
    would refuse: its own error is the one reported)."""
    import torch

    if not isinstance(tensors, list) or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    first = tensors[0]
    shape, dtype = tuple(first.shape), first.dtype
    n = len(shape) if cat else len(shape) + 1
    if not (-n <= dim < n) or (cat and n == 0):
        return None
    d = dim % n
    total = 0
    for t in tensors:
        if not t.is_meta or t.dtype != dtype:
            return None
        s = tuple(t.shape)
        if cat:
            if len(s) != len(shape) or s[:d] != shape[:d] or s[d + 1:] != shape[d + 1:]:
                return None
            total += s[d]
        elif s != shape:
            return None
    out = shape[:d] + (total,) + shape[d + 1:] if cat else shape[:d] + (len(tensors),) + shape[d:]
    return torch.empty(out, dtype=dtype, device="meta")


def shape_only_ops() -> dict[type, Any]:
    """transformers' ``MergeModulelist`` and ``Concatenate`` -> a copy of the op that makes the
    result of meta tensors from their shapes. On the meta device ``torch.stack``/``torch.cat`` run
    torch's Python reference ops (and import torch._dynamo on first use): 174 stacks of 256 experts
    cost about 1 s on DeepSeek-V3. Anything else (another device or dtype, shapes the op refuses)
    runs the library's op unchanged, so its errors are the loader's."""
    import torch
    from transformers.core_model_loading import Concatenate, MergeModulelist

    class _Merge(MergeModulelist):
        def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                    **kwargs: Any) -> dict[str, Any]:
            made = {k: v if isinstance(v, torch.Tensor) else _stacked(v, self.dim, cat=False)
                    for k, v in input_dict.items()}
            if any(v is None for v in made.values()):
                return super().convert(input_dict, source_patterns, target_patterns, **kwargs)
            size = len(input_dict)
            input_dict.clear()
            return {self.get_target_pattern(size, k, target_patterns): v for k, v in made.items()}

    class _Concat(Concatenate):
        def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                    **kwargs: Any) -> dict[str, Any]:
            parts: list[Any] = []
            for k in source_patterns:
                if k in input_dict:
                    v = input_dict[k]
                    parts.extend(v if isinstance(v, list) else [v])
            made = _stacked(parts, self.dim, cat=True)
            if made is None:
                return super().convert(input_dict, source_patterns, target_patterns, **kwargs)
            target = self.get_target_pattern(target_patterns)
            for k in source_patterns:
                input_dict.pop(k, None)
            return {target: made}

    def copy_as(cls: type) -> Any:
        def make(op: Any) -> Any:  # the op's own settings (dim, ...) on the shape-only class
            new = cls.__new__(cls)
            new.__dict__.update(op.__dict__)
            return new
        return make

    _Merge.__name__, _Concat.__name__ = MergeModulelist.__name__, Concatenate.__name__  # as the loader's errors name them
    return {MergeModulelist: copy_as(_Merge), Concatenate: copy_as(_Concat)}


def match_keys(model: Any, state_dict: dict[str, Any], weight_mapping: list[Any], hf_quantizer: Any = None) -> Any:
    """``convert_and_load_state_dict_in_model``'s key matching over meta tensors, step for step
    (its rename, its converters run on the meta tensors, its ``set_param_for_module``), without
    what only moving bytes needs (thread pool, device map, dtype casts, on-the-fly quantization;
    ``hf_quantizer``: a pre-quantized checkpoint's, passed on as the loader does) and without its
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
    meta_ops = shape_only_ops()
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
                    mapping.operations = [meta_ops.get(type(op), lambda o: o)(op) for op in mapping.operations]
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
            realized = mapping.convert(first, model=model, config=model.config, hf_quantizer=hf_quantizer,
                                       loading_info=info)
        except SkipParameters:
            continue
        for target, param in realized.items():
            set_param_for_module(model, target, param[0] if isinstance(param, list) else param, info, hf_quantizer)
    return info
