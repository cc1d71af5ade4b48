"""diffusers and sentence-transformers as the oracle: the class their loader builds, on the meta
device, and their key matching.

diffusers (``ModelMixin.from_pretrained``, diffusers 0.3x-0.4x): ``cls.from_config(config.json)``
under ``no_init_weights()`` and ``accelerate.init_empty_weights()``; a single-file checkpoint's keys
go through ``_fix_state_dict_keys_on_load`` (deprecated attention-block names); then missing =
expected - loaded (initialised, warned), unexpected = loaded - expected less
``_keys_to_ignore_on_load_unexpected`` (warned, dropped), and a shape that differs raises
(``load_model_dict_into_meta``). The class is the config's ``_class_name``, or the one the
pipeline's ``model_index.json`` names for the component (what ``DiffusionPipeline`` loads).

sentence-transformers modules (``Dense``, ``LayerNorm``, ...): the module class ``modules.json``
names (only inside the ``sentence_transformers`` package), built from its folder's config.json as
``Module.load`` builds it, and its strict weight loading: every difference raises.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.classes.outcome import NotChecked, Outcome, Refused, split_unexpected

ST_PACKAGE = "sentence_transformers"


def _empty_weights() -> Any:
    """Parameters and buffers on the meta device (a buffer made from the config, a positional
    table of ``sample_size / patch_size`` squared rows, costs nothing there)."""
    try:
        from accelerate import init_empty_weights
    except ImportError:
        import torch

        return torch.device("meta")
    return init_empty_weights(include_buffers=True)


def check_diffusers(cfg: dict[str, Any], tensors: Mapping[str, TensorSpec], class_name: str | None,
                    single_file: bool) -> Outcome:
    """The loader's missing, unexpected and mismatched keys of a diffusers model component."""
    import diffusers
    from diffusers.models.modeling_utils import ModelMixin, no_init_weights

    from ckptctl.verify.classes.quiet import silenced

    name = class_name or cfg.get("_class_name")
    if not isinstance(name, str) or not name.isidentifier():
        raise NotChecked("config.json names no diffusers class (_class_name)")
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise NotChecked(f"the installed diffusers {diffusers.__version__} has no class {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, ModelMixin)):
        raise NotChecked(f"{name!r} is not a diffusers model class")
    if isinstance(cfg.get("quantization_config"), dict):
        raise NotChecked("a quantized component: its layers exist only once a quantizer replaces them")
    with silenced("diffusers"):
        with no_init_weights(), _empty_weights():
            model = cls.from_config(dict(cfg))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        modules = {n for n, _ in model.named_modules() if n}
        keys: dict[str, str] = {k: k for k in tensors}  # loaded name -> stored name
        if single_file:
            fixed = model._fix_state_dict_keys_on_load(dict(keys))
            keys = dict(fixed) if isinstance(fixed, dict) else keys
    ignore = list(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])
    unexpected = sorted(k for k in keys if k not in expected and not any(re.search(p, k) for p in ignore))
    mismatched = sorted((keys[k], tuple(tensors[keys[k]].shape), expected[k]) for k in keys
                        if k in expected and tuple(tensors[keys[k]].shape) != expected[k])
    return Outcome(library="diffusers", cls=name, missing=sorted(k for k in expected if k not in keys),
                   unexpected=[keys[k] for k in unexpected],
                   disagrees=[keys[k] for k in split_unexpected(unexpected, modules, {""})], mismatched=mismatched,
                   on_missing="initialises them (\"newly initialized\" warning)",
                   on_mismatch="raises (\"Cannot load ... expected shape\")",
                   on_unexpected="drops them (\"Some weights of the model checkpoint ... were not used\")")


# what sentence-transformers writes for an activation (``fullname``: torch.nn.modules.activation.Tanh)
# and what a user may write (torch.nn.Tanh): the only names the class check resolves
TORCH_NN_CLASS = re.compile(r"torch\.nn\.(?:modules\.([a-z_]+)\.)?([A-Z][A-Za-z0-9_]*)")


def torch_nn_class(name: Any) -> str | None:
    """The class name of a ``torch.nn`` activation path (``torch.nn.Tanh``,
    ``torch.nn.modules.activation.Tanh``), or None for any other value."""
    m = TORCH_NN_CLASS.fullmatch(name) if isinstance(name, str) else None
    return m.group(2) if m else None


def resolve_activation(path: str) -> Any:
    """The ``torch.nn`` class ``path`` names, from the modules torch has already imported (no
    import runs: issue 44). sentence-transformers imports the path to load it; a path that is not
    a ``torch.nn.Module`` class there makes its loader raise, and so :class:`Refused`."""
    import sys

    import torch

    name = torch_nn_class(path)
    cls = getattr(torch.nn, name, None) if name else None
    module = path.rpartition(".")[0]
    loaded = sys.modules.get(module)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)) or \
            (module != "torch.nn" and getattr(loaded, name, None) is not cls):
        raise Refused(f"its activation_function {path!r} is not a torch.nn.Module class (sentence-transformers' "
                      "Dense.load raises)")
    return cls


def check_st_module(cfg: dict[str, Any], tensors: Mapping[str, TensorSpec], class_path: str) -> Outcome:
    """A sentence-transformers module (not the root transformer) against its module class, built
    as ``Module.load`` builds it (config keys the constructor takes; an activation only from
    ``torch.``, as without trust_remote_code)."""
    import importlib
    import inspect

    import torch

    from ckptctl.verify.classes.quiet import silenced

    parts = class_path.split(".")
    if parts[0] != ST_PACKAGE or len(parts) < 3 or not all(p.isidentifier() for p in parts):
        raise NotChecked(f"module type {class_path!r} is not a sentence-transformers class; verify imports no "
                         "other code")
    with silenced("sentence_transformers"):
        try:
            module = importlib.import_module(".".join(parts[:-1]))
        except ImportError as exc:
            raise NotChecked(f"{class_path!r} cannot be imported from the installed sentence-transformers "
                             f"({type(exc).__name__})") from None
        cls = getattr(module, parts[-1], None)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise NotChecked(f"the installed sentence-transformers has no module class {class_path!r}")
        accepted = set(inspect.signature(cls).parameters)
        kwargs = {k: v for k, v in cfg.items() if k in accepted and k != "activation_function"}
        act = cfg.get("activation_function")
        if "activation_function" in accepted and torch_nn_class(act) is not None:
            kwargs["activation_function"] = resolve_activation(act)
        with torch.device("meta"):
            if isinstance(kwargs.get("activation_function"), type):
                kwargs["activation_function"] = kwargs["activation_function"]()
            model = cls(**kwargs)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    modules = {n for n, _ in model.named_modules() if n}
    unexpected = sorted(k for k in tensors if k not in expected)
    strict = "raises (sentence-transformers loads module weights strictly)"
    return Outcome(library="sentence-transformers", cls=parts[-1],
                   missing=sorted(k for k in expected if k not in tensors), unexpected=unexpected,
                   disagrees=split_unexpected(unexpected, modules, {""}),
                   mismatched=sorted((k, tuple(tensors[k].shape), expected[k]) for k in tensors
                                     if k in expected and tuple(tensors[k].shape) != expected[k]),
                   on_missing=strict, on_mismatch=strict, on_unexpected=strict, unexpected_raises=True)
