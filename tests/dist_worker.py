"""A rank of a multi-rank test (run as a real process with the usual torch.distributed env)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    sd = {f"model.layers.{i}.weight": torch.randn(64, 32, generator=g) for i in range(12)}
    sd["model.norm.weight"] = torch.randn(32, generator=g)
    return sd


def save_dcp_sharded(dest: str) -> None:
    """A DCP checkpoint whose tensors are split across ranks (DTensor, Shard(0))."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items() if v.dim() == 2}
    sd["model.norm.weight"] = full_state()["model.norm.weight"]
    dcp.save({"model": sd, "step": 3}, checkpoint_id=dest)


def run_cli(argv: list[str]) -> None:
    """``ckptctl ARGV`` in this process (as ``python -m ckptctl`` under torchrun), its exit code
    written to ``$DIST_RC_DIR/<rank>`` (a rank killed by a signal writes none). ``DIST_SLOW`` =
    ``<rank>:<point>:<seconds>`` makes that rank sleep at that fault point (an interleaving)."""
    rank = os.environ["RANK"]
    slow = os.environ.get("DIST_SLOW")
    if slow:
        who, where, seconds = slow.split(":")
        if who == rank:
            import time

            from ckptctl import _faults

            plain = _faults.point

            def slowed(name: str) -> None:
                if name == where:
                    time.sleep(float(seconds))
                plain(name)

            _faults.point = slowed

    def record(code: object) -> None:
        if os.environ.get("DIST_RC_DIR"):
            value = code if isinstance(code, int) else (0 if code is None else 1)
            (Path(os.environ["DIST_RC_DIR"]) / rank).write_text(str(value))

    real_exit = os._exit

    def leave(code: int) -> None:
        record(code)
        real_exit(code)

    os._exit = leave
    sys.argv = ["ckptctl", *argv]
    from ckptctl.cli import main as cli_main

    try:
        cli_main()
    except SystemExit as exc:
        record(exc.code)
        raise


def main() -> None:
    if sys.argv[1] == "cli":
        run_cli(sys.argv[2:])
        return
    scenario, dest = sys.argv[1], sys.argv[2]
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    rank = int(os.environ["RANK"])
    fail = opts.pop("fail", None)  # {"rank": r, "at": point, "errno": "EIO"} or kill
    if fail and fail["rank"] == rank:
        os.environ["CKPTCTL_FAIL_AT" if fail.get("how") != "kill" else "CKPTCTL_KILL_AT"] = (
            f"{fail['at']}:{fail.get('errno', 'EIO')}" if fail.get("how") != "kill" else fail["at"])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    absent = opts.pop("absent", None)  # {"rank": r, "for": seconds}: that rank never calls the writer
    if absent and absent["rank"] == rank:
        import time

        time.sleep(absent["for"])
        os._exit(0)
    if scenario == "dcp-save":
        save_dcp_sharded(dest)
        dist.destroy_process_group()
        return
    from ckptctl.distributed import DistributedWriteError, save_state_dict_distributed
    from ckptctl.errors import CkptctlError

    sd = full_state()
    names = sorted(sd)
    # each rank holds a strided subset; the norm is replicated on every rank
    local = {n: sd[n] for i, n in enumerate(names) if i % world == rank or n == "model.norm.weight"}
    storage = opts.pop("storage", "shared")
    if storage == "node-local":
        node = rank // int(os.environ["LOCAL_WORLD_SIZE"])
        dest = str(Path(dest) / f"node{node}" / "ckpt")
        # every node holds everything (data parallel across nodes, split within a node)
        lw = int(os.environ["LOCAL_WORLD_SIZE"])
        local = {n: sd[n] for i, n in enumerate(names) if i % lw == int(os.environ["LOCAL_RANK"]) or
                 n == "model.norm.weight"}
    code = 0
    import time

    started = time.monotonic()
    try:
        res = save_state_dict_distributed(local, dest, storage=storage, timeout=opts.pop("timeout", 60),
                                          extras={"config.json": b'{"model_type": "test"}'}, **opts)
        print(json.dumps({"rank": rank, "ok": True, "publish": res.publish}), flush=True)
    except (DistributedWriteError, CkptctlError) as exc:
        print(json.dumps({"rank": rank, "ok": False, "phase": exc.phase, "message": exc.message, "hint": exc.hint,
                          "type": type(exc).__name__, "exit_code": exc.exit_code,
                          "seconds": time.monotonic() - started,
                          "failures": {str(k): v for k, v in getattr(exc, "failures", {}).items()}}), flush=True)
        code = exc.exit_code
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError):  # a group broken by a peer that died
        pass
    os._exit(code)


if __name__ == "__main__":
    main()
