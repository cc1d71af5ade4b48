"""The writers without a model format of their own: accelerate, huggingface_hub, safetensors.

* accelerate ``Accelerator.save_model`` (sharded safetensors + index, no config) and ``save_state``
  (``model.safetensors``, ``optimizer.bin``, ``random_states_0.pkl`` after one AdamW step);
  loaded by ``load_checkpoint_in_model`` / ``load_state`` into a fresh model (and optimizer).
* huggingface_hub ``save_torch_state_dict`` (tied GPT-2: the duplicate dropped; single and sharded),
  loaded by ``load_torch_model``.
* safetensors ``save_file`` (``model.safetensors`` of an untied Llama) loaded by ``load_file``, and
  ``save_model`` (tied GPT-2) loaded by ``load_model``.

No config.json is written (these libraries do not write one). Loads go into a model built with a
different seed, so a tensor the loader did not fill shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .entry import Recipe, count_parameters, module_tensors, prefixed, seeded
from .transformers_models import PARAMETERS as MODEL_PARAMETERS
from .transformers_models import SHARD, make_model, run_model

FILE = "model.safetensors"


def _fresh(model_type: str) -> Any:
    return make_model(model_type, seed=123)


def _recipe(name: str, library: str, layout: str, model_type: str, save: Any, reload: Any, notes: str) -> Recipe:
    return Recipe(name=name, library=library, layout=layout, parameters=MODEL_PARAMETERS[model_type],
                  make=lambda: make_model(model_type), save=save, reload=reload, tensors=module_tensors,
                  run=run_model, count=count_parameters, notes=notes,
                  requires=(library.replace("hub", "huggingface_hub"), "transformers"))


# -- accelerate -----------------------------------------------------------------------------------


def _accelerator() -> Any:
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _load_accelerate_model(d: Path) -> Any:
    from accelerate import load_checkpoint_in_model

    model = _fresh("gpt2")
    load_checkpoint_in_model(model, str(d), strict=True)
    return model.eval()


def _train_state() -> dict[str, Any]:
    """Model + AdamW after one step on a fixed batch, prepared by an Accelerator."""
    import torch

    acc = _accelerator()
    model = make_model("llama")
    with seeded(0):
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(7))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    return {"accelerator": acc, "model": model.eval(), "optimizer": opt}


def _load_state(d: Path) -> dict[str, Any]:
    import torch

    acc = _accelerator()
    model = _fresh("llama")
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with seeded(0):  # load_state restores the saved RNG states: keep the caller's
        acc.load_state(str(d))
    return {"accelerator": acc, "model": model.eval(), "optimizer": opt}


def _state_tensors(state: dict[str, Any]) -> dict[str, Any]:
    optim = state["optimizer"].state_dict()["state"]
    return prefixed({"model": module_tensors(state["model"]),
                     "optimizer": {f"{i}/{k}": v for i, st in optim.items() for k, v in st.items()}})


# -- huggingface_hub and safetensors -------------------------------------------------------------


def _save_hub(shard: str | None) -> Any:
    def save(model: Any, d: Path) -> None:
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict(model.state_dict(), d, **({"max_shard_size": shard} if shard else {}))
    return save


def _load_hub(model_type: str) -> Any:
    """``load_torch_model``; strict=False, because for a tied model save_torch_state_dict keeps the name the
    model does not register as a parameter (GPT-2: lm_head.weight, not transformer.wte.weight), so its own
    strict load fails. What it reports missing must then be aliases of loaded tensors, nothing else."""
    def reload(d: Path) -> Any:
        from huggingface_hub import load_torch_model

        model = _fresh(model_type)
        result = load_torch_model(model, d, strict=False)
        sd = model.state_dict()
        loaded = {sd[k].data_ptr() for k in sd if k not in result.missing_keys}
        stray = [k for k in result.missing_keys if sd[k].data_ptr() not in loaded]
        if result.unexpected_keys or stray:
            raise AssertionError(f"{d}: load_torch_model left {stray} unloaded, did not use {result.unexpected_keys}")
        return model.eval()
    return reload


def _save_file(model: Any, d: Path) -> None:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(d / FILE), metadata={"format": "pt"})


def _load_file(d: Path) -> Any:
    from safetensors.torch import load_file

    model = _fresh("llama")
    model.load_state_dict(load_file(str(d / FILE)), strict=True)
    return model.eval()


def _save_model(model: Any, d: Path) -> None:
    from safetensors.torch import save_model

    d.mkdir(parents=True, exist_ok=True)
    save_model(model, str(d / FILE))


def _load_model(d: Path) -> Any:
    from safetensors.torch import load_model

    model = _fresh("gpt2")
    load_model(model, str(d / FILE), strict=True)
    return model.eval()


def recipes() -> list[Recipe]:
    return [
        _recipe("accelerate/save-model", "accelerate", "sharded", "gpt2",
                lambda m, d: _accelerator().save_model(m, d, max_shard_size=SHARD), _load_accelerate_model,
                "Accelerator.save_model of a tied GPT-2, max_shard_size=20KB: model-0000i-of-0000N.safetensors + "
                "model.safetensors.index.json, no config.json"),
        Recipe(name="accelerate/save-state", library="accelerate", layout="accelerate-state",
               parameters=MODEL_PARAMETERS["llama"], make=_train_state,
               save=lambda s, d: s["accelerator"].save_state(str(d)), reload=_load_state, tensors=_state_tensors,
               run=lambda s: run_model(s["model"]), count=lambda s: count_parameters(s["model"]),
               notes="Accelerator.save_state after one AdamW step: model.safetensors + optimizer.bin + "
                     "random_states_0.pkl; tensors as model/<k> and optimizer/<param index>/<state>",
               requires=("accelerate", "transformers")),
        _recipe("hub/save-torch-state-dict", "hub", "single", "gpt2", _save_hub(None), _load_hub("gpt2"),
                "huggingface_hub.save_torch_state_dict of a tied GPT-2: model.safetensors keeps lm_head.weight and "
                "drops transformer.wte.weight, so load_torch_model(strict=True) fails on it (loaded strict=False; "
                "only the tied alias may be missing)"),
        _recipe("hub/save-torch-state-dict-sharded", "hub", "sharded", "llama", _save_hub(SHARD), _load_hub("llama"),
                "huggingface_hub.save_torch_state_dict, max_shard_size=20KB: model-0000i-of-0000N.safetensors + "
                "model.safetensors.index.json"),
        _recipe("safetensors/save-file", "safetensors", "single", "llama", _save_file, _load_file,
                "safetensors.torch.save_file(state_dict, 'model.safetensors', metadata={'format': 'pt'}), "
                "read back by load_file"),
        _recipe("safetensors/save-model", "safetensors", "single", "gpt2", _save_model, _load_model,
                "safetensors.torch.save_model of a tied GPT-2 (one name of the shared tensor kept), read back "
                "by load_model"),
    ]
