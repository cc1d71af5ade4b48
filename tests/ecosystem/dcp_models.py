"""torch.distributed.checkpoint: one process, and two real processes training with FSDP2 over Gloo.

The model is the tiny Llama of ``transformers_models`` (DCP files then hold Hugging Face names).
Two-process entries run this module as two ranks (``python -m ecosystem.dcp_models RANK-ARGS``):
each rank builds the same seeded model, shards every decoder layer and the root with FSDP2
``fully_shard`` on a CPU mesh, trains ``STEPS`` AdamW steps on the same batch, and saves with
``dcp.save`` (so every tensor is a DTensor split across the two ``__<rank>_0.distcp`` files).
Their in-memory reference is the same training without FSDP in this process: on identical
batches FSDP2's averaged gradients equal the local ones bit for bit (a sum of two equal floats
halved is exact), which the corpus test checks.

The loader is ``dcp.load`` in one process into the unsharded model's (and AdamW's) state dict:
DCP reshards on load. Nested checkpoints are ``{"model": ..., "optimizer": ..., "step": STEPS}``
with the FQN-keyed optimizer state of ``get_optimizer_state_dict``; their tensors come back as
``model/<k>``, ``optimizer/<param fqn>/<state>`` and ``step``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from .entry import Recipe, count_parameters, module_tensors, prefixed, seeded
from .transformers_models import PARAMETERS, make_model, run_model

STEPS = 2
LR = 1e-2
TESTS_DIR = Path(__file__).resolve().parents[1]


def _batch() -> Any:
    import torch

    return torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(7))


def train(model: Any, steps: int = STEPS) -> Any:
    """AdamW on one fixed batch; returns the optimizer (its state is part of a training checkpoint)."""
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = _batch()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return opt


def _trained() -> dict[str, Any]:
    """The training every rank does, here, unsharded, on one thread as the ranks run (OMP_NUM_THREADS=1)."""
    import torch

    model = make_model("llama")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with seeded(0):
            opt = train(model)
    finally:
        torch.set_num_threads(threads)
    return {"model": model, "optimizer": opt, "step": STEPS}


def _train_state_tensors(state: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optim = get_optimizer_state_dict(state["model"], state["optimizer"])["state"]
    out = prefixed({"model": module_tensors(state["model"]),
                    "optimizer": {f"{fqn}/{k}": v for fqn, st in optim.items() for k, v in st.items()}})
    out["step"] = torch.tensor(state["step"])
    return out


# -- one process ----------------------------------------------------------------------------------


def _save_model(model: Any, d: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=d)


def load_model(d: Path) -> Any:
    """A fresh (differently seeded) Llama whose state dict ``dcp.load`` fills from ``d``."""
    import torch.distributed.checkpoint as dcp

    model = make_model("llama", seed=123)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=d)
    model.load_state_dict(sd, strict=True)
    return model


def _save_train_state(state: dict[str, Any], d: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(state["model"]),
              "optimizer": get_optimizer_state_dict(state["model"], state["optimizer"]),
              "step": state["step"]}, checkpoint_id=d)


def load_train_state(d: Path) -> dict[str, Any]:
    """Model, AdamW and step of a nested DCP, loaded into a fresh model and optimizer."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = make_model("llama", seed=123)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(model, opt)  # initialises AdamW's state so it can be loaded into
    state = {"model": model_sd, "optimizer": optim_sd, "step": -1}
    dcp.load(state, checkpoint_id=d)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return {"model": model.eval(), "optimizer": opt, "step": state["step"]}


# -- two processes --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, d: Path, world: int = 2, timeout: float = 300) -> None:
    """Run this module as ``world`` real ranks writing ``d``; raise with their stderr if one fails. A
    rendezvous port taken by someone else between our probe and the ranks' bind is retried."""
    for attempt in range(3):
        results = _run_ranks(scenario, d, world, timeout)
        if all(rc == 0 for rc, _ in results):
            return
        if not any("address already in use" in err.lower() for _, err in results) or attempt == 2:
            raise RuntimeError(f"{scenario}: ranks failed: " + "\n".join(
                f"rank {r}: exit {rc}\n{err[-3000:]}" for r, (rc, err) in enumerate(results)))
        for p in d.iterdir():  # nothing was saved before the rendezvous; clear it anyway
            p.unlink()


def _run_ranks(scenario: str, d: Path, world: int, timeout: float) -> list[tuple[int, str]]:
    port = _free_port()
    path = os.pathsep.join(p for p in [str(TESTS_DIR), os.environ.get("PYTHONPATH", "")] if p)
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                   PYTHONPATH=path)
        procs.append(subprocess.Popen([sys.executable, "-m", "ecosystem.dcp_models", scenario, str(d)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            _out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def rank_main(scenario: str, dest: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a dead peer fails us, not hangs us
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model("llama")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with seeded(0):
        opt = train(model)
    if scenario == "fsdp2":
        dcp.save(model.state_dict(), checkpoint_id=dest)
    elif scenario == "fsdp2-train-state":
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
                  "step": STEPS}, checkpoint_id=dest)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    dist.barrier()
    dist.destroy_process_group()


def recipes() -> list[Recipe]:
    p = PARAMETERS["llama"]
    common = dict(library="dcp", parameters=p, count=count_parameters, requires=("transformers",))
    nested = dict(library="dcp", parameters=p, reload=load_train_state, tensors=_train_state_tensors,
                  run=lambda s: run_model(s["model"]), count=lambda s: count_parameters(s["model"]),
                  requires=("transformers",))
    return [
        Recipe(name="dcp/single", layout="dcp", make=lambda: make_model("llama"), save=_save_model,
               reload=load_model, tensors=module_tensors, run=run_model,
               notes="dcp.save(model.state_dict()) in one process without a process group: .metadata + "
                     "__0_0.distcp", **common),
        Recipe(name="dcp/train-state", layout="dcp-nested", make=_trained, save=_save_train_state,
               notes="one process: {model, optimizer, step} after 2 AdamW steps", **nested),
        Recipe(name="dcp/fsdp2", layout="dcp", make=lambda: None, expected=lambda: _trained()["model"],
               spawns=True, save=lambda _none, d: launch("fsdp2", d), reload=load_model, tensors=module_tensors, run=run_model,
               notes="2 ranks, FSDP2 fully_shard over Gloo on CPU, 2 AdamW steps, dcp.save(model.state_dict()) "
                     "of DTensors: __0_0.distcp + __1_0.distcp; reference: the same training unsharded", **common),
        Recipe(name="dcp/fsdp2-train-state", layout="dcp-nested", make=lambda: None, expected=_trained,
               spawns=True, save=lambda _none, d: launch("fsdp2-train-state", d),
               notes="2 ranks, FSDP2 over Gloo: dcp.save({model, optimizer, step}) as FSDP2 training loops write "
                     "it; reference: the same training unsharded", **nested),
    ]


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (seconds of Gloo/thread shutdown on a loaded machine)
