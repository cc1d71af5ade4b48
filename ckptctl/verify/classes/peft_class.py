"""peft as the oracle: the adapter's config applied to its base model's class, built on the meta
device, and peft's own loading of the adapter's keys into it (``PeftModel.load_adapter``:
``set_peft_model_state_dict``, then the missing keys it reports, those of this adapter), the
adapter's layers injected on the meta device (``low_cpu_mem_usage``).

The base model's class is built as :func:`~.transformers_class.build_meta` builds any
transformers class, from the base model's config.json (``--base``, or the adapter's
``base_model_name_or_path`` when it is local); no base weights are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.classes.outcome import NotChecked, Outcome
from ckptctl.verify.classes.quiet import meta_state_dict, silenced

ADAPTER = "default"  # the adapter name PeftModel.from_pretrained gives a loaded adapter


def check_peft(acfg: dict[str, Any], tensors: Mapping[str, TensorSpec], base_cfg: dict[str, Any]) -> Outcome:
    """peft's missing and unexpected adapter keys (and its size-mismatch error) for this adapter
    on its base model's class."""
    import peft
    from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING
    from peft.utils import set_peft_model_state_dict

    from ckptctl.verify.classes.transformers_class import build_meta

    peft_type = acfg.get("peft_type")
    if not isinstance(peft_type, str):
        raise NotChecked("adapter_config.json names no peft_type")
    with silenced("transformers", "peft"):
        base, _ = build_meta(base_cfg)
        config = peft.PeftConfig.from_peft_type(**{k: v for k, v in acfg.items() if k != "base_model_name_or_path"})
        config.inference_mode = True
        # the adapter's layers made on the meta device (peft's init_empty_weights), never on the CPU first
        model = peft.PeftModel(base, config, adapter_name=ADAPTER, low_cpu_mem_usage=True)
        cls = f"{peft_type} on {type(base).__name__}"
        try:
            result = set_peft_model_state_dict(model, meta_state_dict(tensors), adapter_name=ADAPTER)
        except RuntimeError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln]
            return Outcome(library="peft", cls=cls, conversion={"adapter": (lines or [str(exc)])[0][:300]},
                           on_mismatch="raises RuntimeError (size mismatch)")
    prefix = PEFT_TYPE_TO_PREFIX_MAPPING.get(config.peft_type, "")
    missing = sorted(k.replace(f".{ADAPTER}.", ".").removesuffix(f".{ADAPTER}")
                     for k in result.missing_keys if prefix in k and ADAPTER in k)
    unexpected = sorted(k for k in result.unexpected_keys if k in tensors)
    return Outcome(library="peft", cls=cls, missing=missing, unexpected=unexpected,
                   on_missing="warns \"Found missing adapter keys\" and leaves them at their initial values",
                   on_unexpected="ignores them (load_state_dict with strict=False)")
