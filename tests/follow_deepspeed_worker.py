"""One rank of a 2-rank DeepSpeed ZeRO-2 run on the CPU (Gloo) that trains a tiny Llama and saves
three times into a DeepSpeed root (``run/global_stepN/``, ``latest``); after each save (and
DeepSpeed's closing barrier) rank 0 runs ``ckptctl export run hf --follow --once`` as a real
process while the job is alive, and keeps its JSON lines (``follow-N.jsonl``). Launched by
``tests/test_follow_zero.py`` through ``tests.support.ranks.build_once``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SAVES = (2, 4, 6)
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main() -> None:
    out = Path(sys.argv[1])
    run, dst = out / "run", out / "hf"
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from tests.test_zero_build import _groups, _model

    deepspeed.ops.__dict__["__compatible_ops__"] = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model("llama")
    opt = torch.optim.AdamW(_groups(model, None), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    step = 0
    for save in SAVES:
        while step < save:
            x = torch.randint(0, 101, (2, 8), generator=g)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            step += 1
        engine.save_checkpoint(str(run), tag=f"global_step{save}")
        if dist.get_rank() == 0:
            if save == SAVES[0]:
                model.config.save_pretrained(run)
            env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV and not k.startswith("CKPTCTL_")}
            done = subprocess.run([sys.executable, "-m", "ckptctl", "export", str(run), str(dst), "--follow", "--once",
                                   "--from", "all", "--quiet-period", "0", "--json", "--no-fsync", "--keep-last", "2"],
                                  capture_output=True, text=True, env=env)
            (out / f"follow-{save}.jsonl").write_text(done.stdout)
            (out / f"follow-{save}.err").write_text(f"{done.returncode}\n{done.stderr}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/test_zero_build.py: no teardown where a DeepSpeed thread can abort the process
